"""Triton sampling for rows with top-k, top-p or min-p: no sort (CUDA only).

SGLang keeps, in the order of the probabilities sorted descending, the tokens ranked below
top_k, those whose probability summed over the tokens before them is at most top_p, and those
at least min_p times the largest; then draws from what is kept, renormalised. The torch path
(`sampler.truncate`) sorts each row: 2.5 ms at 64 rows of Qwen3's vocabulary, 8.5 ms at 256,
more than a whole decode step. Here the last kept token is found by a search over the row's
values instead, in passes over the row, each a kernel of programs a (row, share of the
vocabulary), with a program a row between them that sums the shares' parts in one order
(so every program of a row agrees, and a row draws the same alone or batched):

1. `_row_stats`: each share's maximum and sum of exp(s - that maximum) for s = logit / T, and
   its smallest and largest keys: integers in the order of the logits' values (their bits,
   negatives flipped; -0 below +0); `_start_state` combines them;
2. `_search_pass`, 5 times for 2-byte logits (9 for fp32), each followed by `_next_state`: the
   smallest key v at which fewer than top_k tokens lie above and their mass exp(s - m) (m the
   row's maximum) is at most top_p * Z (Z the row's sum): each pass counts the tokens and sums
   the mass above 16 keys in the interval left (the count alone where no row of the batch has
   top_p, the mass alone where none has top_k: `sums`): the first pass's keys near the maximum
   where the boundary likely lies there (`_start_state`), else, as every later pass's, evenly
   spread (the interval shrinks 16-fold); a pass whose interval is done does nothing. The
   tokens above v are kept; of those at v (ties, counted in step 3), the first c by id, c as
   many as top_k and top_p leave room for; min_p keeps those with exp(s - m) >= min_p (its bound
   is a value);
3. `_kept_blocks`: each block's kept mass above v and its count of ties at v;
4. `_truncated_select`, a program a row: the draw, as the fused sampler's (`triton_sample`):
   the first kept token, in id order, whose kept mass summed from id 0 passes u times the kept
   total, u the row's hashed uniform; the block from the blocks' sums, the token from one read.

The order is by value, ties by id (a stable sort), and a row that truncates nothing draws what
the fused sampler draws. The logprob is log_softmax(logits / T) at the token, before
truncation, as SGLang reports it. tests/helpers.py states the rule in torch
(`truncated_inverse_cdf`); the CPU keeps the torch path and its exponential race. Nothing
constant a compile depends on the rows, which vary from step to step.

Speed (1×H200, bf16, Qwen3's vocabulary, every row truncating; `bench/sampler.py --truncate`):
0.4-0.8 ms at 64 rows (the host's launches), 0.5-0.9 ms at 256, against the torch path's 2.5
and 8.5; the search passes are most of it, bound by their compares where a tile holds a token
of the interval (docs/benchmarks.md, Decisions).
FlashInfer's sampling kernels (rejection sampling) are CUDA C++ compiled at run time, which the
engine does without.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlx.engine.triton_decode import sm_count
from rlx.engine.triton_sample import find_block, row_uniform

BLOCK = 1024  # logits a block: the unit of the shares and of the kept masses the draw finds
SEARCH_TILE = 256  # logits a search pass compares against its 16 keys at a time ([16, TILE])
SEARCH_WARPS = 1  # a program's warps: its sums across the tile stay within one warp
SEARCH_PER_SM = 64  # programs a row in the passes: enough one-warp programs to fill each SM


@triton.jit
def _keys(raw, valid, WIDE: tl.constexpr):
    """Integer keys in the order of the logits' values (invalid lanes below every key)."""
    if WIDE:  # fp32 logits: 32-bit keys, held in int64 so that key - 1 and the steps cannot wrap
        bits = raw.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
        return tl.where(valid, key, -(1 << 40))
    else:  # 2-byte logits (bf16, fp16)
        bits = raw.to(tl.int16, bitcast=True).to(tl.int32)
        return tl.where(valid, tl.where(bits >= 0, bits, bits ^ 0x7FFF), -(1 << 20))


@triton.jit
def _value(key, dtype: tl.constexpr, WIDE: tl.constexpr):
    """The logit whose key is `key`, in fp32."""
    bits = key.to(tl.int32)
    if WIDE:
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    else:
        return tl.where(bits >= 0, bits, bits ^ 0x7FFF).to(tl.int16).to(dtype, bitcast=True).to(tl.float32)


