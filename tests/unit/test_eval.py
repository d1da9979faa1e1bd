"""Evaluation pieces: pass@k against hand-worked values, per-set summaries of scored samples, and
eval sets read from data.eval in file order with inherited keys. CPU, seconds."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from math import comb

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rlx.data.config import DataConfig, EvalSetConfig
from rlx.errors import DataError
from rlx.eval import build_eval_sets
from rlx.eval.metrics import pass_at_k, summarise
from rlx.models.tiny import write_word_tokenizer
from rlx.sample import Sample, Status

# ---- pass@k ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 1, 0.4),  # 1 - C(3,1)/C(5,1) = 1 - 3/5
        (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 4, 1.0),  # only 3 wrong samples: any 4 include a right one
        (4, 0, 2, 0.0),  # 1 - C(4,2)/C(4,2)
        (4, 4, 1, 1.0),
        (10, 1, 1, 0.1),  # pass@1 is c/n
        (200, 1, 1, 0.005),
    ],
)
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_exact_binomials_where_they_are_huge():
    # C(1000, 100) has 140 digits; the product form never builds it
    exact = 1 - Fraction(comb(990, 100), comb(1000, 100))
    assert pass_at_k(1000, 10, 100) == pytest.approx(float(exact), rel=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5)])
def test_pass_at_k_refuses_impossible_counts(n, c, k):
    with pytest.raises(ValueError, match=f"n={n}"):
        pass_at_k(n, c, k)


# ---- summarise -------------------------------------------------------------------------------


def scored(rewards_by_prompt: list[list[float | None]]) -> list[Sample]:
    return [
        Sample(
            prompt="",
            prompt_ids=[],
            reward=reward,
            status=Status.FAILED if reward is None else Status.COMPLETED,
            metadata={"prompt_index": p, "eval_set": "math"},
        )
        for p, rewards in enumerate(rewards_by_prompt)
        for reward in rewards
    ]


# 3 prompts x 4 samples; correct means reward >= 1.0, a sample without a reward is wrong (and 0)
SCORED = scored(
    [
        [1.0, 0.0, 1.0, 0.5],  # c=2 (0.5 is partial credit, not correct)
        [0.0, 0.0, 0.0, 0.0],  # c=0
        [1.0, 1.0, 1.0, None],  # c=3, one failed
    ]
)


def test_summarise_by_hand():
    metrics = summarise("math", SCORED, ks=(2, 4, 5))
    assert metrics == pytest.approx(
        {
            "eval/math/reward_mean": 5.5 / 12,  # (2.5 + 0 + 3 + 0) / 12 samples
            "eval/math/pass@1": 1.25 / 3,  # (2/4 + 0/4 + 3/4) / 3 prompts
            # prompt 0: 1 - C(2,2)/C(4,2) = 5/6; prompt 1: 0; prompt 2: 1 wrong < 2 drawn -> 1
            "eval/math/pass@2": (5 / 6 + 0 + 1) / 3,
            # prompts 0 and 2 have fewer than 4 wrong samples -> 1; prompt 1 -> 0
            "eval/math/pass@4": 2 / 3,
            # pass@5 is left out: each prompt has only 4 samples
            "eval/math/num_failed": 1.0,
        }
    )


def test_a_sample_whose_reward_failed_counts_as_failed_and_wrong():
    """The scorer marks a reward function that raised as FAILED with reward 0.0 (not None)."""
    samples = scored([[1.0, 1.0]])
    samples[1].status = Status.FAILED  # its reward stays 1.0: a failed sample is never correct
    metrics = summarise("m", samples)
    assert metrics == pytest.approx(
        {"eval/m/reward_mean": 0.5, "eval/m/pass@1": 0.5, "eval/m/num_failed": 1.0}
    )


def test_summarise_with_a_lower_threshold():
    # reward >= 0.5: prompt 0 now has c=3 -> pass@1 = (3/4 + 0 + 3/4) / 3
    assert summarise("math", SCORED, threshold=0.5)["eval/math/pass@1"] == pytest.approx(0.5)


def test_summarise_with_unequal_group_sizes():
    samples = scored([[1.0, 0.0], [0.0, 0.0, 1.0]])
    metrics = summarise("s", samples, ks=(2, 3))
    # pass@1: (1/2 + 1/3) / 2; pass@2: prompt 0 has 1 wrong < 2 -> 1, prompt 1: 1 - C(2,2)/C(3,2) = 2/3
    assert metrics["eval/s/pass@1"] == pytest.approx((1 / 2 + 1 / 3) / 2)
    assert metrics["eval/s/pass@2"] == pytest.approx((1 + 2 / 3) / 2)
    assert "eval/s/pass@3" not in metrics  # prompt 0 has 2 samples


def test_summarise_needs_the_prompt_index():
    with pytest.raises(ValueError, match=r"eval set 's': a sample has no metadata\['prompt_index'\]"):
        summarise("s", [Sample(prompt="", prompt_ids=[], reward=1.0)])


# ---- eval sets from data.eval ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    write_word_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def keep_nothing(row):
    return False


def eval_files(tmp_path):
    sums = tmp_path / "sums.jsonl"
    rows = [{"question": q, "label": a} for q, a in (("3 + 4 =", "7"), ("1 + 1 =", "2"), ("9 - 2 =", "7"))]
    sums.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = pa.Table.from_pylist([{"q": "5 =", "answer": 5, "info": {"level": 3}}])
    pq.write_table(table, tmp_path / "digits.parquet")
    return sums, tmp_path / "digits.parquet"


def test_eval_sets_in_file_order_with_inherited_keys(tmp_path, tokenizer):
    sums, digits = eval_files(tmp_path)
    data = DataConfig(
        input_key="question",  # inherited by "sums"
        filter=f"{__name__}.keep_nothing",  # a training filter: not applied to eval sets
        eval={
            "sums": EvalSetConfig(path=str(sums)),
            "digits": EvalSetConfig(path=str(digits), input_key="q", label_key="answer", metadata_key="info"),
        },
    )
    sets = build_eval_sets(data, tokenizer, max_prompt_len=8)
    assert list(sets) == ["sums", "digits"]
    assert [(s.prompt, s.label) for s in sets["sums"]] == [
        ("3 + 4 =", "7"),
        ("1 + 1 =", "2"),
        ("9 - 2 =", "7"),
    ]
    # "3" id 5, "+" 13, "4" id 6, "=" 12
    assert sets["sums"][0].prompt_ids == [5, 13, 6, 12]
    assert [s.metadata for s in sets["sums"]] == [{"prompt_index": i, "eval_set": "sums"} for i in range(3)]
    (five,) = sets["digits"]
    assert (five.prompt_ids, five.label, five.metadata) == (
        [7, 12],
        5,
        {"level": 3, "prompt_index": 0, "eval_set": "digits"},
    )


def test_a_bad_eval_row_names_the_sets_key(tmp_path, tokenizer):
    sums, _ = eval_files(tmp_path)
    data = DataConfig(eval={"sums": EvalSetConfig(path=str(sums))})  # input_key stays "prompt"
    with pytest.raises(
        DataError,
        match=re.escape(f"{sums}:1: no key 'prompt' (data.eval.sums.input_key)")
        + r".*\nfix: set data\.eval\.sums\.input_key",
    ):
        build_eval_sets(data, tokenizer, max_prompt_len=8)


def test_eval_set_config_mistakes_are_named(tmp_path):
    from rlx.data.checks import eval_set_errors

    sums, _ = eval_files(tmp_path)
    data = DataConfig(
        eval={
            "a": EvalSetConfig(path=str(tmp_path / "nope.jsonl")),
            "b": EvalSetConfig(path=str(sums), on_bad_sample="drop", system_prompt="be brief"),
        }
    )
    assert eval_set_errors(data) == [
        f"data.eval.a.path='{tmp_path / 'nope.jsonl'}': no such file ({tmp_path / 'nope.jsonl'}); "
        "point data.eval.a.path at a prompt file",
        "data.eval.b.on_bad_sample='drop' is not one of ['error', 'skip']; set data.eval.b.on_bad_sample=error, say",
        "data.eval.b.system_prompt is set but data.eval.b.apply_chat_template=false, so there is no chat to put it "
        "in; set data.eval.b.apply_chat_template=true",
    ]
