"""Triton sampling for rows without truncation: one pass over each row's logits (CUDA only).

The torch sampler makes about six passes over an fp32 [rows, V] copy of the logits (cast,
divide, log_softmax, exp, noise, divide, argmax) and draws noise from a generator, which keeps
it out of a CUDA graph. Here one program per row streams its logits once, in their own dtype,
and keeps three running reductions: the log-sum-exp of logits / T (online softmax), and the
argmax of the exponential race in log space, x / T - log(E), with E from the same
counter-based hash of (seed, output index, token id) as `sampler.seeded_exponential`. That
race picks the same token as the torch sampler's argmax(p / E) (p = exp(logp); the row's
log-sum-exp does not change the argmax). Greedy rows race on the raw logits; ties go to the
lowest token id, as torch.argmax does. Nothing here depends on the other rows, so a seeded
row draws the same tokens alone, batched, inside or outside a graph.

With few rows one program a row leaves most SMs idle (and the hash is integer work, not a
memory stream): each row's vocabulary is then cut into `splits` shares, a program a share keeps
the same reductions over its share, and a second kernel merges them (log-sum-exps combined,
the best score taken, a tie going to the earlier share, so to the lowest id). The split count
depends on the rows alone, so a decode graph captures it with its batch size.

Rows that need top-k / top-p / min-p need a sort and stay with the torch sampler.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlx.engine.pdl import pdl_launch, pdl_prologue
from rlx.engine.triton_decode import sm_count

_GOLDEN = tl.constexpr(0x9E3779B97F4A7C15)
_MIX1 = tl.constexpr(0xBF58476D1CE4E5B9)
_MIX2 = tl.constexpr(0x94D049BB133111EB)
_UNIFORM_MAX = tl.constexpr(1.0 - 2.0**-24)  # sampler.UNIFORM_MAX: the largest fp32 below 1


@triton.jit
def _mix(x):
    """splitmix64's finaliser on uint64 (as `sampler._mix` on int64 with masked shifts)."""
    x = (x ^ (x >> 30)) * _MIX1
    x = (x ^ (x >> 27)) * _MIX2
    return x ^ (x >> 31)


@triton.jit
def _sample_kernel(
    Logits, stride_row, InvT, Greedy, Seed, Step, Tokens, Logprobs, PartF, PartI,
    V: tl.constexpr, BLOCK: tl.constexpr, SPLITS: tl.constexpr, SHARE: tl.constexpr, PDL: tl.constexpr = 0,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0)
    split = tl.program_id(1)
    lo = split * SHARE
    hi = tl.minimum(lo + SHARE, V)
    inv_t = tl.load(InvT + row)
    greedy = tl.load(Greedy + row) != 0
    seed = tl.load(Seed + row).to(tl.uint64)
    step = tl.load(Step + row).to(tl.uint64)
    row_key = _mix(seed * _GOLDEN + _mix(step + 1))
    offsets = tl.arange(0, BLOCK)
    m_i = float("-inf")
    l_i = 0.0
    best_score = float("-inf")
    best_index = 0
    best_x = 0.0
    for start in range(lo, hi, BLOCK):  # every block holds at least one valid id
        index = start + offsets
        valid = index < hi
        x = tl.load(Logits + row.to(tl.int64) * stride_row + index, mask=valid, other=float("-inf"))
        x = x.to(tl.float32) * inv_t
        m_new = tl.maximum(m_i, tl.max(x, 0))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m_i = m_new
        if greedy:
            score = x
        else:
            bits = (_mix(row_key + index.to(tl.uint64) * _GOLDEN) >> 40) & 0xFFFFFF
            # below 1 (sampler.seeded_exponential): at 1 the noise -log(u) is 0 and the token won
            uniform = tl.minimum((bits.to(tl.float32) + 0.5) * (1.0 / 16777216.0), _UNIFORM_MAX)
            score = tl.where(valid, x - tl.log(-tl.log(uniform)), float("-inf"))
        chunk_best = tl.max(score, 0)
        chunk_index = tl.min(tl.where(score == chunk_best, index, V), 0)  # lowest id among ties
        if chunk_best > best_score:  # strict: an earlier chunk keeps its tie
            best_score = chunk_best
            best_index = chunk_index
            best_x = tl.sum(tl.where(index == chunk_index, x, 0.0), 0)
    if SPLITS == 1:
        tl.store(Tokens + row, best_index.to(Tokens.dtype.element_ty))
        tl.store(Logprobs + row, best_x - m_i - tl.log(l_i))
    else:  # PartF [rows, SPLITS, 4]: max, sum of exp, best score, its x; PartI [rows, SPLITS]
        at = row * SPLITS + split
        tl.store(PartF + at * 4, m_i)
        tl.store(PartF + at * 4 + 1, l_i)
        tl.store(PartF + at * 4 + 2, best_score)
        tl.store(PartF + at * 4 + 3, best_x)
        tl.store(PartI + at, best_index)