@triton.jit
def _tile(Logits, stride_row, row, b, inv_t, m, V, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """Block b of the row: its keys and masses exp(s - m) (ids past the vocabulary: below every
    key, mass 0)."""
    index = b * BLOCK + tl.arange(0, BLOCK)
    valid = index < V
    raw = tl.load(Logits + row.to(tl.int64) * stride_row + index, mask=valid, other=0.0)
    return _keys(raw, valid, WIDE), tl.where(valid, tl.exp(raw.to(tl.float32) * inv_t - m), 0.0)


@triton.jit
def _even_keys(below, hi, j):
    """The 16 keys a pass tests over the interval (below, hi] (`_search_pass` counts above them,
    `_next_state` picks among them): evenly spread, the last at hi, 16-fold a pass."""
    return tl.minimum(below + (j + 1) * ((hi - below + 15) // 16), hi)


@triton.jit
def _near_max_keys(below, hi, j, m, inv_t, dtype: tl.constexpr, WIDE: tl.constexpr):
    """The first pass's keys where the boundary is likely near the row's maximum: those of the
    values s = m - i^2 / 8 for i = 15 - j (28.1 down to 0.125 below the largest logit / T), the
    last at hi, in increasing order. A boundary between them leaves an interval of a few keys;
    one further down, the whole range below the first, for the even passes after it."""
    i = (15 - j).to(tl.float32)
    raw = ((m - i * i * 0.125) / inv_t).to(dtype)  # the exact offsets: one rounding each
    near = tl.minimum(tl.maximum(_keys(raw, raw == raw, WIDE), below + 1), hi)
    return tl.where(j == 15, hi, near)  # NaN or infinite m: all at one end, still in order


@triton.jit
def _store_keys(Keys, r, keys):
    tl.store(Keys + r * 16 + tl.arange(0, 16), keys.to(tl.int64))


@triton.jit
def _load_keys(Keys, r, WIDE: tl.constexpr):
    keys = tl.load(Keys + r * 16 + tl.arange(0, 16))
    return keys if WIDE else keys.to(tl.int32)


@triton.jit
def _load_state(StateI, StateF, r, q, passes, WIDE: tl.constexpr):
    """The row's m and Z, and the search after q passes: the interval (below, hi] (v's key is hi
    once hi - below is 1), the count and the mass above hi (`_next_state`)."""
    at = (r * (passes + 1) + q) * 4
    below = tl.load(StateI + at)
    hi = tl.load(StateI + at + 1)
    if not WIDE:
        below = below.to(tl.int32)
        hi = hi.to(tl.int32)
    count_hi = tl.load(StateI + at + 2).to(tl.int32)
    return tl.load(StateF + at), tl.load(StateF + at + 1), below, hi, count_hi, tl.load(StateF + at + 2)


@triton.jit
def _store_state(StateI, StateF, r, q, passes, m, z, below, hi, count_hi, mass_hi):
    at = (r * (passes + 1) + q) * 4
    tl.store(StateI + at, below.to(tl.int64))
    tl.store(StateI + at + 1, hi.to(tl.int64))
    tl.store(StateI + at + 2, count_hi.to(tl.int64))
    tl.store(StateF + at, m)
    tl.store(StateF + at + 1, z)
    tl.store(StateF + at + 2, mass_hi)


@triton.jit(do_not_specialize=["passes", "SH"])
def _start_state(
    Logits, Rows, InvT, TopK, TopP, Stats, KeyRange, StateI, StateF, Keys, passes,
    SH, SH_P2: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """State 0 from the shares' statistics: `below` under the row's smallest key fails the test
    (all V tokens above it, top_k <= V), `hi` at its largest passes it (none above); the first
    pass's keys near the maximum where the boundary likely lies there (top_k at most 1,024, or
    top_p * Z at most 64: a trained model's rows, docs/benchmarks.md), else evenly spread (a flat
    row's top-p boundary lies in the crowd), the last pass then finding its interval done."""
    r = tl.program_id(0)
    row = tl.load(Rows + r)
    inv_t = tl.load(InvT + row)
    sh = tl.arange(0, SH_P2)
    live = sh < SH
    share_max = tl.load(Stats + (r * SH + sh) * 2, mask=live, other=-float("inf"))
    share_sum = tl.load(Stats + (r * SH + sh) * 2 + 1, mask=live, other=0.0)
    m = tl.max(share_max, 0)
    z = tl.sum(tl.where(share_max == -float("inf"), 0.0, share_sum * tl.exp(share_max - m)), 0)
    if WIDE:
        floor = tl.full([SH_P2], 1 << 40, tl.int64)
    else:
        floor = tl.full([SH_P2], 1 << 20, tl.int32)
    below = tl.min(tl.load(KeyRange + (r * SH + sh) * 2, mask=live, other=floor), 0) - 1
    hi = tl.max(tl.load(KeyRange + (r * SH + sh) * 2 + 1, mask=live, other=-floor), 0)
    none = tl.full([], 0, tl.int32)
    _store_state(StateI, StateF, r, 0, passes, m, z, below, hi, none, none.to(tl.float32))
    j = tl.arange(0, 16)
    near = (tl.load(TopK + row) <= 1024) | (tl.load(TopP + row) * z <= 64.0)
    keys = tl.where(
        near, _near_max_keys(below, hi, j, m, inv_t, Logits.dtype.element_ty, WIDE), _even_keys(below, hi, j)
    )
    _store_keys(Keys, r, keys)


@triton.jit(do_not_specialize=["R", "p", "passes", "SH"])
def _next_state(
    Rows, TopK, TopP, StateI, StateF, Keys, Part, R, p, passes,
    SH, SH_P2: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """State p + 1 from state p and pass p's sums over the shares (in one order): the 16 keys'
    first that passes (fewer than top_k above, mass above at most top_p * Z) becomes `hi`, the
    key before it `below`; then pass p + 1's keys."""
    r = tl.program_id(0)
    row = tl.load(Rows + r)
    top_k = tl.load(TopK + row).to(tl.int32)
    top_p = tl.load(TopP + row)
    m, z, below, hi, count_hi, mass_hi = _load_state(StateI, StateF, r, p, passes, WIDE)
    j = tl.arange(0, 16)
    if hi - below > 1:
        sh = tl.arange(0, SH_P2)
        keys = _load_keys(Keys, r, WIDE)
        at = ((p * R + r) * SH + sh[:, None]) * 32 + j[None, :] * 2
        count = tl.sum(tl.load(Part + at, mask=(sh < SH)[:, None], other=0.0), 0)
        mass = tl.sum(tl.load(Part + at + 1, mask=(sh < SH)[:, None], other=0.0), 0)
        first = tl.min(tl.where((count < top_k) & (mass <= top_p * z), j, 15), 0)  # 15: NaN only
        new_hi = tl.sum(tl.where(j == first, keys, 0), 0)
        count_hi = tl.sum(tl.where(j == first, count, 0.0), 0).to(tl.int32)
        mass_hi = tl.sum(tl.where(j == first, mass, 0.0), 0)
        if first > 0:
            below = tl.sum(tl.where(j == first - 1, keys, 0), 0)
        hi = new_hi
    _store_state(StateI, StateF, r, p + 1, passes, m, z, below, hi, count_hi, mass_hi)
    _store_keys(Keys, r, _even_keys(below, hi, j))


@triton.jit(do_not_specialize=["SH", "SHARE"])
def _row_stats(
    Logits, stride_row, Rows, InvT, Stats, KeyRange, V,
    SH, SHARE, BLOCK: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    share = tl.program_id(1)
    row = tl.load(Rows + r)
    inv_t = tl.load(InvT + row)
    m = -float("inf")
    z = 0.0
    if WIDE:
        key_min = tl.full([], 1 << 40, tl.int64)
    else:
        key_min = tl.full([], 1 << 20, tl.int32)
    key_max = -key_min
    for b in range(share * SHARE, share * SHARE + SHARE):  # a share's first block is in the row
        index = b * BLOCK + tl.arange(0, BLOCK)
        valid = index < V
        raw = tl.load(Logits + row.to(tl.int64) * stride_row + index, mask=valid, other=0.0)
        s = tl.where(valid, raw.to(tl.float32) * inv_t, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, 0))
        z = z * tl.exp(m - m_new) + tl.sum(tl.exp(s - m_new), 0)
        m = m_new
        key = _keys(raw, valid, WIDE)
        key_min = tl.minimum(key_min, tl.min(tl.where(valid, key, key_min), 0))
        key_max = tl.maximum(key_max, tl.max(key, 0))
    tl.store(Stats + (r * SH + share) * 2, m)
    tl.store(Stats + (r * SH + share) * 2 + 1, z)
    tl.store(KeyRange + (r * SH + share) * 2, key_min)
    tl.store(KeyRange + (r * SH + share) * 2 + 1, key_max)


@triton.jit(do_not_specialize=["R", "p", "passes", "SH", "SHARE"])
def _search_pass(
    Logits, stride_row, Rows, InvT, StateI, StateF, Keys, Part, R, V, p, passes,
    SH, SHARE, BLOCK: tl.constexpr, WIDE: tl.constexpr, TILE: tl.constexpr, SUMS: tl.constexpr,
):  # fmt: skip
    """Pass p: the share's count and mass above each of the 16 keys (Part[p, r, share]), TILE
    logits at a time, the count where SUMS has bit 1 (a row with top_k), the mass where it has
    bit 2 (top_p), else 0; a tile with no logit in (the lowest key, hi] (none above any key that
    is not above all) counts the tokens above hi once for all 16 and skips the compares."""
    r = tl.program_id(0)
    share = tl.program_id(1)
    row = tl.load(Rows + r)
    inv_t = tl.load(InvT + row)
    m, z, below, hi, count_hi, mass_hi = _load_state(StateI, StateF, r, p, passes, WIDE)
    j = tl.arange(0, 16)
    keys = _load_keys(Keys, r, WIDE)
    lowest = tl.min(keys, 0)
    count = tl.zeros([16], tl.int32)
    mass = tl.zeros([16], tl.float32)
    count_top = tl.zeros([TILE], tl.int32)
    mass_top = tl.zeros([TILE], tl.float32)
    if (SUMS != 0) & (hi - below > 1):  # else v is found (or nothing is counted): nothing to do
        for b in range(share * SHARE * (BLOCK // TILE), (share * SHARE + SHARE) * (BLOCK // TILE)):
            key, e = _tile(Logits, stride_row, row, b, inv_t, m, V, TILE, WIDE)
            if tl.max(((key > lowest) & (key <= hi)).to(tl.int32), 0) > 0:
                above = key[None, :] > keys[:, None]  # tokens above hi: above all 16
                if SUMS & 1:
                    count += tl.sum(above.to(tl.int32), 1)
                if SUMS & 2:
                    mass += tl.sum(tl.where(above, e[None, :], 0.0), 1)
            else:
                top = key > hi
                if SUMS & 1:
                    count_top += top.to(tl.int32)
                if SUMS & 2:
                    mass_top += tl.where(top, e, 0.0)
    at = ((p * R + r) * SH + share) * 32 + j * 2
    tl.store(Part + at, (count + tl.sum(count_top, 0)).to(tl.float32))  # exact below 2^24
    tl.store(Part + at + 1, mass + tl.sum(mass_top, 0))


@triton.jit
def _ties_taken(
    hi, ties, count_hi, mass_hi, z, m, inv_t, top_k, top_p, min_p, dtype: tl.constexpr, WIDE: tl.constexpr
):  # fmt: skip
    """Of the `ties` at v (key hi), how many are kept (as many as top_k and top_p leave room for,
    each holding mass e_v; none if min_p cuts them), and e_v. count_hi and mass_hi (above v) are
    0 where the passes did not count them (`SUMS`): no row of the batch has that bound then."""
    e_v = tl.exp(_value(hi, dtype, WIDE) * inv_t - m)
    take = tl.minimum(ties, top_k - count_hi)
    room = (top_p * z - mass_hi) / e_v  # >= 0: v passed; e_v = 0 (underflow) gives inf
    fits = room < take.to(tl.float32)  # top_p leaves room for fewer ties than top_k
    take = tl.where(fits, tl.where(fits, room, 0.0).to(tl.int32) + 1, take)  # NaN, inf: not cast
    return tl.where(e_v >= min_p, take, 0), e_v


@triton.jit(do_not_specialize=["passes", "SHARE"])
def _kept_blocks(
    Logits, stride_row, Rows, InvT, MinP, StateI, StateF, Blocks, V, passes,
    NB: tl.constexpr, SHARE, BLOCK: tl.constexpr, WIDE: tl.constexpr,
):  # fmt: skip
    """Each block's kept mass above v and its count of ties at v (Blocks[r, b])."""
    r = tl.program_id(0)
    share = tl.program_id(1)
    row = tl.load(Rows + r)
    inv_t = tl.load(InvT + row)
    min_p = tl.load(MinP + row)
    m, z, below, hi, count_hi, mass_hi = _load_state(StateI, StateF, r, passes, passes, WIDE)
    for b in range(share * SHARE, tl.minimum(share * SHARE + SHARE, NB)):
        key, e = _tile(Logits, stride_row, row, b, inv_t, m, V, BLOCK, WIDE)
        tl.store(Blocks + (r * NB + b) * 2, tl.sum(tl.where((key > hi) & (e >= min_p), e, 0.0), 0))
        tl.store(Blocks + (r * NB + b) * 2 + 1, tl.sum((key == hi).to(tl.float32), 0))


@triton.jit(do_not_specialize=["passes"])
def _truncated_select(
    Logits, stride_row, Rows, InvT, TopK, TopP, MinP, Seed, Step, StateI, StateF,
    Blocks, Tokens, Logprobs, V, passes, NB: tl.constexpr, NB_P2: tl.constexpr, BLOCK: tl.constexpr,
    WIDE: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    row = tl.load(Rows + r)
    inv_t = tl.load(InvT + row)
    top_k = tl.load(TopK + row).to(tl.int32)
    top_p = tl.load(TopP + row)
    min_p = tl.load(MinP + row)
    seed = tl.load(Seed + row).to(tl.uint64)
    step = tl.load(Step + row).to(tl.uint64)
    k = tl.arange(0, NB_P2)
    above = tl.load(Blocks + (r * NB + k) * 2, mask=k < NB, other=0.0)
    ties = tl.load(Blocks + (r * NB + k) * 2 + 1, mask=k < NB, other=0.0).to(tl.int32)
    m, z, below, hi, count_hi, mass_hi = _load_state(StateI, StateF, r, passes, passes, WIDE)
    take, e_v = _ties_taken(  # of the ties, counted in the blocks (the passes may not count)
        hi, tl.sum(ties, 0), count_hi, mass_hi, z, m, inv_t, top_k, top_p, min_p, Logits.dtype.element_ty, WIDE
    )  # fmt: skip
    ties_before = tl.cumsum(ties, 0) - ties
    taken = tl.minimum(tl.maximum(take - ties_before, 0), ties)  # the block's ties that are kept
    mass = above + taken.to(tl.float32) * e_v
    target = row_uniform(seed, step) * tl.sum(mass, 0)
    block, before = find_block(mass, target, k, NB_P2)
    tie_rank_start = tl.sum(tl.where(k == block, ties_before, 0), 0)
    key, e = _tile(Logits, stride_row, row, block, inv_t, m, V, BLOCK, WIDE)
    index = block * BLOCK + tl.arange(0, BLOCK)
    tie = key == hi
    rank = tie_rank_start + tl.cumsum(tie.to(tl.int32), 0) - 1
    keep = ((key > hi) | (tie & (rank < take))) & (e >= min_p)
    w = tl.where(keep, e, 0.0)
    found = tl.min(tl.where(keep & (before + tl.cumsum(w, 0) > target), index, V), 0)
    token = tl.minimum(found, tl.max(tl.where(keep & (w > 0), index, -1), 0))
    token = tl.minimum(tl.maximum(token, 0), V - 1)  # NaN logits keep nothing: an id in bounds
    x_token = tl.load(Logits + row.to(tl.int64) * stride_row + token).to(tl.float32) * inv_t
    tl.store(Tokens + row, token.to(Tokens.dtype.element_ty))
    tl.store(Logprobs + row, x_token - m - tl.log(z))


def default_shares(rows: int, device: torch.device, blocks: int) -> int:
    """Programs a row in the passes: about SEARCH_PER_SM an SM."""
    return max(1, min(blocks, triton.cdiv(SEARCH_PER_SM * sm_count(device), rows)))


def truncated_sample(
    logits_NV: torch.Tensor,
    rows_R: torch.Tensor,
    inv_temperature_N: torch.Tensor,
    top_k_N: torch.Tensor,
    top_p_N: torch.Tensor,
    min_p_N: torch.Tensor,
    seed_N: torch.Tensor,
    step_N: torch.Tensor,
    tokens_N: torch.Tensor,
    logprobs_N: torch.Tensor,
    shares: int | None = None,
    sums: int = 3,
) -> None:
    """Draw rows `rows_R` (ids into the N rows) by top-k (int, the vocabulary where off), top-p
    and min-p, writing their tokens and logprobs into tokens_N / logprobs_N (tokens in int64, or
    in fp32 for one readback buffer); the other rows are left as they are. The per-row tensors
    are indexed by row id, as `SamplingBatch`'s; seed and step key the row's uniform. `shares`:
    programs a row in the passes (None: `default_shares`); the draws do not depend on it. `sums`:
    what the search passes count, 1 the tokens (some row has top_k), 2 their mass (some row has
    top_p), 3 both (the default, right for any rows), 0 neither (min_p alone: the search then
    keeps every token, which min_p cuts); a pass computes 2-4 values a logit and key for 4."""
    vocab = logits_NV.shape[1]
    rows = rows_R.numel()
    if rows == 0:
        return
    assert tokens_N.is_contiguous() and logprobs_N.is_contiguous()
    assert logits_NV.stride(1) == 1 and logits_NV.element_size() in (2, 4), "rows of 2- or 4-byte logits"
    wide = logits_NV.element_size() == 4
    passes = 1 + (8 if wide else 4)  # near the maximum, then 16-fold a pass over 32- or 16-bit keys
    blocks = triton.cdiv(vocab, BLOCK)
    share = triton.cdiv(blocks, shares or default_shares(rows, logits_NV.device, blocks))
    sh = triton.cdiv(blocks, share)
    device = logits_NV.device
    stats = torch.empty(rows, sh, 2, dtype=torch.float32, device=device)
    key_range = torch.empty(rows, sh, 2, dtype=torch.int64 if wide else torch.int32, device=device)
    state_i = torch.empty(rows, passes + 1, 4, dtype=torch.int64, device=device)
    state_f = torch.empty(rows, passes + 1, 4, dtype=torch.float32, device=device)
    keys = torch.empty(rows, 16, dtype=torch.int64, device=device)  # the pass's, rewritten each
    part = torch.empty(passes, rows, sh, 16, 2, dtype=torch.float32, device=device)
    kept = torch.empty(rows, blocks, 2, dtype=torch.float32, device=device)
    at = rows_R.contiguous()
    inv_t, top_k, top_p, min_p, seed, step = (
        t.contiguous() for t in (inv_temperature_N, top_k_N, top_p_N, min_p_N, seed_N, step_N)
    )
    logits, stride, state = logits_NV, logits_NV.stride(0), (state_i, state_f)
    _row_stats[(rows, sh)](
        logits, stride, at, inv_t, stats, key_range, vocab, SH=sh, SHARE=share, BLOCK=BLOCK, WIDE=wide
    )
    shares_p2 = triton.next_power_of_2(blocks)  # the vocabulary's alone: rows (and so the
    # shares) vary from step to step, and every constant a compile
    _start_state[(rows,)](
        logits, at, inv_t, top_k, top_p, stats, key_range, *state, keys, passes,
        SH=sh, SH_P2=shares_p2, WIDE=wide, num_warps=1,
    )  # fmt: skip
    for p in range(passes):
        _search_pass[(rows, sh)](
            logits, stride, at, inv_t, *state, keys, part, rows, vocab, p, passes,
            SH=sh, SHARE=share, BLOCK=BLOCK, WIDE=wide, TILE=SEARCH_TILE, SUMS=sums, num_warps=SEARCH_WARPS,
        )  # fmt: skip
        _next_state[(rows,)](
            at, top_k, top_p, *state, keys, part, rows, p, passes,
            SH=sh, SH_P2=shares_p2, WIDE=wide, num_warps=1,
        )  # fmt: skip
    _kept_blocks[(rows, sh)](
        logits, stride, at, inv_t, min_p, *state, kept, vocab, passes, NB=blocks, SHARE=share, BLOCK=BLOCK, WIDE=wide
    )  # fmt: skip
    _truncated_select[(rows,)](
        logits, stride, at, inv_t, top_k, top_p, min_p, seed, step, *state, kept, tokens_N, logprobs_N,
        vocab, passes, NB=blocks, NB_P2=triton.next_power_of_2(blocks), BLOCK=BLOCK, WIDE=wide, num_warps=8,
    )  # fmt: skip
