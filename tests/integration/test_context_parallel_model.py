"""Context parallelism in the model (CPU, gloo, 2 ranks): megatron's GPTModel with rlx's SDPA core
attention under CP=2 gives the one-rank logits and parameter gradients, for every family: plain
RoPE (Qwen3), Llama 3 RoPE scaling, MLA with YaRN RoPE and MoE (DeepSeek-V3), MoE (Qwen3-MoE).

Each CP rank feeds the model its two load-balanced chunks of a 24-token batch; the logits come
back gathered in sequence order, and the gradients of a fixed random functional of the logits,
summed over the two ranks (what DDP's reduction over DP x CP does), are the one-rank gradients.
A wrong RoPE position, key order or causal mask on either rank changes the logits. Tolerance
1e-5 (fp32, the same arithmetic in another order).
"""

from __future__ import annotations

import helpers  # tests/ is on sys.path (conftest)
import pytest
import torch
from helpers import megatron_world, spawn_ranks, token_batch

from rlx.config import build
from rlx.config.compose import compose, to_object

FAMILIES = ["tiny_qwen3", "tiny_llama3", "tiny_deepseek_v3", "tiny_qwen3_moe"]
SEQ_LEN = 24  # a multiple of 2 x CP: chunks of 6 tokens


def forward_backward(model, ids: torch.Tensor, weights_BLV: torch.Tensor):
    """Full-sequence logits and the gradients of sum(logits * weights), by parameter name."""
    from rlx.trainer import context

    positions = context.local_positions(ids.shape[1], ids.device)
    logits_BSV = model(
        input_ids=ids[:, positions], position_ids=positions.expand(ids.shape[0], -1), attention_mask=None
    )
    logits_BLV = context.gather_sequence(logits_BSV)
    (logits_BLV * weights_BLV).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits_BLV.detach(), grads


def run_cp2(rank: int, world_size: int, port: int, model_cfg, reference: dict) -> None:
    with megatron_world(rank, world_size, port, cp=2):
        family = build(model_cfg)
        model = helpers.load_megatron(family, model_cfg.hf_checkpoint)
        logits, grads = forward_backward(model, reference["ids"], reference["weights"])
        torch.testing.assert_close(logits, reference["logits"], rtol=1e-5, atol=1e-5)
        for name, grad in sorted(grads.items()):
            torch.distributed.all_reduce(grad)  # the CP ranks' shares of the gradient, summed
            torch.testing.assert_close(grad, reference["grads"][name], rtol=1e-5, atol=1e-5, msg=name)
        assert sorted(grads) == sorted(reference["grads"])


@pytest.mark.parametrize("option", FAMILIES)
def test_cp2_gives_the_one_rank_logits_and_gradients(option, tmp_path, monkeypatch):
    monkeypatch.setenv("RLX_CACHE", str(tmp_path / "cache"))
    model_cfg = to_object(compose([f"model={option}"])).model
    family = build(model_cfg)
    model_cfg.hf_checkpoint = str(family.checkpoint_dir())
    ids = token_batch(SEQ_LEN, model_cfg.vocab_size)
    weights = torch.randn(
        ids.shape[0], SEQ_LEN, model_cfg.vocab_size, generator=torch.Generator().manual_seed(1)
    )
    with megatron_world():
        model = helpers.load_megatron(build(model_cfg), model_cfg.hf_checkpoint)
        logits, grads = forward_backward(model, ids, weights)
    # the one-rank model is transformers' model (so the reference is right)
    torch.testing.assert_close(logits, helpers.hf_logits(model_cfg.hf_checkpoint, ids), rtol=1e-4, atol=1e-4)
    spawn_ranks(run_cp2, 2, model_cfg, {"ids": ids, "weights": weights, "logits": logits, "grads": grads})
