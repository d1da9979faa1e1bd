"""Log-probabilities and entropy over a vocabulary in Triton: one pass over the logits forward,
one backward (`rlx.trainer.logprobs` on CUDA).

A program takes one position (a row of the vocabulary shard) and walks it BLOCK_V entries at a
time in fp32. The forward keeps an online softmax of a = x / T (x the logits, T the temperature):
the running max m, s = sum exp(a - m) and w = sum exp(a - m) (a - m), rescaled by exp(m - m')
when the max grows to m' (w then gains (m - m') s):

    per row: m, s, w, and the target's a (where this shard holds the target)

so that `logprobs` can join the shards of a vocabulary split over tensor-parallel ranks: with
the global max M, S = sum_r s_r exp(m_r - M), log Z = log S, log p(t) = a_t - M - log Z, and the
entropy H = log Z - W / S with W = sum_r exp(m_r - M) (w_r + (m_r - M) s_r). The backward reads
each logit once more and writes its gradient, over the logits themselves if asked (an element
reads only its own logit before its program writes it):

    d/dx = (g_logp (onehot(t) - p) - g_H p (a - M - E)) / T,   p = exp(a - M - log Z)

with E = W / S. torch.compile made three passes forward of the same arithmetic, and the first
call of each shape compiled: 4-10 s each at step 0 of a run on a fresh machine (1xH200). The
logits are read where they lie ([B, S, V] of any strides whose last one is 1: the trainer's
[:, :-1] view). CUDA only, or Triton's CPU interpreter (tests/kernels): importing this module
imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # vocabulary entries a program holds at once: 16 fp32 a thread at 8 warps
NUM_WARPS = 8


@triton.jit
def _row_offset(row, n_pos, stride_b, stride_s):
    b = row // n_pos
    return b.to(tl.int64) * stride_b + (row - b * n_pos).to(tl.int64) * stride_s


@triton.jit
def _stats_kernel(X, T, OWNED, M, S, W, A_T, n_pos, V, stride_b, stride_s, inv_t,
                  SCALE: tl.constexpr, ENTROPY: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    x_row = X + _row_offset(row, n_pos, stride_b, stride_s)
    cols = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    w = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK):
        at = start + cols
        a = tl.load(x_row + at, mask=at < V, other=-float("inf")).to(tl.float32)
        if SCALE:
            a = a * inv_t
        m_new = tl.maximum(m, tl.max(a, 0))
        shifted = a - m_new
        e = tl.exp(shifted)
        alpha = tl.exp(m - m_new)
        if ENTROPY:  # where e is 0 (entries past V among them) shifted may be -inf: 0 * -inf is NaN
            moved = tl.where(s > 0, m - m_new, 0.0) * s  # m is -inf before the first block
            w = alpha * (w + moved) + tl.sum(tl.where(e > 0, shifted, 0.0) * e, 0)
        s = s * alpha + tl.sum(e, 0)
        m = m_new
    target = tl.load(T + row)
    owned = tl.load(OWNED + row) != 0
    a_t = tl.load(x_row + target, mask=owned, other=0.0).to(tl.float32)
    if SCALE:
        a_t = a_t * inv_t
    tl.store(M + row, m)
    tl.store(S + row, s)
    tl.store(A_T + row, a_t)
    if ENTROPY:
        tl.store(W + row, w)


@triton.jit
def _grad_kernel(X, OUT, MAX, LOG_Z, EXPECTED, T, OWNED, G_LOGP, G_H, n_pos, V, stride_b, stride_s,
                 out_stride_b, out_stride_s, inv_t, SCALE: tl.constexpr, ENTROPY: tl.constexpr,
                 BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0)
    x_row = X + _row_offset(row, n_pos, stride_b, stride_s)
    out_row = OUT + _row_offset(row, n_pos, out_stride_b, out_stride_s)
    max_ = tl.load(MAX + row)
    log_z = tl.load(LOG_Z + row)
    target = tl.load(T + row)
    target = tl.where(tl.load(OWNED + row) != 0, target, -1)
    g_logp = tl.load(G_LOGP + row)
    if ENTROPY:
        g_h = tl.load(G_H + row)
        expected = tl.load(EXPECTED + row)
    cols = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        at = start + cols
        in_v = at < V
        a = tl.load(x_row + at, mask=in_v, other=0.0).to(tl.float32)
        if SCALE:
            a = a * inv_t
        shifted = a - max_
        p = tl.exp(shifted - log_z)
        grad = g_logp * (tl.where(at == target, 1.0, 0.0) - p)
        if ENTROPY:
            grad = grad - g_h * p * (shifted - expected)
        if SCALE:
            grad = grad * inv_t
        tl.store(out_row + at, grad.to(OUT.dtype.element_ty), mask=in_v)


def _check(logits: torch.Tensor) -> None:
    assert logits.dim() == 3 and logits.stride(-1) == 1, "logits [B, S, V] with contiguous rows"


def row_stats(
    logits: torch.Tensor,
    target: torch.Tensor,
    owned: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    block_v: int = BLOCK_V,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per position of logits [B, S, V] (this shard), fp32 [B, S] each: m, s, w (None without
    entropy) and the target's a (0 where `owned` is false); `target` holds shard-local ids."""
    _check(logits)
    batch, n_pos, vocab = logits.shape
    out = torch.empty(4, batch, n_pos, dtype=torch.float32, device=logits.device)
    m, s, w, a_t = out.unbind(0)
    _stats_kernel[(batch * n_pos,)](
        logits, target.contiguous(), owned.contiguous(), m, s, w, a_t, n_pos, vocab,
        logits.stride(0), logits.stride(1), 1.0 / temperature,
        SCALE=temperature != 1.0, ENTROPY=with_entropy, BLOCK=block_v, num_warps=NUM_WARPS,
    )  # fmt: skip
    return m, s, (w if with_entropy else None), a_t


def grad_logits(
    logits: torch.Tensor, max_: torch.Tensor, log_z: torch.Tensor, expected: torch.Tensor | None,
    target: torch.Tensor, owned: torch.Tensor, grad_logp: torch.Tensor, grad_entropy: torch.Tensor | None,
    temperature: float, out: torch.Tensor | None = None, block_v: int = BLOCK_V,
) -> torch.Tensor:  # fmt: skip
    """The logits' gradient (their dtype) into `out` (new where None; may be `logits` itself)."""
    _check(logits)
    batch, n_pos, vocab = logits.shape
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device) if out is None else out
    _check(out)
    entropy = grad_entropy is not None
    _grad_kernel[(batch * n_pos,)](
        logits, out, max_.contiguous(), log_z.contiguous(), expected.contiguous() if entropy else max_,
        target.contiguous(), owned.contiguous(), grad_logp.contiguous(),
        grad_entropy.contiguous() if entropy else max_, n_pos, vocab,
        logits.stride(0), logits.stride(1), out.stride(0), out.stride(1), 1.0 / temperature,
        SCALE=temperature != 1.0, ENTROPY=entropy, BLOCK=block_v, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