@triton.jit
def _merge_kernel(PartF, PartI, Tokens, Logprobs, SPLITS: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    at = row * SPLITS + tl.arange(0, SPLITS)
    m = tl.load(PartF + at * 4)
    lse_max = tl.max(m, 0)  # share 0 is never empty, so finite
    total = tl.sum(tl.load(PartF + at * 4 + 1) * tl.exp(m - lse_max), 0)
    score = tl.load(PartF + at * 4 + 2)
    best = tl.max(score, 0)
    first = tl.min(tl.where(score == best, tl.arange(0, SPLITS), SPLITS), 0)  # the earliest share
    index = tl.sum(tl.where(tl.arange(0, SPLITS) == first, tl.load(PartI + at), 0), 0)
    x = tl.sum(tl.where(tl.arange(0, SPLITS) == first, tl.load(PartF + at * 4 + 3), 0.0), 0)
    tl.store(Tokens + row, index.to(Tokens.dtype.element_ty))
    tl.store(Logprobs + row, x - lse_max - tl.log(total))


def default_splits(rows: int, device: torch.device) -> int:
    """Vocabulary shares a row: programs for about four per SM, at most 16 (a power of 2)."""
    target = 4 * sm_count(device)
    splits = 1
    while splits < 16 and rows * splits < target:
        splits *= 2
    return splits


def fused_sample(
    logits_NV: torch.Tensor,
    inv_temperature_N: torch.Tensor,
    greedy_N: torch.Tensor,
    seed_N: torch.Tensor,
    step_N: torch.Tensor,
    tokens_N: torch.Tensor,
    logprobs_N: torch.Tensor,
    splits: int | None = None,
) -> None:
    """Write each row's token and its logprob (fp32) into `tokens_N` / `logprobs_N` (tokens in
    int64, or in fp32 for a single readback buffer: ids below 2**24 are exact).

    inv_temperature_N is 1 / T (1 for greedy rows: their logprob is the raw log_softmax);
    greedy_N nonzero for greedy rows; seed_N / step_N int64 (the hash's key and counter);
    `splits` None chooses by `default_splits` (a power of 2).
    """
    rows, vocab = logits_NV.shape
    if rows == 0:
        return
    assert tokens_N.is_contiguous() and logprobs_N.is_contiguous()
    # the kernel reads row i at offset i: columns of SamplingBatch's packed tensors are strided
    inv_temperature_N, greedy_N, seed_N, step_N = (
        t.contiguous() for t in (inv_temperature_N, greedy_N, seed_N, step_N)
    )
    if splits is None:
        splits = default_splits(rows, logits_NV.device)
    block = 2048
    share = triton.cdiv(triton.cdiv(vocab, splits), block) * block  # whole blocks a share
    part_f = part_i = logprobs_N  # unused with one share
    if splits > 1:
        part_f = torch.empty(rows, splits, 4, dtype=torch.float32, device=logits_NV.device)
        part_i = torch.empty(rows, splits, dtype=torch.int64, device=logits_NV.device)
    pdl = pdl_launch(logits_NV.device)
    _sample_kernel[(rows, splits)](
        logits_NV, logits_NV.stride(0), inv_temperature_N, greedy_N, seed_N, step_N,
        tokens_N, logprobs_N, part_f, part_i, vocab, BLOCK=block, SPLITS=splits, SHARE=share, num_warps=8,
        **pdl,
    )  # fmt: skip
    if splits > 1:
        _merge_kernel[(rows,)](part_f, part_i, tokens_N, logprobs_N, SPLITS=splits, **pdl)
