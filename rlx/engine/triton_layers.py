"""Fused Triton kernels for a decoder layer's small operations (CUDA only).

Profiling a Qwen3-0.6B decode step at batch 256 (bench/engine_step_profile.py, docs/benchmarks.md)
showed about 1,300 small elementwise kernels per step (RMSNorm as cast / pow / mean / rsqrt /
mul / cast / mul, rotary as index / cast / chunk / neg / cat / mul / add, the KV write as index_put,
SiLU and the gate product, residual adds), ~3 ms of an ~8 ms graph although they move almost no
bytes. Here each group is one kernel:

- `add_rms_norm`: residual add (rounded to the activation dtype, as `x + h` is) and RMSNorm;
- `qk_norm_rope_store`: per-head q/k RMSNorm (Qwen3), rotary (non-interleaved, full head dim),
  and the store of this step's K and V into their paged-cache slots;
- `silu_mul`: silu(gate) * up.

Each intermediate is cast to the activation dtype where the torch modules round it
(`layers.py`), but on the GPU Triton folds a cast to bf16 and straight back to fp32, so some
intermediates keep fp32: measured on `qk_norm_rope_store` (H200, 2026-11-28), 22% of its bf16
outputs differ from the modules' by a rounding, none further from the fp32 result than theirs
(tests/kernels/test_engine_kernels.py); fp32 runs match the modules up to reduction order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlx.engine.pdl import pdl_launch, pdl_prologue


@triton.jit
def _add_rms_norm_kernel(
    X, R, W, Out, ResOut, stride_x, stride_r, stride_o, stride_split, N, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, SPLIT: tl.constexpr = 1, PDL: tl.constexpr = 0,
):  # fmt: skip
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    # the weight first, beside x's load: read after the reduction, it was issued only once x had
    # arrived (in-order issue; nor may the compiler move it above the residual's store, which it
    # could alias, or the reduction's barrier). Before the PDL wait, where a kernel ahead lets it
    # start early: no kernel of a forward writes a weight, and a reload's writes precede the
    # forward's first kernel (a plain launch). 1.7B decode step at 64 rows 2.278 -> 2.242 ms
    # (docs/benchmarks.md, Decisions, PDL)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    dt = ResOut.dtype.element_ty
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if SPLIT > 1:  # X holds a product's SPLIT fp32 partials: their sum, rounded as the GEMM's output
        for part in tl.static_range(1, SPLIT):
            x += tl.load(X + part * stride_split + row * stride_x + cols, mask=mask, other=0.0)
        x = x.to(dt)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(ResOut + row * stride_o + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * inv).to(dt).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (w * y).to(Out.dtype.element_ty), mask=mask)


def add_rms_norm(
    h: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + h) * weight, residual + h) for 2-D [T, N]; h None: no add. h may be
    3-D [S, T, N]: a product's S fp32 partials (`triton_gemm.small_gemm` split), summed and
    rounded to residual's dtype first."""
    rows, n = residual.shape
    out = torch.empty_like(residual)
    new_residual = torch.empty_like(residual) if h is not None else residual
    x, r = (h, residual) if h is not None else (residual, residual)
    split = x.shape[0] if x.dim() == 3 else 1
    _add_rms_norm_kernel[(rows,)](
        x, r, weight, out, new_residual, x.stride(-2), r.stride(0), out.stride(0), x.stride(0), n, eps,
        HAS_RES=h is not None, BLOCK=triton.next_power_of_2(n), SPLIT=split, num_warps=4,
        **pdl_launch(x.device),
    )  # fmt: skip
    return out, new_residual


@triton.jit
def _load_heads(Base, ROWS: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr):
    """A token's heads [ROWS, D] at Base (head stride D) as their two halves [BLOCK_R, D / 2]."""
    HALF: tl.constexpr = D // 2
    r = tl.arange(0, BLOCK_R)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = r < ROWS
    x1 = tl.load(Base + r * D + d, mask=mask, other=0.0)
    return x1, tl.load(Base + r * D + HALF + d, mask=mask, other=0.0)


