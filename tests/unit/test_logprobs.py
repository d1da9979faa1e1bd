"""rlx.trainer.logprobs against autograd through torch's log_softmax in fp64.

The fused function derives its own gradient; the reference differentiates
`log_softmax(logits / T)` (log-prob of the target, entropy -sum p log p) by autograd. Values and
the logits' gradient of a random weighting of both must agree, on a [:, :-1] view of the logits as
the trainer passes them, with and without temperature and entropy, for fp32 and bf16 logits, and
over two tensor-parallel vocabulary shards (gloo).
"""

from __future__ import annotations

import pytest
import torch
from helpers import megatron_world, spawn_ranks

from rlx.trainer.logprobs import logprobs_and_entropy

B, L, V = 3, 7, 50


def inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    logits_BLV = (torch.randn(B, L, V, generator=gen) * 3).to(dtype)
    tokens_BL = torch.randint(0, V, (B, L), generator=gen)
    w_logp, w_ent = torch.randn(2, B, L - 1, generator=gen).unbind(0)
    return logits_BLV, tokens_BL, w_logp, w_ent


def reference(logits_BLV, tokens_BL, w_logp, w_ent, temperature, with_entropy):
    """(logp, entropy, d loss / d logits) by autograd in fp64."""
    logits = logits_BLV.detach().double().requires_grad_()
    logsm = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    logp = logsm.gather(-1, tokens_BL[:, 1:].unsqueeze(-1)).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    loss = (w_logp * logp).sum() + ((w_ent * entropy).sum() if with_entropy else 0.0)
    loss.backward()
    return logp.detach(), entropy.detach(), logits.grad


def fused(logits_BLV, tokens_BL, w_logp, w_ent, temperature, with_entropy):
    logits = logits_BLV.detach().clone().requires_grad_()
    logp, entropy = logprobs_and_entropy(
        logits[:, :-1], tokens_BL[:, 1:], temperature=temperature, with_entropy=with_entropy
    )
    loss = (w_logp * logp).sum() + ((w_ent * entropy).sum() if with_entropy else 0.0)
    loss.backward()
    return logp.detach(), entropy, logits.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_matches_autograd_in_fp32(temperature, with_entropy):
    args = inputs()
    with megatron_world():
        logp, entropy, grad = fused(*args, temperature, with_entropy)
    ref_logp, ref_entropy, ref_grad = reference(*args, temperature, with_entropy)
    assert logp.dtype == torch.float32 and grad.dtype == torch.float32
    torch.testing.assert_close(logp.double(), ref_logp, atol=2e-6, rtol=1e-6)
    if with_entropy:
        torch.testing.assert_close(entropy.double(), ref_entropy, atol=2e-6, rtol=1e-6)
    else:
        assert entropy is None
    torch.testing.assert_close(grad.double(), ref_grad, atol=2e-6, rtol=1e-5)
    assert grad[:, -1].abs().max() == 0  # the last position predicts nothing


def test_entropy_unused_in_the_loss():
    """Entropy computed (as for logging) but not in the loss: the gradient is logp's alone."""
    logits_BLV, tokens_BL, w_logp, _ = inputs()
    logits = logits_BLV.clone().requires_grad_()
    with megatron_world():
        logp, entropy = logprobs_and_entropy(logits[:, :-1], tokens_BL[:, 1:])
        (w_logp * logp).sum().backward()
    *_, ref_grad = reference(logits_BLV, tokens_BL, w_logp, None, 1.0, with_entropy=False)
    torch.testing.assert_close(logits.grad.double(), ref_grad, atol=2e-6, rtol=1e-5)


def test_bf16_logits_keep_their_dtype_and_fp32_results():
    """bf16 logits are read as they are: fp32 results equal to the fp64 ones from the same bf16
    values, and a bf16 gradient (rounded from the exact one)."""
    args = inputs(torch.bfloat16)
    with megatron_world():
        logp, entropy, grad = fused(*args, 1.0, True)
    ref_logp, ref_entropy, ref_grad = reference(*args, 1.0, True)
    assert logp.dtype == entropy.dtype == torch.float32 and grad.dtype == torch.bfloat16
    torch.testing.assert_close(logp.double(), ref_logp, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(entropy.double(), ref_entropy, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(grad.double(), ref_grad, atol=1e-5, rtol=8e-3)  # one bf16 rounding


def test_gradient_written_over_the_logits():
    """`grad_over_logits`: the gradient of whole (contiguous, non-leaf) logits is written into their
    own storage and reaches the leaf as the reference's; a leaf or a view keeps its values."""
    logits_BLV, tokens_BL, w_logp, w_ent = inputs()
    ref_logp, ref_entropy, ref_grad = reference(logits_BLV, tokens_BL, w_logp, w_ent, 0.7, True)
    leaf = logits_BLV.clone().requires_grad_()
    logits = leaf * 1.0  # as an output layer's result: not a leaf
    storage = logits.data_ptr()
    received = []
    logits.register_hook(received.append)
    target = tokens_BL.roll(-1, dims=1)  # the last position's (wrapped) result is dropped
    with megatron_world():
        logp, entropy = logprobs_and_entropy(logits, target, temperature=0.7, grad_over_logits=True)
        ((w_logp * logp[:, :-1]).sum() + (w_ent * entropy[:, :-1]).sum()).backward()
    torch.testing.assert_close(logp[:, :-1].detach().double(), ref_logp, atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(entropy[:, :-1].detach().double(), ref_entropy, atol=2e-6, rtol=1e-6)
    assert received[0].data_ptr() == storage  # no gradient tensor of its own
    torch.testing.assert_close(leaf.grad.double(), ref_grad, atol=2e-6, rtol=1e-5)
    assert leaf.grad.data_ptr() != storage and torch.equal(logits.detach(), leaf.grad)  # held it
    for kept in (leaf, logits_BLV.clone().requires_grad_()[:, :-1]):  # a leaf, a view: not written over
        before = kept.detach().clone()
        with megatron_world():
            logp, _ = logprobs_and_entropy(kept, target[:, : kept.shape[1]], grad_over_logits=True)
            logp.sum().backward()
        assert torch.equal(kept.detach(), before)


def _tp2_rank(rank: int, world_size: int, port: int, out: dict) -> None:
    torch.set_num_threads(1)
    logits_BLV, tokens_BL, w_logp, w_ent = inputs()
    shard = V // 2
    with megatron_world(rank, world_size, port, tp=2):
        logp, entropy, grad = fused(
            logits_BLV[..., rank * shard : (rank + 1) * shard], tokens_BL, w_logp, w_ent, 0.7, True
        )
    torch.save({"logp": logp, "entropy": entropy, "grad": grad}, out[rank])


def test_two_vocabulary_shards_equal_the_whole(tmp_path):
    out = {rank: tmp_path / f"rank{rank}.pt" for rank in range(2)}
    spawn_ranks(_tp2_rank, 2, out)
    ranks = [torch.load(out[rank]) for rank in range(2)]
    ref_logp, ref_entropy, ref_grad = reference(*inputs(), 0.7, True)
    for result in ranks:  # every rank holds the whole (reduced) values
        torch.testing.assert_close(result["logp"].double(), ref_logp, atol=2e-6, rtol=1e-6)
        torch.testing.assert_close(result["entropy"].double(), ref_entropy, atol=2e-6, rtol=1e-6)
    grad = torch.cat([r["grad"] for r in ranks], dim=-1)  # each rank: its own shard's gradient
    torch.testing.assert_close(grad.double(), ref_grad, atol=2e-6, rtol=1e-5)
