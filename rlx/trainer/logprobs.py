"""Per-token log-probabilities and entropy from (possibly vocab-parallel) logits.

Shapes: B batch, S sequence positions, V vocabulary entries held by this tensor-parallel rank.

One autograd function computes both in a few passes over the logits, reading them in their own
dtype (bf16 logits stay bf16) and saving only them and three fp32 numbers per position for the
backward, whose gradient it writes in one more pass (for the trainer over the logits themselves,
which nothing reads after it: a micro-batch's backward then holds one [B, S, V] tensor, not two):

    a = logits / T - max,   log Z = log sum exp(a),   p = exp(a - log Z)
    log p(t) = a_t - log Z,   H = log Z - sum p * a
    d/d logits = (g_logp * (onehot(t) - p) - g_H * p * (a - sum p * a)) / T

The unfused autograd chain this replaces kept several fp32 copies of the [B, S, V] logits alive
for the backward; at a 151,936-way vocabulary that was most of a GRPO micro-batch's memory-bound
work. On CUDA the forward is one Triton pass over the logits with an online softmax, the backward
another (`rlx.trainer.triton_logprobs`; torch.compile of the passes below compiled for seconds at
each new shape); on the CPU the torch ops below run eagerly (the forward is the unfused chain's
arithmetic, op for op).

Reductions over the vocabulary are all-reduced over the tensor-parallel group in the forward
(max, then the sums, each shard's rescaled to the global max on CUDA); the backward needs none:
every TP rank computes the same replicated loss from the reduced values, so each rank's gradient
is that of its own vocabulary shard. With TP = 1 the reductions are no-ops.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float()
    return logits / temperature if temperature != 1.0 else logits


def _shifted(logits: torch.Tensor, max_: torch.Tensor, temperature: float) -> torch.Tensor:
    """a = logits / T - max, in fp32."""
    return _scaled(logits, temperature) - max_.unsqueeze(-1)


def _row_max(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return _scaled(logits, temperature).amax(dim=-1)


def _log_z_and_picked(logits, max_, target, owned, temperature):
    shifted = _shifted(logits, max_, temperature)
    sum_exp = shifted.exp().sum(dim=-1)
    picked = shifted.gather(-1, target.unsqueeze(-1)).squeeze(-1) * owned
    return sum_exp, picked


def _shifted_and_probs(logits, max_, log_z, temperature):
    """(a, p) over this shard."""
    shifted = _shifted(logits, max_, temperature)
    return shifted, (shifted - log_z.unsqueeze(-1)).exp()


def _expected_shifted(logits, max_, log_z, temperature):
    """sum over this shard of p * a (the entropy's second term)."""
    shifted, probs = _shifted_and_probs(logits, max_, log_z, temperature)
    return (probs * shifted).sum(dim=-1)


def _grad_logits(logits, max_, log_z, expected, target, owned, grad_logp, grad_entropy, temperature):
    shifted, probs = _shifted_and_probs(logits, max_, log_z, temperature)
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    onehot = (vocab == target.unsqueeze(-1)) & owned.unsqueeze(-1)
    grad = grad_logp.unsqueeze(-1) * (onehot.float() - probs)
    if grad_entropy is not None:
        grad = grad - grad_entropy.unsqueeze(-1) * probs * (shifted - expected.unsqueeze(-1))
    if temperature != 1.0:
        grad = grad / temperature
    return grad.to(logits.dtype)


def _grad_over_logits(logits, max_, log_z, expected, target, owned, grad_logp, grad_entropy, temperature):
    """`_grad_logits` written over the logits themselves (elementwise: each entry reads only its
    own logit and its row's numbers), so the backward holds one [B, S, V] tensor, not two."""
    logits.copy_(
        _grad_logits(logits, max_, log_z, expected, target, owned, grad_logp, grad_entropy, temperature)
    )


def _tp_all_reduce(x: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(x, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return x


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, temperature: float, with_entropy: bool, overwrite: bool):
        num_local = logits.shape[-1]
        local_target = target - parallel_state.get_tensor_model_parallel_rank() * num_local
        owned = (local_target >= 0) & (local_target < num_local)
        local_target = local_target.clamp(0, num_local - 1)
        forward = _forward_cuda if logits.is_cuda else _forward_eager
        max_, log_z, logp, expected = forward(logits, local_target, owned, temperature, with_entropy)
        entropy = log_z - expected if with_entropy else None
        ctx.save_for_backward(logits, max_, log_z, expected, local_target, owned)
        ctx.temperature, ctx.overwrite = temperature, overwrite
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logits, max_, log_z, expected, target, owned = ctx.saved_tensors
        if grad_logp is None:
            grad_logp = torch.zeros_like(log_z)
        if expected is None:
            grad_entropy = None
        args = (logits, max_, log_z, expected, target, owned, grad_logp, grad_entropy, ctx.temperature)
        if logits.is_cuda:
            from rlx.trainer.triton_logprobs import grad_logits

            return grad_logits(*args, out=logits if ctx.overwrite else None), None, None, None, None
        if not ctx.overwrite:
            return _grad_logits(*args), None, None, None, None
        _grad_over_logits(*args)
        return logits, None, None, None, None


def _forward_eager(logits, target, owned, temperature, with_entropy):
    """(max, log Z, log p(target), sum p * a or None), each a pass of torch ops."""
    max_ = _tp_all_reduce(_row_max(logits, temperature), torch.distributed.ReduceOp.MAX)
    sum_exp, picked = _log_z_and_picked(logits, max_, target, owned, temperature)
    sums = _tp_all_reduce(torch.stack([sum_exp, picked]))
    log_z = sums[0].log()
    expected = None
    if with_entropy:
        expected = _tp_all_reduce(_expected_shifted(logits, max_, log_z, temperature))
    return max_, log_z, sums[1] - log_z, expected


def _forward_cuda(logits, target, owned, temperature, with_entropy):
    """`_forward_eager`'s results from one Triton pass over each shard."""
    from rlx.trainer.triton_logprobs import row_stats

    return _join_shards(*row_stats(logits, target, owned, temperature, with_entropy), owned)


def _join_shards(m, s, w, a_t, owned):
    """(max, log Z, log p(target), sum p * a or None) of the whole vocabulary from each shard's
    max m, s = sum exp(a - m), w = sum exp(a - m) (a - m) (None: no entropy) and target's a:
    every shard's sums rescaled to the global max, then added over the tensor-parallel group."""
    max_ = _tp_all_reduce(m.clone(), torch.distributed.ReduceOp.MAX)
    rescale = torch.exp(m - max_)
    parts = [s * rescale, torch.where(owned, a_t - max_, 0.0)]
    if w is not None:
        parts.append(rescale * (w + (m - max_) * s))
    sums = _tp_all_reduce(torch.stack(parts))
    log_z = sums[0].log()
    expected = sums[2] / sums[0] if w is not None else None
    return max_, log_z, sums[1] - log_z, expected


def logprobs_and_entropy(
    logits_BSV: torch.Tensor,
    target_BS: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    grad_over_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and the entropy of the temperature-scaled distribution at every position,
    in fp32 whatever the logits' dtype.

    `logits_BSV` is this rank's vocabulary shard (any dtype, any strides: a [:, :-1] view is not
    copied); `target_BS` holds global token ids. `grad_over_logits`: the backward writes the
    logits' gradient over them, for a caller that never reads them after it (the trainer; not a
    leaf, nor a view of a tensor whose other entries matter): one [B, S, V] tensor less at the peak."""
    overwrite = grad_over_logits and logits_BSV.is_contiguous() and not logits_BSV.is_leaf
    return _LogprobEntropy.apply(logits_BSV, target_BS, float(temperature), with_entropy, overwrite)