@triton.jit
def _norm_rope_heads(
    Base, x1, x2, w1, w2, cos1, cos2, sin1, sin2, eps,
    ROWS: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    """Heads x1, x2 (`_load_heads` of Base) normalised (Qwen3's per-head RMSNorm with weight
    halves w1, w2, cast where the torch module rounds: see the module's docstring) and rotated
    (non-interleaved), stored back at Base; returns the rotated halves for the KV store."""
    HALF: tl.constexpr = D // 2
    r = tl.arange(0, BLOCK_R)[:, None]
    d = tl.arange(0, HALF)[None, :]
    mask = r < ROWS
    dt = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        inv = 1.0 / tl.sqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / D + eps)
        f1 = (w1 * (f1 * inv[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        f2 = (w2 * (f2 * inv[:, None]).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # rot * cos + cat(-x2, x1) * sin, each product and the sum cast to the dtype
    o1 = ((f1 * cos1).to(dt).to(tl.float32) + (-f2 * sin1).to(dt).to(tl.float32)).to(dt)
    o2 = ((f2 * cos2).to(dt).to(tl.float32) + (f1 * sin2).to(dt).to(tl.float32)).to(dt)
    tl.store(Base + r * D + d, o1, mask=mask)
    tl.store(Base + r * D + HALF + d, o2, mask=mask)
    return o1, o2


@triton.jit
def _qk_norm_rope_store_kernel(
    Q, K, V, QW, KW, Cos, Sin, Pos, SlotBlock, SlotOffset, KCache, VCache,
    stride_qt, stride_kt, stride_vt, stride_cos, stride_cb, stride_ch, eps,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    """One program a (token, KV head): the head's q group, its k and its v (a program a head
    spent more time loading its token's position, cos/sin and slot than on the head; timings in
    docs/benchmarks.md, Decisions). Every load is issued before the first store, in two rounds
    (what the position picks in the second): a warp issues in order, and a load written after a
    store it may alias waits for the loads before it (bench/kernel_ptx.py). The norms' weights
    before the PDL wait, as `_add_rms_norm_kernel`'s."""
    token = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)[None, :]
    dt = Q.dtype.element_ty
    if HAS_NORM:
        qw1 = tl.load(QW + d).to(tl.float32)
        qw2 = tl.load(QW + HALF + d).to(tl.float32)
        kw1 = tl.load(KW + d).to(tl.float32)
        kw2 = tl.load(KW + HALF + d).to(tl.float32)
    else:  # unused
        qw1 = tl.zeros([1, HALF], tl.float32)
        qw2 = qw1
        kw1 = qw1
        kw2 = qw1
    pdl_prologue(PDL)
    pos = tl.load(Pos + token)
    slot_block = tl.load(SlotBlock + token)
    slot_offset = tl.load(SlotOffset + token)
    q = Q + token * stride_qt + kv_head * GROUP * D
    q1, q2 = _load_heads(q, GROUP, BLOCK_G, D)
    k = K + token * stride_kt + kv_head * D
    k1, k2 = _load_heads(k, 1, 1, D)
    full = tl.arange(0, D)
    v = tl.load(V + token * stride_vt + kv_head * D + full)
    cos1 = tl.load(Cos + pos * stride_cos + d).to(dt).to(tl.float32)
    cos2 = tl.load(Cos + pos * stride_cos + HALF + d).to(dt).to(tl.float32)
    sin1 = tl.load(Sin + pos * stride_cos + d).to(dt).to(tl.float32)
    sin2 = tl.load(Sin + pos * stride_cos + HALF + d).to(dt).to(tl.float32)
    _norm_rope_heads(q, q1, q2, qw1, qw2, cos1, cos2, sin1, sin2, eps, GROUP, BLOCK_G, D, HAS_NORM)
    k1, k2 = _norm_rope_heads(k, k1, k2, kw1, kw2, cos1, cos2, sin1, sin2, eps, 1, 1, D, HAS_NORM)
    slot = slot_block * stride_cb + slot_offset * D + kv_head * stride_ch
    kt = KCache.dtype.element_ty  # an fp8 cache rounds them (`kv_cache_dtype`)
    tl.store(KCache + slot + d, k1.to(kt))
    tl.store(KCache + slot + HALF + d, k2.to(kt))
    tl.store(VCache + slot + full, v.to(kt))


def qk_norm_rope_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    norms: tuple[torch.Tensor, torch.Tensor] | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    kv: tuple[torch.Tensor, torch.Tensor],
    meta,
) -> None:
    """In place on q [T, H, D] and k [T, Hkv, D] (views with unit head-dim stride, heads D apart):
    optional q/k RMSNorm, rotary over the whole head dim; then k and v into the cache at the
    step's slots."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    assert q.stride(1) == k.stride(1) == v.stride(1) == dim and q.stride(2) == 1, "heads D apart"
    k_cache, v_cache = kv
    q_weight, k_weight = norms if norms is not None else (q, q)  # unused without norms
    group = heads // kv_heads
    _qk_norm_rope_store_kernel[(tokens, kv_heads)](
        q, k, v, q_weight, k_weight, cos, sin, positions, meta.slot_block, meta.slot_offset,
        k_cache, v_cache, q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), eps,
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), D=dim, HAS_NORM=norms is not None,
        num_warps=1, **pdl_launch(q.device),
    )  # fmt: skip


@triton.jit
def _silu_mul_kernel(G, U, Out, stride_g, stride_u, N, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * N + cols, (s * u).to(Out.dtype.element_ty), mask=mask)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for 2-D [T, N] (rows may be strided views)."""
    rows, n = gate.shape
    out = torch.empty(rows, n, dtype=gate.dtype, device=gate.device)
    block = 1024
    _silu_mul_kernel[(rows, triton.cdiv(n, block))](
        gate, up, out, gate.stride(0), up.stride(0), n, BLOCK=block, num_warps=4, **pdl_launch(gate.device)
    )
    return out
