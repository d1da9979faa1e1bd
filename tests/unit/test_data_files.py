"""FileSource beyond JSON lines: Parquet and JSON arrays, metadata, chat messages and the system
prompt, label types, the row filter, and the toy source refusing file keys. CPU, seconds."""

from __future__ import annotations

import json
import math
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from rlx.config.compose import compose
from rlx.data.config import DataConfig
from rlx.data.source import FileSource
from rlx.data.toy import ToySource
from rlx.errors import ConfigError, DataError
from rlx.models.tiny import VOCAB, write_word_tokenizer

# Token ids: <pad> 0, <eos> 1, "0".."9" 2..11, "=" 12, "+" 13, "-" 14, "?" 15, then these:
ROLE_WORDS = ["system:", "user:", "assistant:", "tool:", "be", "brief"]  # 16 17 18 19 20 21
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    write_word_tokenizer(path, [*VOCAB, *ROLE_WORDS])
    tok = AutoTokenizer.from_pretrained(str(path))
    tok.chat_template = TEMPLATE
    return tok


def source(path, tokenizer, *, max_prompt_len=32, **cfg):
    cfg.setdefault("shuffle", False)
    return FileSource(
        DataConfig(_target_="rlx.data.source.FileSource", prompt_path=str(path), **cfg),
        tokenizer,
        seed=0,
        max_prompt_len=max_prompt_len,
    )


def parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ---- formats ---------------------------------------------------------------------------------


def test_parquet_rows_become_samples_with_labels_and_metadata(tmp_path, tokenizer):
    rows = [
        {"question": "1 2 =", "answer": 21, "info": {"level": 1}},
        {"question": "3 =", "answer": 3, "info": {"level": 2}},
    ]
    path = parquet(tmp_path / "p.parquet", rows)
    first, second = source(
        path, tokenizer, input_key="question", label_key="answer", metadata_key="info"
    ).take(2)
    # "1" is id 3, "2" id 4, "=" id 12
    assert (first.prompt, first.prompt_ids, first.label) == ("1 2 =", [3, 4, 12], 21)
    assert first.metadata == {"level": 1, "prompt_index": 0}
    assert (second.prompt_ids, second.label, second.metadata) == ([5, 12], 3, {"level": 2, "prompt_index": 1})


