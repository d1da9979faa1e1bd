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
work. On CUDA each pass is torch.compile'd into one kernel; on the CPU the same torch ops run
eagerly (the forward is the unfused chain's arithmetic, op for op).

Reductions over the vocabulary are all-reduced over the tensor-parallel group in the forward
(max, then the sums); the backward needs none: every TP rank computes the same replicated loss
from the reduced values, so each rank's gradient is that of its own vocabulary shard. With TP = 1
the reductions are no-ops.
"""

from __future__ import annotations

from functools import cache

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


@cache
def _kernel(fn, on_cuda: bool):
    """`fn` itself on the CPU; compiled into one kernel on CUDA. Shapes are left to torch's
    automatic dynamism: the batch and length dimensions that change between micro-batches become
    dynamic after the first recompile, while the vocabulary stays a constant (a symbolic one made
    the gradient's row index a runtime division per element: 5x slower on an H200)."""
    return torch.compile(fn) if on_cuda else fn


def _tp_all_reduce(x: torch.Tensor, op=torch.distributed.ReduceOp.SUM) -> torch.Tensor:
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(x, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return x


class _LogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, temperature: float, with_entropy: bool, overwrite: bool):
        run = lambda fn, *args: _kernel(fn, logits.is_cuda)(*args)  # noqa: E731
        num_local = logits.shape[-1]
        local_target = target - parallel_state.get_tensor_model_parallel_rank() * num_local
        owned = (local_target >= 0) & (local_target < num_local)
        local_target = local_target.clamp(0, num_local - 1)

        max_ = _tp_all_reduce(run(_row_max, logits, temperature), torch.distributed.ReduceOp.MAX)
        sum_exp, picked = run(_log_z_and_picked, logits, max_, local_target, owned, temperature)
        sums = _tp_all_reduce(torch.stack([sum_exp, picked]))
        log_z = sums[0].log()
        logp = sums[1] - log_z
        expected = entropy = None
        if with_entropy:
            expected = _tp_all_reduce(run(_expected_shifted, logits, max_, log_z, temperature))
            entropy = log_z - expected
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
        if not ctx.overwrite:
            return _kernel(_grad_logits, logits.is_cuda)(*args), None, None, None, None
        _kernel(_grad_over_logits, logits.is_cuda)(*args)
        return logits, None, None, None, None


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
