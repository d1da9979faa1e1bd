"""Triton sampling for rows without truncation: a pass over each row's logits and one block of
them again (CUDA only).

The torch sampler makes about six passes over an fp32 [rows, V] copy of the logits and draws
noise from a generator, which keeps it out of a CUDA graph. Here a row's draw is the inverse of
its distribution function at one uniform u, (b + 0.5) / 2^23 for the top 23 bits b of the row's
hash of its seed and output index (`sampler.row_hash`): the first token, in id order, whose
cumulative probability passes u, as FlashInfer's sampling kernels draw (tests/helpers.py states
the rule in torch: `inverse_cdf`, `fused_uniform`). Two kernels:

- `_sample_blocks`, a program a (row, share of the vocabulary), reads each block of 2,048 logits
  once, in their own dtype, and writes the block's maximum of logits / T, its sum of
  exp(x / T - that maximum) and, for greedy rows, the lowest id at the maximum: a multiply, an
  exponential and two reductions an element. The exponential race it replaces drew from a 64-bit
  hash and took two logarithms an element (about 80 instructions): 176 -> 38 µs at 256 rows of
  Qwen3's vocabulary, 52 -> 14 at 64 (`bench/sampler.py`, 1×H200).
- `_sample_select`, a program a row, combines the blocks' sums into the row's normaliser Z,
  finds the block where the cumulative sum passes u * Z, and reads that block again to find the
  token; greedy rows take the first block at the row's maximum (ties to the lowest id, as
  torch.argmax). The logprob is log_softmax(logits / T) at the token (raw for greedy rows).

The blocks do not depend on the share count or on the other rows, so a seeded row draws the same
tokens alone, batched, inside or outside a graph. Rounding: the second kernel's sums may fall a
few ulps short of the first's; a target past the block's or the row's last token with mass takes
that token.

Rows that need top-k / top-p / min-p need a sort and stay with the torch sampler, whose
exponential race draws the same distribution by another rule (`sampler` says why).
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
BLOCK = 2048  # logits a block: the unit both kernels read and the share boundaries fall on


@triton.jit
def _mix(x):
    """splitmix64's finaliser on uint64 (as `sampler._mix` on int64 with masked shifts)."""
    x = (x ^ (x >> 30)) * _MIX1
    x = (x ^ (x >> 27)) * _MIX2
    return x ^ (x >> 31)


@triton.jit
def row_uniform(seed, step):
    """The row's uniform u = (b + 0.5) / 2^23 for the top 23 bits b of `sampler.row_hash` of
    (seed, step) (uint64): exact in fp32, inside (0, 1)."""
    bits = (_mix(seed * _GOLDEN + _mix(step + 1)) >> 41) & 0x7FFFFF
    return (bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)


@triton.jit
def find_block(mass, target, k, NB_P2: tl.constexpr):
    """The first block k whose mass summed from block 0 passes `target`, and the mass before it:
    the last block with mass where rounding leaves the target past them all, block 0 where none
    has mass (NaN logits)."""
    block = tl.min(tl.where(tl.cumsum(mass, 0) > target, k, NB_P2), 0)
    block = tl.minimum(block, tl.max(tl.where(mass > 0, k, -1), 0))
    block = tl.maximum(block, 0)
    return block, tl.sum(tl.where(k < block, mass, 0.0), 0)


@triton.jit
def _sample_blocks(
    Logits, stride_row, InvT, Greedy, Stats, Index,
    V, NB: tl.constexpr, BLOCK: tl.constexpr, SHARE: tl.constexpr, PDL: tl.constexpr = 0,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0)
    first = tl.program_id(1) * SHARE
    inv_t = tl.load(InvT + row)
    greedy = tl.load(Greedy + row) != 0
    base = Logits + row.to(tl.int64) * stride_row
    offsets = tl.arange(0, BLOCK)
    for b in range(first, tl.minimum(first + SHARE, NB)):
        index = b * BLOCK + offsets
        x = tl.load(base + index, mask=index < V, other=float("-inf")).to(tl.float32) * inv_t
        top = tl.max(x, 0)
        at = row * NB + b
        tl.store(Stats + at * 2, top)
        tl.store(Stats + at * 2 + 1, tl.sum(tl.exp(x - tl.where(top == float("-inf"), 0.0, top)), 0))
        if greedy:
            tl.store(Index + at, tl.min(tl.where(x == top, index, V), 0))


