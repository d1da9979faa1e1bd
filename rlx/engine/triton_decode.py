"""Triton paged decode attention (CUDA only; imported when a decode runs on the GPU).

One program per (sequence, kv head, split): it loads the GQA group's queries once, streams its
share of the sequence's K/V blocks BLOCK_N tokens at a time through the block table, and keeps
an online softmax in fp32, so each K/V byte is read exactly once per step. The group's queries
are padded to 16 rows for tl.dot; decode is bound by memory, so the idle rows cost nothing.
An fp8 cache's tiles are widened as they arrive (half the bytes read; `paged_decode` says to what).
With many rows a program takes several KV heads of its sequence (HEADS): a tile holds each head's
BLOCK_N tokens side by side (a page's heads lie next to each other in the cache, so a tile is a
few long reads) and a mask keeps each query to its own head's keys; fewer, longer programs pay
their pipelines' fill and drain fewer times (`launch_settings`).

With few rows (rows x kv heads well under the GPU's SMs) one program per sequence leaves most
SMs idle: the context is then split into `num_splits` shares (flash-decoding), each program
writes its share's normalised output and log-sum-exp in fp32, and a second kernel merges them.
The split count depends on the rows alone, so a CUDA graph captured for a batch size keeps it
while the contexts grow; a share past a short context is empty and merges with weight 0.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from rlx.engine.pdl import pdl_launch, pdl_prologue


@triton.jit
def attend_tile(q, k, v, keep, m_i, l_i, acc, scale, IEEE: tl.constexpr):
    """A tile of keys k and values v [BLOCK_N, D] into the online softmax of the queries q
    [BLOCK_G, D], each query attending the keys `keep` marks ([1 or BLOCK_G, BLOCK_N]): returns
    the running max, sum and output (fp32), updated. A query's first tile must hold a key it
    keeps: a masked row while its max is still -inf gives NaN."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def group_queries(
    Q, row, kv_head, stride_qt, stride_qh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr
):
    """The queries [BLOCK_G, D] of `row`'s heads in KV head `kv_head`'s group (rows past GROUP
    zero, padding the group for tl.dot), and their head indices."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kv_head * GROUP + g
    q = tl.load(
        Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None], other=0.0
    )
    return q, heads


@triton.jit
def store_output(
    Out, Part, Lse, row, split, heads, m_i, l_i, acc, stride_ot, stride_oh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    """A program's online-softmax result: the output itself with one share, else the share's
    normalised output and log-sum-exp (fp32; Part [rows, heads, splits, D], Lse [rows, heads,
    splits], contiguous) for `_merge_splits_kernel`; an empty share gets weight 0."""
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    q_mask = (g < GROUP)[:, None]
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            Out + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=q_mask,
        )
    else:
        nonempty = l_i > 0
        l_safe = tl.where(nonempty, l_i, 1.0)
        out = acc / l_safe[:, None]
        lse = tl.where(nonempty, m_i + tl.log(l_safe), float("-inf"))
        at = (row * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
        tl.store(Part + at[:, None] * D + d[None, :], out, mask=q_mask)
        tl.store(Lse + at, lse, mask=g < GROUP)


@triton.jit
def _paged_decode_kernel(
    Q, K, V, Out, Part, Lse, BT, CL, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_kb, stride_kh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr, NUM_SPLITS: tl.constexpr, WIDEN: tl.constexpr = 0,
    PDL: tl.constexpr = 0, HEADS: tl.constexpr = 1,
):  # fmt: skip
    pdl_prologue(PDL)
    row = tl.program_id(0)
    kv_head = tl.program_id(1)  # the program's first KV head is kv_head * HEADS
    split = tl.program_id(2)
    context_len = tl.load(CL + row)
    if NUM_SPLITS == 1:
        lo, hi = 0, context_len
    else:  # shares of whole BLOCK_N tiles, so that only the last tile of a row is partial
        share = tl.cdiv(tl.cdiv(context_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * share
        hi = tl.minimum(lo + share, context_len)
    q, heads = group_queries(Q, row, kv_head, stride_qt, stride_qh, GROUP * HEADS, BLOCK_G, D)
    if WIDEN == 1:  # an fp8 cache beside 2-byte queries: the dots in fp16 (see `paged_decode`)
        q = q.to(tl.float16)
    d = tl.arange(0, D)
    # a tile's keys: BLOCK_N tokens of each of the HEADS heads, side by side (a page's heads are
    # contiguous in the cache); each query keeps its own head's (a padded query row every head's:
    # finite, never stored)
    if HEADS > 1:
        column = tl.arange(0, HEADS * BLOCK_N)
        key_head, token = column // BLOCK_N, column % BLOCK_N
        own = (tl.arange(0, BLOCK_G) // GROUP)[:, None]
        own_head = (own == key_head[None, :]) | (own >= HEADS)
    else:
        key_head, token = 0, tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        n = start + token
        valid = n < hi
        page = tl.load(BT + row * stride_bt + n // PAGE, mask=valid, other=0).to(tl.int64)
        offset = page * stride_kb + (kv_head * HEADS + key_head) * stride_kh + (n % PAGE) * D
        k = tl.load(K + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if WIDEN != 0:  # to the queries' dtype (fp16 already with WIDEN 1)
            k, v = k.to(q.dtype), v.to(q.dtype)
        if HEADS > 1:
            keep = valid[None, :] & own_head
        else:
            keep = valid[None, :]
        m_i, l_i, acc = attend_tile(q, k, v, keep, m_i, l_i, acc, scale, IEEE)
    store_output(
        Out, Part, Lse, row, split, heads, m_i, l_i, acc, stride_ot, stride_oh, GROUP * HEADS, BLOCK_G, D,
        NUM_SPLITS,
    )  # fmt: skip


@triton.jit
def _merge_splits_kernel(
    Part, Lse, Out, stride_ot, stride_oh, D: tl.constexpr, NUM_SPLITS: tl.constexpr, PDL: tl.constexpr = 0
):
    """Out[row, head] = sum_s w_s Part[row, head, s] with w = softmax over the shares' lse."""
    pdl_prologue(PDL)
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, D)
    at = (row * tl.num_programs(1) + head) * NUM_SPLITS + s
    lse = tl.load(Lse + at)  # share 0 is never empty (context_len >= 1), so the max is finite
    w = tl.exp(lse - tl.max(lse, 0))
    part = tl.load(Part + at[:, None] * D + d[None, :])
    out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
    tl.store(Out + row * stride_ot + head * stride_oh + d, out.to(Out.dtype.element_ty))


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def sm_count(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device (the Triton kernels size their grids by it);
    1 elsewhere: Triton's CPU interpreter (tests/kernels) runs one program at a time."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def default_splits(rows: int, num_kv_heads: int, device: torch.device, per_sm: int = 2) -> int:
    """Shares per sequence: enough programs for about `per_sm` per SM, at most 8 (a power of 2).
    Depends on the row count alone (the CUDA graphs capture it per batch size)."""
    programs = rows * num_kv_heads
    target = per_sm * sm_count(device)
    splits = 1
    while splits < 8 and programs * splits < target:
        splits *= 2
    return splits


def launch_settings(
    rows: int, num_kv_heads: int, kv_bytes: int, device: torch.device, head_dim: int = 128
) -> dict:
    """The decode kernel's tile (`block_n` tokens), pipeline stages and context shares, by the
    rows alone (a CUDA graph keeps them while the contexts grow) and the cache's element size.
    2 bytes: 64-token tiles, 4 stages, shares below two programs an SM (fp32: 2 stages, its
    tiles twice as big). One byte (an fp8 cache), on sm90+: 5 stages; 128-token tiles (a bf16
    tile's bytes) up to four programs an SM, 64 beyond; shares below one program an SM (heads
    of more than 128 dimensions: the 2-byte settings, whose shared memory they fill). 1xH200,
    2026-11-29 (docs/benchmarks.md, Decisions): at batch 64 the one-byte tiles took 38.2 us a layer
    at context 520 against the bf16 settings' 48.3 (the bf16 cache 38.3); at 128-256 rows
    64-token tiles won up to context 520 and lost at 1,024 (228 against 208 us at 256 rows).
    2 bytes on sm90 from 15 (sequence, KV head) pairs an SM, KV heads in fours: four heads a
    program, 16-token tiles, 2 stages: at 256 rows 3.79 -> 4.11 TB/s of KV at context 300, 3.92
    -> 4.25 at 520, 4.31 -> 4.37 at 1,024; at 128 rows within -3 to +2% (1xH200, 2026-11-30)."""
    settings = {"block_n": 64, "num_stages": 4 if kv_bytes <= 2 else 2}
    sm90 = device.type == "cuda" and _sm90(
        device.index if device.index is not None else torch.cuda.current_device()
    )
    one_byte = kv_bytes == 1 and head_dim <= 128 and sm90
    if one_byte:  # measured on sm90; elsewhere (sm80's smaller shared memory) the 2-byte settings
        programs = rows * num_kv_heads
        settings = {"block_n": 128 if programs <= 4 * sm_count(device) else 64, "num_stages": 5}
    settings["num_splits"] = default_splits(rows, num_kv_heads, device, per_sm=1 if one_byte else 2)
    settings["heads_per_program"] = 1
    if sm90 and kv_bytes == 2 and num_kv_heads % 4 == 0 and rows * num_kv_heads >= 15 * sm_count(device):
        # many rows: four heads' 16-token tiles a program, 2 stages (measured on sm90)
        settings.update(block_n=16, num_stages=2, heads_per_program=4)
    return settings


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    num_splits: int | None = None,
    heads_per_program: int | None = None,
) -> torch.Tensor:
    """q [rows, heads, D]; caches [blocks, kv_heads, page, D]; every row has context_len >= 1.
    The launch settings are arguments so that the benches can sweep them; None chooses
    (`launch_settings`)."""
    rows, num_heads, head_dim = q.shape
    _, num_kv_heads, page, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided view
    chosen = launch_settings(rows, num_kv_heads, k_cache.element_size(), q.device, head_dim)
    block_n = chosen["block_n"] if block_n is None else block_n
    num_stages = chosen["num_stages"] if num_stages is None else num_stages
    num_splits = chosen["num_splits"] if num_splits is None else num_splits
    per_program = chosen["heads_per_program"] if heads_per_program is None else heads_per_program
    assert per_program & (per_program - 1) == 0 and num_kv_heads % per_program == 0, (
        f"{num_kv_heads} KV heads in programs of {per_program} (a power of 2 dividing them)"
    )
    assert num_splits & (num_splits - 1) == 0, f"num_splits={num_splits} must be a power of 2"
    if num_splits > 1:
        part = torch.empty(rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # unused
    # an fp8 cache's tiles are widened as they arrive: to fp16 beside 2-byte queries (the GPU
    # converts fp8 to fp16 in one instruction a pair, to bf16 through fp32: 1.2-1.65 -> 1.3-1.9
    # TB/s of one-byte reads), the queries cast to fp16 with them (exact for bf16 magnitudes
    # within fp16's normal range, 6e-5 to 65,504); to the queries' dtype otherwise (fp32, or a
    # bf16 cache beside fp16 queries)
    fp8_beside_half = k_cache.element_size() == 1 and q.element_size() == 2
    widen = 0 if k_cache.dtype == q.dtype else 1 if fp8_beside_half else 2
    pdl = pdl_launch(q.device)
    _paged_decode_kernel[(rows, num_kv_heads // per_program, num_splits)](
        q, k_cache, v_cache, out, part, lse, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group * per_program)), D=head_dim, PAGE=page,
        BLOCK_N=block_n, IEEE=q.dtype == torch.float32, NUM_SPLITS=num_splits, WIDEN=widen,
        HEADS=per_program, num_warps=num_warps, num_stages=num_stages, **pdl,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(rows, num_heads)](
            part, lse, out, out.stride(0), out.stride(1), D=head_dim, NUM_SPLITS=num_splits, **pdl
        )
    return out
