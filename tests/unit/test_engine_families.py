"""Every fast-path family (llama with llama3 rope scaling, glm4, qwen3_moe) against transformers
on CPU: the engine's sampled tokens have transformers' log-softmax within 1e-4."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Glm4Config, LlamaConfig, Qwen3MoeConfig

from rlx.engine import Engine, EngineArgs, GenerateRequest, SamplingParams
from rlx.models.tiny import write_tiny_checkpoint

COMMON = dict(vocab_size=16, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=64, pad_token_id=0, eos_token_id=1, initializer_range=0.2)  # fmt: skip
CONFIGS = {
    "llama": lambda: LlamaConfig(
        **COMMON,
        intermediate_size=128,
        num_hidden_layers=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),  # fmt: skip
    "glm4": lambda: Glm4Config(**COMMON, intermediate_size=128, num_hidden_layers=2, attention_bias=True),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **COMMON,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
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
