"""`kv_cache_dtype` (SGLang's argument): an fp8 KV cache on CPU (the GPU's kernels read it in
tests/kernels and tests/gpu/test_engine.py). Keys and values are stored rounded to one byte, so
the same bytes hold four times the fp32 cache's tokens; the attention reads back exactly what was
stored. A value the engine lacks is refused when composing, and a model outside its families in
the driver, before any process starts."""

from __future__ import annotations

import pytest
import torch
from helpers import write_tiny_qwen3

from rlx.engine import Engine, EngineArgs, GenerateRequest, SamplingParams

PROMPTS = [[5], [2, 3, 4], [9, 8, 7, 6, 5, 4, 12]]
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def make_engine(path, **kwargs) -> Engine:
    return Engine(EngineArgs(model_path=str(path), device="cpu", **kwargs))


def greedy(engine: Engine, new_tokens: int = 12) -> list[tuple[list[int], list[float]]]:
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([GenerateRequest(list(p), sp) for p in PROMPTS])
    return [(o.output_ids, o.output_logprobs) for o in outputs]


@pytest.mark.parametrize("name", list(FP8))
def test_an_fp8_cache_holds_four_times_the_fp32_caches_tokens_in_the_same_bytes(name, scrambled_dir):
    """The tiny Qwen3: 2 layers x K and V x 2 KV heads x 16 dims x 16 tokens a block = 2,048
    elements, 8,192 bytes in fp32 and 2,048 in fp8; 1 MiB holds 128 and 512 blocks (and one
    reserved block each, which the engine keeps for padding)."""
    fp32 = make_engine(scrambled_dir, cpu_kv_cache_bytes=1 << 20)
    fp8 = make_engine(scrambled_dir, cpu_kv_cache_bytes=1 << 20, kv_cache_dtype=name)
    assert fp32.kv_cache.data.dtype == torch.float32 and fp8.kv_cache.data.dtype == FP8[name]
    assert (fp32.kv_cache.num_blocks, fp8.kv_cache.num_blocks) == (129, 513)


@pytest.mark.parametrize("name", list(FP8))
def test_an_fp8_cache_reads_back_what_was_stored_rounded(name, scrambled_dir, monkeypatch):
    """The engine with an fp8 cache gives the tokens and logprobs, bit for bit, of an fp32 engine
    whose every stored key and value is rounded to fp8 and back (the CPU's paths store through
    `write_kv` and attend in fp32), so the cache holds each value as rounded and the attention
    reads it back so; and the rounding moves the logprobs (against the fp32 cache's own)."""
    import rlx.engine.attention as attention

    exact = greedy(make_engine(scrambled_dir))
    got = greedy(make_engine(scrambled_dir, kv_cache_dtype=name))
    store = attention.write_kv

    def rounded(k_cache, v_cache, k, v, meta):
        store(k_cache, v_cache, k.to(FP8[name]).to(k.dtype), v.to(FP8[name]).to(v.dtype), meta)

    monkeypatch.setattr(attention, "write_kv", rounded)
    assert got == greedy(make_engine(scrambled_dir))
    assert got != exact


def test_an_unknown_kv_cache_dtype_is_refused_naming_the_choices(scrambled_dir):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be auto or one of \['bf16', 'bfloat16', "):
        make_engine(scrambled_dir, kv_cache_dtype="int8")


def test_a_model_outside_the_engines_families_refuses_an_fp8_cache(tmp_path):
    """transformers' model (the engine's generic path) keeps its own cache in the model's dtype:
    asked for fp8, the engine says so instead of ignoring it."""
    import json

    path = write_tiny_qwen3(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps(config | {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]})
    )
    assert make_engine(path).generic  # auto: served by transformers' Qwen2 model
    with pytest.raises(ValueError, match="kv_cache_dtype=fp8_e4m3 is for the engine's own model families"):
        make_engine(path, kv_cache_dtype="fp8_e4m3")


def test_the_families_the_launcher_names_are_the_engines_own():
    from rlx.engine.config import MODEL_TYPES
    from rlx.engine.models import FAMILIES

    assert tuple(FAMILIES) == MODEL_TYPES


def test_the_driver_refuses_it_before_any_process_starts(tmp_path, monkeypatch):
    """A run does not wait for its engine to refuse: `rlx.runtime._prepare` (before Ray) asks the
    launcher (`LocalLauncher.checkpoint_errors`); here the tiny Qwen3 as if the engine had no Qwen3
    family of its own, then as it is."""
    import rlx.engine.config as engine_config
    from rlx.config.compose import compose
    from rlx.errors import ConfigError
    from rlx.runtime import _prepare

    cfg = compose(["+rollout.engine_args.kv_cache_dtype=fp8_e4m3", f"run.output_dir={tmp_path}"])
    own = tuple(t for t in engine_config.MODEL_TYPES if t != "qwen3")
    monkeypatch.setattr(engine_config, "MODEL_TYPES", own)
    with pytest.raises(ConfigError) as refused:
        _prepare(cfg)
    assert str(refused.value).startswith(
        "rollout.engine_args.kv_cache_dtype=fp8_e4m3 is for rlx's engine's own model families "
        "(llama, glm4, qwen3_moe); qwen3 ("
    )
    assert str(refused.value).endswith("remove it, or use rollout=sglang")
    monkeypatch.undo()
    _prepare(cfg)  # the engine serves Qwen3 itself