@triton.jit
def _sample_select(
    Logits, stride_row, InvT, Greedy, Seed, Step, Stats, Index, Tokens, Logprobs,
    V, NB: tl.constexpr, NB_P2: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0)
    k = tl.arange(0, NB_P2)
    # the row's inputs all at once, before any reduction (each reduction's barrier would hold
    # the loads after it: bench/kernel_ptx.py)
    top = tl.load(Stats + (row * NB + k) * 2, mask=k < NB, other=float("-inf"))
    mass = tl.load(Stats + (row * NB + k) * 2 + 1, mask=k < NB, other=0.0)
    inv_t = tl.load(InvT + row)
    greedy = tl.load(Greedy + row) != 0
    seed = tl.load(Seed + row).to(tl.uint64)
    step = tl.load(Step + row).to(tl.uint64)
    m = tl.max(top, 0)
    mass = tl.where(top == float("-inf"), 0.0, mass) * tl.exp(top - m)
    z = tl.sum(mass, 0)
    base = Logits + row.to(tl.int64) * stride_row
    if greedy:
        token = tl.load(Index + row * NB + tl.minimum(tl.min(tl.where(top == m, k, NB_P2), 0), NB - 1))
        x_token = m  # its logit / T is the row's maximum (1 / T is 1 for greedy rows)
    else:
        target = row_uniform(seed, step) * z
        block, before = find_block(mass, target, k, NB_P2)
        index = block * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(base + index, mask=index < V, other=float("-inf")).to(tl.float32) * inv_t
        p = tl.exp(x - m)
        found = tl.min(tl.where(before + tl.cumsum(p, 0) > target, index, V), 0)
        token = tl.minimum(found, tl.max(tl.where(p > 0, index, -1), 0))
        x_token = tl.sum(tl.where(index == token, x, 0.0), 0)  # from the block, not read again
    token = tl.minimum(tl.maximum(token, 0), V - 1)  # NaN logits match nothing: an id in bounds
    tl.store(Tokens + row, token.to(Tokens.dtype.element_ty))
    tl.store(Logprobs + row, x_token - m - tl.log(z))


def default_splits(rows: int, device: torch.device, vocab: int) -> int:
    """Vocabulary shares a row: programs for about sixteen per SM, at most a block each (the
    first kernel streams the logits; at 64 rows 14.6 µs at 16 shares a row, 13.8 at this rule's
    25, 13.2 at 75; at 256 rows 41.4 at 4 shares, 38.2 at 9: `bench/sampler.py --splits`, 1×H200)."""
    return max(1, min(triton.cdiv(vocab, BLOCK), triton.cdiv(16 * sm_count(device), rows)))


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
    `splits`, the programs a row in the first kernel, None chooses by `default_splits`. The
    draws do not depend on it.
    """
    rows, vocab = logits_NV.shape
    if rows == 0:
        return
    assert tokens_N.is_contiguous() and logprobs_N.is_contiguous()
    # the kernels read row i at offset i: columns of SamplingBatch's packed tensors are strided
    inv_temperature_N, greedy_N, seed_N, step_N = (
        t.contiguous() for t in (inv_temperature_N, greedy_N, seed_N, step_N)
    )
    if splits is None:
        splits = default_splits(rows, logits_NV.device, vocab)
    blocks = triton.cdiv(vocab, BLOCK)
    share = triton.cdiv(blocks, splits)
    stats = torch.empty(rows, blocks, 2, dtype=torch.float32, device=logits_NV.device)
    index = torch.empty(rows, blocks, dtype=torch.int32, device=logits_NV.device)
    pdl = pdl_launch(logits_NV.device)
    _sample_blocks[(rows, triton.cdiv(blocks, share))](
        logits_NV, logits_NV.stride(0), inv_temperature_N, greedy_N, stats, index,
        vocab, NB=blocks, BLOCK=BLOCK, SHARE=share, num_warps=8, **pdl,
    )  # fmt: skip
    _sample_select[(rows,)](
        logits_NV, logits_NV.stride(0), inv_temperature_N, greedy_N, seed_N, step_N, stats, index,
        tokens_N, logprobs_N, vocab, NB=blocks, NB_P2=triton.next_power_of_2(blocks), BLOCK=BLOCK,
        num_warps=8, **pdl,
    )  # fmt: skip
