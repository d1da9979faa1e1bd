"""FileSource (JSON lines) and ToySource: validation messages, skip mode, epochs, shuffling, exact resume. CPU."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from transformers import AutoTokenizer

from rlx.data.config import DataConfig
from rlx.data.source import FileSource
from rlx.data.toy import ToySource
from rlx.errors import ConfigError, DataError
from rlx.models.tiny import write_word_tokenizer

# The word tokenizer's vocabulary is the toy one: digits, "=", "+", "-", "?", "<pad>", "<eos>".
ROWS = [{"prompt": f"{a} {b} =", "label": f"{b} {a}"} for a, b in ((1, 2), (3, 4), (5, 6), (7, 8), (9, 0))]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    write_word_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path))


def write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def jsonl(path, tokenizer, *, seed=0, max_prompt_len=16, **cfg):
    return FileSource(
        DataConfig(_target_="rlx.data.source.FileSource", prompt_path=str(path), **cfg),
        tokenizer,
        seed=seed,
        max_prompt_len=max_prompt_len,
    )


def prompts(samples):
    return [s.prompt for s in samples]


def test_reads_prompts_labels_and_token_ids(tmp_path, tokenizer):
    source = jsonl(write(tmp_path / "p.jsonl", ROWS[:2]), tokenizer, shuffle=False)
    first, second = source.take(2)
    assert (first.prompt, first.label, first.prompt_ids) == ("1 2 =", "2 1", [3, 4, 12])
    assert (second.prompt, second.label, second.prompt_ids) == ("3 4 =", "4 3", [5, 6, 12])
    assert len(source) == 2 and source.num_skipped == 0


def test_blank_lines_are_ignored_and_null_label_key_gives_no_label(tmp_path, tokenizer):
    path = write(tmp_path / "p.jsonl", ["", json.dumps({"prompt": "1 ="}), "   "])
    (sample,) = jsonl(path, tokenizer, label_key=None).take(1)
    assert (sample.prompt, sample.label) == ("1 =", None)


def test_missing_file_names_the_key_and_the_path(tmp_path, tokenizer):
    with pytest.raises(DataError, match=r"data\.prompt_path='.*nope\.jsonl': no such file"):
        jsonl(tmp_path / "nope.jsonl", tokenizer)


BAD_LINES = {
    "malformed JSON": (
        '{"prompt": "1 2 =", ',  # 20 characters: the name json expects would start at column 21
        r":2: malformed JSON: Expecting property name enclosed in double quotes at column 21 of the line",
    ),
    "not an object": ('["1 2 ="]', r":2: expected a JSON object, got list"),
    "missing input key": (
        {"question": "1 2 =", "label": "2 1"},
        r":2: no key 'prompt' \(data\.input_key\); the row has keys \['label', 'question'\]",
    ),
    "missing label key": (
        {"prompt": "1 2 ="},
        r":2: no key 'label' \(data\.label_key\); the row has keys \['prompt'\]",
    ),
    "empty prompt": ({"prompt": "  ", "label": ""}, r":2: empty prompt"),
    "bad prompt type": (
        {"prompt": 12, "label": ""},
        r":2: the prompt must be a string or a list of chat messages, got int",
    ),
    "chat messages without template": (
        {"prompt": [{"role": "user", "content": "1 ="}], "label": ""},
        r":2: the prompt is a list of chat messages but data\.apply_chat_template=false\n"
        r"fix: set data\.apply_chat_template=true: chat prompts are rendered by the tokenizer's chat template$",
    ),
    "prompt too long": (
        {"prompt": "1 2 3 4 5 6 =", "label": ""},
        r":2: the prompt is 7 tokens, longer than the limit of 6 \(data\.max_prompt_len[^\n]*\nfix: .*data\.on_bad_sample=skip",
    ),
}


@pytest.mark.parametrize("line, message", BAD_LINES.values(), ids=BAD_LINES.keys())
def test_each_bad_line_fails_naming_file_and_line(tmp_path, tokenizer, line, message):
    path = write(tmp_path / "p.jsonl", [ROWS[0], line, ROWS[1]])
    with pytest.raises(DataError, match=re.escape(str(path)) + message):
        jsonl(path, tokenizer, max_prompt_len=6)


def test_skip_mode_drops_and_counts_bad_lines(tmp_path, tokenizer):
    lines = [ROWS[0], *(line for line, _ in BAD_LINES.values()), ROWS[1], BAD_LINES["empty prompt"][0]]
    source = jsonl(
        write(tmp_path / "p.jsonl", lines), tokenizer, max_prompt_len=6, on_bad_sample="skip", shuffle=False
    )
    assert prompts(source.take(2)) == ["1 2 =", "3 4 ="]
    assert len(source) == 2
    assert source.num_skipped == len(BAD_LINES) + 1
    assert source.skip_reasons == Counter({**dict.fromkeys(BAD_LINES, 1), "empty prompt": 2})
    assert source.skipped[0].startswith(f"{tmp_path / 'p.jsonl'}:2: malformed JSON")


def test_skip_mode_with_no_usable_prompt_fails(tmp_path, tokenizer):
    path = write(tmp_path / "p.jsonl", ["{", {"prompt": ""}])
    with pytest.raises(DataError, match=r"no usable prompts \(2 rows skipped"):
        jsonl(path, tokenizer, on_bad_sample="skip", label_key=None)


def test_epochs_cycle_through_every_prompt_once(tmp_path, tokenizer):
    source = jsonl(write(tmp_path / "p.jsonl", ROWS), tokenizer, seed=3)
    taken = prompts(source.take(3)) + prompts(source.take(3))
    assert source.epoch == 1
    assert sorted(taken[:5]) == sorted(r["prompt"] for r in ROWS)  # epoch 0 is a permutation
    taken += prompts(source.take(4))
    assert source.epoch == 2 and sorted(taken[5:10]) == sorted(taken[:5])


def test_take_spans_several_epochs_in_one_call(tmp_path, tokenizer):
    source = jsonl(write(tmp_path / "p.jsonl", ROWS), tokenizer, shuffle=False)
    assert prompts(source.take(12)) == [r["prompt"] for r in ROWS * 3][:12]
    assert source.epoch == 2


def test_shuffle_is_deterministic_in_seed_and_epoch(tmp_path, tokenizer):
    path = write(tmp_path / "p.jsonl", [{"prompt": f"{d} =", "label": ""} for d in range(10)])
    a, b, c = (jsonl(path, tokenizer, seed=seed) for seed in (1, 1, 2))
    run_a, run_b, run_c = (prompts(s.take(30)) for s in (a, b, c))
    assert run_a == run_b
    assert run_a != run_c
    epochs = [run_a[i : i + 10] for i in (0, 10, 20)]
    assert len({tuple(e) for e in epochs}) == 3  # reshuffled every epoch
    assert prompts(jsonl(path, tokenizer, shuffle=False).take(10)) == [f"{d} =" for d in range(10)]


def test_state_dict_resumes_with_identical_next_prompts(tmp_path, tokenizer):
    path = write(tmp_path / "p.jsonl", ROWS)
    original = jsonl(path, tokenizer, seed=7)
    original.take(7)  # mid-way through epoch 1
    state = json.loads(json.dumps(original.state_dict()))  # survives a JSON round trip
    expected = [(s.prompt, s.prompt_ids, s.label) for s in original.take(9)]

    resumed = jsonl(path, tokenizer, seed=7)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    assert [(s.prompt, s.prompt_ids, s.label) for s in resumed.take(9)] == expected


def test_resume_refuses_different_data_or_seed(tmp_path, tokenizer):
    state = jsonl(write(tmp_path / "p.jsonl", ROWS), tokenizer, seed=7).state_dict()
    with pytest.raises(
        DataError, match=r"seed is 7 in the checkpoint but 8 now; resume with the same run\.seed"
    ):
        jsonl(tmp_path / "p.jsonl", tokenizer, seed=8).load_state_dict(state)
    with pytest.raises(
        DataError, match=r"num_prompts is 5 in the checkpoint but 4 now; resume with the same data"
    ):
        jsonl(write(tmp_path / "q.jsonl", ROWS[:4]), tokenizer, seed=7).load_state_dict(state)


def test_chat_template_renders_messages_and_strings(tmp_path, tokenizer):
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}?{% endif %}"
    )
    try:
        messages = [{"role": "system", "content": "+"}, {"role": "user", "content": "1 2 ="}]
        path = write(
            tmp_path / "p.jsonl", [{"prompt": messages, "label": "2 1"}, {"prompt": "3 =", "label": "3"}]
        )
        chat, plain = jsonl(path, tokenizer, apply_chat_template=True, shuffle=False).take(2)
    finally:
        tokenizer.chat_template = None
    assert chat.prompt == messages  # the sample keeps the messages; the ids are the rendered text's
    assert chat.prompt_ids == tokenizer.encode("+ 1 2 = ?", add_special_tokens=False)
    assert plain.prompt_ids == tokenizer.encode("3 = ?", add_special_tokens=False)


def test_chat_template_flag_without_a_template_fails(tmp_path, tokenizer):
    with pytest.raises(
        DataError, match=r"data\.apply_chat_template=true but the tokenizer has no chat template"
    ):
        jsonl(write(tmp_path / "p.jsonl", ROWS), tokenizer, apply_chat_template=True)


def test_toy_source_shares_the_contract(tokenizer):
    cfg = DataConfig(toy_task="reverse", toy_num_digits=3, toy_num_rows=8)
    source = ToySource(cfg, tokenizer, seed=1, max_prompt_len=16)
    samples = source.take(8)
    assert source.epoch == 1
    for s in samples:
        digits = s.prompt.split()[:-1]
        assert s.label.split() == digits[::-1] and s.prompt_ids == tokenizer.encode(s.prompt)
    state = source.state_dict()
    expected = prompts(source.take(5))
    again = ToySource(cfg, tokenizer, seed=1, max_prompt_len=16)
    again.load_state_dict(state)
    assert prompts(again.take(5)) == expected


def test_toy_source_rejects_unknown_task(tokenizer):
    with pytest.raises(ConfigError, match=r"data\.toy_task='sort'"):
        ToySource(DataConfig(toy_task="sort"), tokenizer, seed=1, max_prompt_len=16)


def test_a_line_that_is_not_utf8_is_named(tmp_path, tokenizer):
    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "1 =", "label": "1"}\n{"prompt": "\xff"}\n')
    with pytest.raises(DataError, match=re.escape(f"{path}:2: not UTF-8 text")):
        jsonl(path, tokenizer)


@pytest.mark.parametrize(
    "given, fix",
    [
        ({}, "lower rollout.max_response_len (the prompt gets the context it leaves)"),  # the derived limit
        ({"max_prompt_len": 6}, "raise data.max_prompt_len (within the model's context)"),  # the user's
    ],
)
def test_a_prompt_too_long_names_the_limit_the_user_can_move(tmp_path, tokenizer, given, fix):
    path = write(tmp_path / "p.jsonl", [{"prompt": "1 2 3 4 5 6 =", "label": ""}])
    with pytest.raises(
        DataError, match=re.escape(f"fix: shorten the prompt, {fix}, or set data.on_bad_sample=skip")
    ):
        FileSource(DataConfig(_target_="rlx.data.source.FileSource", prompt_path=str(path), **given),
                   tokenizer, seed=0, max_prompt_len=6)  # fmt: skip
