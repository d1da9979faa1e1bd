"""The trainer's log-prob and entropy kernels (rlx.trainer.triton_logprobs) against log_softmax in
fp64: one pass forward, one backward, over several vocabulary blocks (the last one partial), at
T = 1 and 0.7, with and without the entropy; a vocabulary split in two shards joins to the whole
(`rlx.trainer.logprobs._join_shards`, its all-reduces run across two threads). bf16 on a GPU,
fp32 in Triton's interpreter (conftest.py). tests/gpu/test_logprobs_cuda.py checks the whole
function at Qwen3's vocabulary."""

from __future__ import annotations

import threading

import pytest
import torch
from helpers import megatron_world  # tests/ is on sys.path (conftest)

B, S, V, BLOCK = 2, 7, 1000, 256  # four blocks a row, the last of 232


def inputs(device, dtype):
    """Logits [B, S, V] as the trainer's [:, :-1] view of [B, S + 1, V] (rows not contiguous),
    their targets and the loss's weights on log p and on the entropy."""
    g = torch.Generator(device=device).manual_seed(5)
    full = (torch.randn(B, S + 1, V, device=device, generator=g) * 3).to(dtype)
    target = torch.randint(0, V, (B, S), device=device, generator=g)
    w_logp, w_ent = torch.randn(2, B, S, device=device, generator=g, dtype=torch.float64).unbind(0)
    return full[:, :-1], target, w_logp, w_ent


def reference(logits, target, temperature, w_logp, w_ent):
    """(log p, entropy, d loss / d logits) in fp64 through autograd, loss = sum w_logp log p +
    w_ent H."""
    x = logits.detach().double().requires_grad_()
    logsm = torch.log_softmax(x / temperature, dim=-1)
    logp = logsm.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    ((w_logp * logp).sum() + (w_ent * entropy).sum()).backward()
    return logp.detach(), entropy.detach(), x.grad


def tolerance(dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 2e-5  # the logits' own rounding sets bf16's


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("with_entropy", [True, False])
def test_one_pass_matches_fp64(temperature, with_entropy, device, dtype):
    from rlx.trainer.logprobs import _join_shards
    from rlx.trainer.triton_logprobs import grad_logits, row_stats

    logits, target, w_logp, w_ent = inputs(device, dtype)
    owned = torch.ones_like(target, dtype=torch.bool)
    stats = row_stats(logits, target, owned, temperature, with_entropy, block_v=BLOCK)
    assert (stats[2] is None) == (not with_entropy)
    with megatron_world():  # one rank: the all-reduces are no-ops
        max_, log_z, logp, expected = _join_shards(*stats, owned)
    ref_logp, ref_entropy, ref_grad = reference(logits, target, temperature, w_logp, w_ent)
    # the row max is exact, and so the scaled logit it is taken from
    torch.testing.assert_close(max_, (logits.float() * (1 / temperature)).amax(-1), rtol=0, atol=0)
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=tolerance(dtype) / 10)
    if with_entropy:
        torch.testing.assert_close(
            (log_z - expected).double(), ref_entropy, rtol=0, atol=tolerance(dtype) / 10
        )

    g_ent = w_ent.float() if with_entropy else None
    if not with_entropy:
        ref_grad = reference(logits, target, temperature, w_logp, torch.zeros_like(w_ent))[2]
    args = (logits, max_, log_z, expected, target, owned, w_logp.float(), g_ent, temperature)
    grad = grad_logits(*args, block_v=BLOCK)
    assert grad.dtype == dtype and grad.shape == logits.shape
    scale = ref_grad.abs().max().item()
    assert (grad.double() - ref_grad).abs().max().item() <= scale * tolerance(dtype) / 4

    # written over the logits themselves (the trainer's way): the same gradient
    over = logits.contiguous()
    assert grad_logits(over, *args[1:], out=over, block_v=BLOCK) is over
    torch.testing.assert_close(over, grad, rtol=0, atol=0)


def test_two_shards_join_to_the_whole(device, dtype):
    """Each shard's stats (its own targets: a target outside it is not owned) joined over a group
    of two, as tensor-parallel ranks do: every rank gets the whole vocabulary's log p and entropy,
    and the gradient of its own shard."""
    import rlx.trainer.logprobs as logprobs
    from rlx.trainer.triton_logprobs import grad_logits, row_stats

    logits, target, w_logp, w_ent = inputs(device, dtype)
    half = V // 2
    shards = []
    for rank in range(2):
        local = target - rank * half
        owned = (local >= 0) & (local < half)
        local = local.clamp(0, half - 1)
        shard = logits[..., rank * half : (rank + 1) * half]
        shards.append((shard, local, owned, row_stats(shard, local, owned, 0.7, True, block_v=BLOCK)))
    assert shards[0][2].any() and shards[1][2].any()  # both shards hold some targets

    slots, barrier, here = [None, None], threading.Barrier(2), threading.local()

    def all_reduce(x, op=torch.distributed.ReduceOp.SUM):  # two threads' tensors reduced in place
        slots[here.rank] = x.clone()
        barrier.wait()
        x.copy_(torch.maximum(*slots) if op == torch.distributed.ReduceOp.MAX else slots[0] + slots[1])
        barrier.wait()
        return x

    joined = [None, None]

    def rank_join(rank):
        here.rank = rank
        joined[rank] = logprobs._join_shards(*shards[rank][3], shards[rank][2])

    original, logprobs._tp_all_reduce = logprobs._tp_all_reduce, all_reduce
    try:
        threads = [threading.Thread(target=rank_join, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        logprobs._tp_all_reduce = original
    ref_logp, ref_entropy, ref_grad = reference(logits, target, 0.7, w_logp, w_ent)
    grads = []
    for rank, (max_, log_z, logp, expected) in enumerate(joined):
        torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=tolerance(dtype) / 10)
        torch.testing.assert_close(
            (log_z - expected).double(), ref_entropy, rtol=0, atol=tolerance(dtype) / 10
        )
        shard, local, owned, _ = shards[rank]
        args = (max_, log_z, expected, local, owned, w_logp.float(), w_ent.float(), 0.7)
        grads.append(grad_logits(shard, *args, block_v=BLOCK))
    scale = ref_grad.abs().max().item()
    assert (torch.cat(grads, -1).double() - ref_grad).abs().max().item() <= scale * tolerance(dtype) / 4
