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

Every intermediate is rounded to the activation dtype where the torch modules round it
(`layers.py`), so bf16 results match the unfused modules up to fp32 reduction order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(
    X, R, W, Out, ResOut, stride_x, stride_r, stride_o, N, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + row * stride_o + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    y = (xf * inv).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Out + row * stride_o + cols, (w * y).to(Out.dtype.element_ty), mask=mask)


def add_rms_norm(
    h: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + h) * weight, residual + h) for 2-D [T, N]; h None: no add."""
    rows, n = residual.shape
    out = torch.empty_like(residual)
    new_residual = torch.empty_like(residual) if h is not None else residual
    x, r = (h, residual) if h is not None else (residual, residual)
    _add_rms_norm_kernel[(rows,)](
        x, r, weight, out, new_residual, x.stride(0), r.stride(0), out.stride(0), n, eps,
        HAS_RES=h is not None, BLOCK=triton.next_power_of_2(n), num_warps=4,
    )  # fmt: skip
    return out, new_residual


@triton.jit
def _rms_half(x1, x2, W, eps, D: tl.constexpr, HALF: tl.constexpr):
    """RMSNorm of a head split in halves, rounded as the torch module rounds."""
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    inv = 1.0 / tl.sqrt((tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0)) / D + eps)
    d = tl.arange(0, HALF)
    y1 = (f1 * inv).to(x1.dtype).to(tl.float32)
    y2 = (f2 * inv).to(x1.dtype).to(tl.float32)
    w1 = tl.load(W + d).to(tl.float32)
    w2 = tl.load(W + HALF + d).to(tl.float32)
    return (w1 * y1).to(x1.dtype), (w2 * y2).to(x1.dtype)


@triton.jit
def _qk_norm_rope_store_kernel(
    Q, K, V, QW, KW, Cos, Sin, Pos, SlotBlock, SlotOffset, KCache, VCache,
    stride_qt, stride_kt, stride_vt, stride_cos, stride_cb, stride_ch, eps,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)
    slot = tl.load(SlotBlock + token) * stride_cb + tl.load(SlotOffset + token) * D
    if head >= H + HKV:  # V: stored as it is
        vh = head - H - HKV
        v = tl.load(V + token * stride_vt + vh * D + tl.arange(0, D))
        tl.store(VCache + slot + vh * stride_ch + tl.arange(0, D), v)
    else:
        is_q = head < H
        if is_q:
            base = Q + token * stride_qt + head * D
        else:
            base = K + token * stride_kt + (head - H) * D
        x1 = tl.load(base + d)
        x2 = tl.load(base + HALF + d)
        if HAS_NORM:
            if is_q:
                x1, x2 = _rms_half(x1, x2, QW, eps, D, HALF)
            else:
                x1, x2 = _rms_half(x1, x2, KW, eps, D, HALF)
        pos = tl.load(Pos + token)
        dt = x1.dtype
        c1 = tl.load(Cos + pos * stride_cos + d).to(dt).to(tl.float32)
        c2 = tl.load(Cos + pos * stride_cos + HALF + d).to(dt).to(tl.float32)
        s1 = tl.load(Sin + pos * stride_cos + d).to(dt).to(tl.float32)
        s2 = tl.load(Sin + pos * stride_cos + HALF + d).to(dt).to(tl.float32)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        # rot * cos + cat(-x2, x1) * sin, each product and the sum rounded to the dtype
        o1 = ((f1 * c1).to(dt).to(tl.float32) + (-f2 * s1).to(dt).to(tl.float32)).to(dt)
        o2 = ((f2 * c2).to(dt).to(tl.float32) + (f1 * s2).to(dt).to(tl.float32)).to(dt)
        tl.store(base + d, o1)
        tl.store(base + HALF + d, o2)
        if not is_q:
            kh = head - H
            tl.store(KCache + slot + kh * stride_ch + d, o1)
            tl.store(KCache + slot + kh * stride_ch + HALF + d, o2)


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
    """In place on q [T, H, D] and k [T, Hkv, D] (views with a unit last stride): optional
    q/k RMSNorm, rotary over the whole head dim; then k and v into the cache at the step's slots."""
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    k_cache, v_cache = kv
    q_weight, k_weight = norms if norms is not None else (q, q)  # unused without norms
    _qk_norm_rope_store_kernel[(tokens, heads + 2 * kv_heads)](
        q, k, v, q_weight, k_weight, cos, sin, positions, meta.slot_block, meta.slot_offset,
        k_cache, v_cache, q.stride(0), k.stride(0), v.stride(0), cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), eps,
        H=heads, HKV=kv_heads, D=dim, HAS_NORM=norms is not None, num_warps=1,
    )  # fmt: skip


@triton.jit
def _silu_mul_kernel(G, U, Out, stride_g, stride_u, N, BLOCK: tl.constexpr):
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
        gate, up, out, gate.stride(0), up.stride(0), n, BLOCK=block, num_warps=4
    )
    return out