def test_parquet_chat_prompts_are_rendered_with_the_template(tmp_path, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1 ="}]
    path = parquet(tmp_path / "chat.parquet", [{"prompt": messages, "label": "1"}])
    (sample,) = source(path, tokenizer, apply_chat_template=True).take(1)
    assert sample.prompt == messages
    # "system: be brief user: 1 = assistant:" -> 16 20 21 17 3 12 18
    assert sample.prompt_ids == [16, 20, 21, 17, 3, 12, 18]


def test_json_array_and_json_lines_under_json(tmp_path, tokenizer):
    array = tmp_path / "a.json"
    array.write_text(json.dumps([{"prompt": "1 =", "label": "1"}, {"prompt": "2 =", "label": "2"}], indent=2))
    lines = jsonl(tmp_path / "l.json", [{"prompt": "3 =", "label": "3"}])
    assert [s.prompt for s in source(array, tokenizer).take(2)] == ["1 =", "2 ="]
    assert [s.prompt for s in source(lines, tokenizer).take(1)] == ["3 ="]


def test_bad_parquet_row_is_named_by_row_index(tmp_path, tokenizer):
    path = parquet(tmp_path / "p.parquet", [{"prompt": "1 =", "label": "1"}, {"prompt": None, "label": "2"}])
    with pytest.raises(DataError, match=re.escape(f"{path}: row index 1: the prompt must be a string")):
        source(path, tokenizer)


def test_parquet_without_the_input_column_names_the_columns(tmp_path, tokenizer):
    path = parquet(tmp_path / "p.parquet", [{"question": "1 =", "label": "1"}])
    with pytest.raises(
        DataError,
        match=r"no column 'prompt' \(data\.input_key\); the file has columns \['question', 'label'\]\n"
        r"fix: set data\.input_key",
    ):
        source(path, tokenizer, on_bad_sample="skip")  # every row lacks it: not a row to skip


def test_a_file_that_is_not_parquet(tmp_path, tokenizer):
    path = tmp_path / "p.parquet"
    path.write_text('{"prompt": "1 ="}\n')
    with pytest.raises(DataError, match=re.escape(f"{path}: not a readable Parquet file")):
        source(path, tokenizer)


def test_malformed_json_array_names_the_line(tmp_path, tokenizer):
    path = tmp_path / "a.json"
    path.write_text('[\n  {"prompt": "1 =", "label": "1"},\n  {"prompt": \n]\n')
    with pytest.raises(DataError, match=re.escape(f"{path}:4: malformed JSON")):
        source(path, tokenizer)


def test_unknown_extension_is_a_config_error(tmp_path, tokenizer):
    path = tmp_path / "p.csv"
    path.write_text("prompt,label\n")
    cfg = DataConfig(_target_="rlx.data.source.FileSource", prompt_path=str(path))
    (message,) = FileSource.config_errors(cfg)
    assert "unknown file type '.csv'" in message and "['.json', '.jsonl', '.parquet']" in message


# ---- rows: labels, metadata, chat messages -----------------------------------------------------

META = {"info": {}}  # every row has metadata (data.metadata_key=info) unless the case is about it
BAD_ROWS = {
    "null label": (
        {"prompt": "1 =", "label": None, **META},
        r"the label \(data\.label_key='label'\) is null",
    ),
    "NaN label": (
        {"prompt": "1 =", "label": math.nan, **META},
        r"the label \(data\.label_key\) is nan, not a finite",
    ),
    "metadata not an object": (
        {"prompt": "1 =", "label": "1", "info": [1]},
        r"the metadata \(data\.metadata_key='info'\) must be an object \(a dict\), got list",
    ),
    "missing metadata key": (
        {"prompt": "1 =", "label": "1"},
        r"no key 'info' \(data\.metadata_key\); the row has keys \['label', 'prompt'\]\n"
        r"fix: set data\.metadata_key to the key that holds the metadata \(or data\.metadata_key=null\)",
    ),
    "reserved metadata key": (
        {"prompt": "1 =", "label": "1", "info": {"prompt_index": 3}},
        r"metadata keys \['prompt_index'\] are set by rlx itself",
    ),
    "bad role": (
        {"prompt": [{"role": "bot", "content": "1 ="}], "label": "1", **META},
        r"message 0 has role 'bot'; a role is one of \['system', 'user', 'assistant', 'tool'\]",
    ),
    "missing content": (
        {"prompt": [{"role": "system", "content": "be"}, {"role": "user"}], "label": "1", **META},
        r"message 1 \(user\) has no 'content'; its 'content' must be a string",
    ),
    "content not a string": (
        {"prompt": [{"role": "user", "content": 7}], "label": "1", **META},
        r"message 0 \(user\) has int; its 'content' must be a string",
    ),
    "message not an object": (
        {"prompt": ["1 ="], "label": "1", **META},
        r"message 0 must be an object \{'role': \.\.\., 'content': \.\.\.\}, got str \(a list prompt is read as chat "
        r"messages; a prompt of text is a string in data\.input_key='prompt'\)",
    ),
    "no messages": (
        {"prompt": [], "label": "1", **META},
        r"empty prompt \(data\.input_key='prompt'\): no messages",
    ),
}


@pytest.mark.parametrize("row, message", BAD_ROWS.values(), ids=BAD_ROWS.keys())
def test_each_bad_row_fails_naming_file_line_and_key(tmp_path, tokenizer, row, message):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "2 =", "label": "2", **META}, row])
    with pytest.raises(DataError, match=re.escape(f"{path}:2: ") + message):
        source(path, tokenizer, apply_chat_template=True, metadata_key="info")


def test_skip_mode_counts_each_kind_of_bad_row(tmp_path, tokenizer):
    path = jsonl(
        tmp_path / "p.jsonl", [{"prompt": "2 =", "label": "2", **META}, *(r for r, _ in BAD_ROWS.values())]
    )
    data = source(path, tokenizer, apply_chat_template=True, metadata_key="info", on_bad_sample="skip")
    assert len(data) == 1 and data.num_skipped == len(BAD_ROWS)
    assert data.skip_reasons == {
        "null label": 1, "bad label type": 1, "bad metadata": 2, "missing metadata key": 1,
        "bad message": 4, "empty prompt": 1,
    }  # fmt: skip


def test_a_binary_label_from_parquet_is_not_a_json_value(tmp_path, tokenizer):
    path = parquet(tmp_path / "p.parquet", [{"prompt": "1 =", "label": b"\x01"}])
    with pytest.raises(DataError, match=r"row index 0: the label \(data\.label_key\) is of type bytes"):
        source(path, tokenizer)


def test_structured_labels_pass_through(tmp_path, tokenizer):
    label = {"answer": "12", "alternatives": ["12.0", 12], "exact": True}
    (sample,) = source(jsonl(tmp_path / "p.jsonl", [{"prompt": "1 =", "label": label}]), tokenizer).take(1)
    assert sample.label == label


def test_each_sample_owns_its_metadata_and_messages(tmp_path, tokenizer):
    messages = [{"role": "user", "content": "1 ="}]
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": messages, "label": "1", "info": {"tags": ["a"]}}])
    data = source(path, tokenizer, metadata_key="info", apply_chat_template=True)
    (first,) = data.take(1)
    first.metadata["tags"].append("b")  # a generate_fn may change its sample
    first.prompt.append({"role": "assistant", "content": "1"})
    (again,) = data.take(1)  # the next epoch
    assert again.metadata == {"tags": ["a"], "prompt_index": 0} and again.prompt == messages


