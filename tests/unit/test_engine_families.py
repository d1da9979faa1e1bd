"""Every fast-path family (llama with llama3 rope scaling, glm4, qwen3_moe) against transformers
on CPU: the engine's sampled tokens have transformers' log-softmax within 1e-4."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_SHAPE
from transformers import AutoModelForCausalLM, Glm4Config, LlamaConfig, Qwen3MoeConfig

from rlx.engine import Engine, EngineArgs, GenerateRequest, SamplingParams
from rlx.models.tiny import write_tiny_checkpoint

COMMON = dict(**TINY_SHAPE, pad_token_id=0, eos_token_id=1, initializer_range=0.2)
CONFIGS = {
    "llama": lambda: LlamaConfig(
        **COMMON,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),  # fmt: skip
    "glm4": lambda: Glm4Config(**COMMON, attention_bias=True),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **COMMON,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[0],
    ),  # fmt: skip
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_family_logprobs_match_transformers(family, tmp_path):
    path = write_tiny_checkpoint(CONFIGS[family](), tmp_path / family, seed=0)
    engine = Engine(EngineArgs(model_path=str(path), device="cpu", page_size=4))
    assert not engine.generic
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = [[2, 3, 4], [9, 8, 7, 6, 5, 4, 12, 3, 5, 7], [5]]
    sampling = dict(max_new_tokens=10, ignore_eos=True, sampling_seed=3)
    outputs = engine.generate([GenerateRequest(p, SamplingParams(**sampling)) for p in prompts])
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1 : -1]
        ref = logits.log_softmax(-1).gather(-1, torch.tensor(out.output_ids)[:, None])[:, 0]
        assert (torch.tensor(out.output_logprobs) - ref).abs().max().item() <= 1e-4


def _rope_configs():
    from transformers import DeepseekV3Config, Glm4MoeConfig, Qwen3Config

    small = {
        k: v
        for k, v in TINY_SHAPE.items()
        if k not in ("head_dim", "intermediate_size", "max_position_embeddings")
    }
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 5e5}
    return {
        "llama3 scaling": CONFIGS["llama"](),
        "llama default": LlamaConfig(**small, head_dim=32),
        "glm4 partial": Glm4Config(**small, head_dim=32, partial_rotary_factor=0.5),
        "glm4_moe": Glm4MoeConfig(**small, partial_rotary_factor=0.25),
        "qwen3 yarn": Qwen3Config(**small, head_dim=16, rope_scaling=yarn),
        "qwen3_moe": CONFIGS["qwen3_moe"](),
        "deepseek_v3": DeepseekV3Config(**small, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16),
    }


@pytest.mark.parametrize("name", sorted(_rope_configs()))
def test_rotary_frequencies_computed_without_the_family_module_equal_its_own(name):
    """rotary_inv_freq computes the listed families' RoPE itself (importing their modeling
    module costs the engine's start seconds): it must give what that module's rotary class gives."""
    from rlx.engine.models.layers import DEFAULT_ROPE_PARTIAL, family_rotary, rotary_inv_freq

    cfg = _rope_configs()[name]
    assert cfg.model_type in DEFAULT_ROPE_PARTIAL
    ref = family_rotary(cfg)
    inv_freq, scaling = rotary_inv_freq(cfg)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == ref.inv_freq.shape
    assert torch.equal(inv_freq, ref.inv_freq.float()) and scaling == ref.attention_scaling


@pytest.mark.parametrize("family", ["glm4", "qwen3_moe"])
def test_a_bf16_random_checkpoint_is_the_fp32_one_rounded(family, tmp_path):
    """`write_tiny_checkpoint(dtype=bfloat16)` (the benches' 9B and 30B-A3B shapes, made on a GPU)
    writes the same tensors as the fp32 checkpoint of the same seed, rounded to bf16, on the CPU;
    config.json says bfloat16, and no embedding row is left zero."""
    from safetensors.torch import load_file

    fp32 = write_tiny_checkpoint(CONFIGS[family](), tmp_path / "fp32", seed=0)
    bf16 = write_tiny_checkpoint(CONFIGS[family](), tmp_path / "bf16", seed=0, dtype=torch.bfloat16)
    full, half = load_file(fp32 / "model.safetensors"), load_file(bf16 / "model.safetensors")
    assert sorted(half) == sorted(full)
    for name, tensor in half.items():
        assert tensor.dtype == torch.bfloat16, name
        assert torch.equal(tensor, full[name].to(torch.bfloat16)), name
    assert '"bfloat16"' in (bf16 / "config.json").read_text()
    assert (half["model.embed_tokens.weight"] != 0).any(dim=1).all()
