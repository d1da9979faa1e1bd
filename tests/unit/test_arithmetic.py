"""The generated arithmetic task (rlx.data.arithmetic): every problem once, answers right, a
held-out test split that shares no question with training, the same files for the same seed."""

from __future__ import annotations

import json
import re

import pytest

from rlx.data import arithmetic
from rlx.data.config import EvalSetConfig
from rlx.eval.runner import eval_sampling
from rlx.rollout.config import RolloutConfig


def _question(row) -> tuple[int, str, int]:
    a, op, b = re.search(r"(\d+) ([-+*]) (\d+)", row["prompt"][0]["content"]).groups()
    return int(a), op, int(b)


def test_every_problem_once_with_its_answer():
    rows = arithmetic.rows(seed=0)
    every = rows["train"] + rows["test"]
    assert len(every) == 21 * 21 + (21 * 22) // 2 + 12 * 12 == 816  # a+b, a-b with b <= a, a*b
    questions = [_question(r) for r in every]
    assert len(set(questions)) == 816
    for (a, op, b), row in zip(questions, every, strict=True):
        assert row["label"] == str({"+": a + b, "-": a - b, "*": a * b}[op])
        assert row["prompt"][0]["role"] == "user" and int(row["label"]) >= 0


def test_the_test_split_is_held_out_and_fixed_by_the_seed(tmp_path):
    rows = arithmetic.rows(seed=0, num_test=100)
    assert (len(rows["train"]), len(rows["test"])) == (716, 100)
    assert not {_question(r) for r in rows["train"]} & {_question(r) for r in rows["test"]}
    out = arithmetic.write(tmp_path / "a", seed=0, num_test=100)
    written = [json.loads(line) for line in (out / "test.jsonl").read_text().splitlines()]
    assert written == rows["test"]
    assert arithmetic.rows(seed=1, num_test=100)["test"] != rows["test"]
    with pytest.raises(ValueError, match="num_test=816"):
        arithmetic.rows(num_test=816)


def test_the_command_writes_into_the_cache_and_prints_the_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RLX_CACHE", str(tmp_path))
    arithmetic.main([])
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["688 training and 128 test problems in", str(tmp_path / "arithmetic")]


def test_an_eval_set_may_sample_its_own_way():
    rollout = RolloutConfig(n_samples_per_eval_prompt=4, eval_temperature=0.6, eval_max_response_len=32)
    assert eval_sampling(rollout) == (4, {"temperature": 0.6, "max_new_tokens": 32})
    greedy = EvalSetConfig(path="t.jsonl", temperature=0.0, n_samples_per_prompt=1)
    assert eval_sampling(rollout, greedy) == (1, {"temperature": 0.0, "max_new_tokens": 32})
    assert eval_sampling(rollout, EvalSetConfig(path="t.jsonl", n_samples_per_prompt=8)) == (
        8, {"temperature": 0.6, "max_new_tokens": 32},
    )  # fmt: skip