# ---- system prompt ---------------------------------------------------------------------------


def test_system_prompt_goes_before_chat_and_text_prompts(tmp_path, tokenizer):
    own_system = [{"role": "system", "content": "brief"}, {"role": "user", "content": "2 ="}]
    rows = [
        {"prompt": [{"role": "user", "content": "1 ="}], "label": "1"},
        {"prompt": "3 =", "label": "3"},
        {"prompt": own_system, "label": "2"},
    ]
    path = jsonl(tmp_path / "p.jsonl", rows)
    chat, text, own = source(path, tokenizer, apply_chat_template=True, system_prompt="be").take(3)
    # "system: be user: 1 = assistant:" -> 16 20 17 3 12 18
    assert chat.prompt_ids == [16, 20, 17, 3, 12, 18]
    assert chat.prompt == rows[0]["prompt"]  # the sample keeps the row's messages
    # "system: be user: 3 = assistant:" -> 16 20 17 5 12 18
    assert text.prompt_ids == [16, 20, 17, 5, 12, 18] and text.prompt == "3 ="
    # a row's own system message wins: "system: brief user: 2 = assistant:"
    assert own.prompt_ids == [16, 21, 17, 4, 12, 18]


def test_system_prompt_without_chat_template_is_a_config_error(tmp_path, tokenizer):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "1 =", "label": "1"}])
    expected = (
        r"data\.system_prompt is set but data\.apply_chat_template=false.*set data\.apply_chat_template=true"
    )
    with pytest.raises(ConfigError, match=expected):
        source(path, tokenizer, system_prompt="be")


# ---- row filter ------------------------------------------------------------------------------


def short_prompts(row):
    return len(row["prompt"].split()) <= 2


def answer_of(row):
    return row.get("answer")


def test_filter_keeps_rows_and_counts_the_others(tmp_path, tokenizer):
    rows = [{"prompt": p, "label": ""} for p in ("1 =", "1 2 =", "3 =", "4 5 6 =")]
    data = source(jsonl(tmp_path / "p.jsonl", rows), tokenizer, filter=f"{__name__}.short_prompts")
    assert [s.prompt for s in data.take(2)] == ["1 =", "3 ="]
    assert (len(data), data.num_filtered, data.num_skipped) == (2, 2, 0)


def test_filter_that_raises_or_returns_a_non_bool_is_named(tmp_path, tokenizer):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "1 =", "label": ""}, {"label": ""}])
    with pytest.raises(
        DataError, match=re.escape(f"{path}:2: the row filter data.filter=") + ".* raised KeyError"
    ):
        source(path, tokenizer, filter=f"{__name__}.short_prompts")
    jsonl(
        path,
        [{"prompt": "1 =", "label": "", "answer": True}, {"prompt": "2 =", "label": "", "answer": "yes"}],
    )
    with pytest.raises(DataError, match=r":2: the row filter .* returned str 'yes', not True or False"):
        source(path, tokenizer, filter=f"{__name__}.answer_of")


def test_filter_that_does_not_import_is_a_config_error(tmp_path, tokenizer):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "1 =", "label": ""}])
    with pytest.raises(ConfigError, match=r"data\.filter='rlx\.nope\.keep' cannot be imported"):
        source(path, tokenizer, filter="rlx.nope.keep")


def test_filter_leaving_nothing_says_so(tmp_path, tokenizer):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "1 2 3 =", "label": ""}])
    with pytest.raises(
        DataError, match=r"no usable prompts \(0 rows skipped: \{\}; 1 left out by the row filter\)"
    ):
        source(path, tokenizer, filter=f"{__name__}.short_prompts")


# ---- keys the toy source would ignore (issue 13) -------------------------------------------------


def test_prompt_path_with_the_toy_source_names_the_key_and_the_fix(tmp_path):
    path = jsonl(tmp_path / "p.jsonl", [{"prompt": "1 =", "label": "1"}])
    with pytest.raises(ConfigError) as e:
        compose([f"data.prompt_path={path}"])
    message = str(e.value)
    assert f"data.prompt_path='{path}' is set, but data._target_=rlx.data.toy.ToySource" in message
    assert f"data=math data.prompt_path={path}," in message
    assert f"data=jsonl data.prompt_path={path} reward.fn=..." in message
    # the fix composes (with a response length the tiny model's 64 positions hold)
    compose(
        [
            "data=jsonl",
            f"data.prompt_path={path}",
            "reward.fn=rlx.reward.toy.exact_match",
            "rollout.max_response_len=4",
        ]
    )


def test_toy_source_refuses_filter_and_metadata_key(tokenizer):
    cfg = DataConfig(filter=f"{__name__}.short_prompts", metadata_key="info", toy_num_rows=4)
    with pytest.raises(ConfigError) as e:
        ToySource(cfg, tokenizer, seed=0, max_prompt_len=16)
    assert "data.filter=" in str(e.value) and "data.metadata_key='info' is set" in str(e.value)
