"""Triton paged decode attention (CUDA only; imported when a decode runs on the GPU).

One program per (sequence, kv head): it loads the GQA group's queries once, streams the
sequence's K/V blocks BLOCK_N tokens at a time through the block table, and keeps an online
softmax in fp32, so each K/V byte is read exactly once per step. The group's queries are
padded to 16 rows for tl.dot; decode is bound by memory, so the idle rows cost nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    Q, K, V, Out, BT, CL, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_kb, stride_kh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(CL + row)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None]
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for start in range(0, context_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < context_len
        page = tl.load(BT + row * stride_bt + n // PAGE, mask=valid, other=0).to(tl.int64)
        offset = page * stride_kb + kv_head * stride_kh + (n % PAGE) * D
        k = tl.load(K + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        else:
            s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        Out + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=q_mask,
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """q [rows, heads, D]; caches [blocks, kv_heads, page, D]; every row has context_len >= 1.
    The launch settings are arguments so that bench/engine_step_profile.py can sweep them."""
    rows, num_heads, head_dim = q.shape
    _, num_kv_heads, page, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided view
    if num_stages is None:  # 4 stages measured best for 2-byte KV (docs/benchmarks.md); fp32 tiles
        num_stages = 4 if k_cache.element_size() == 2 else 2  # are twice as big: 4 overflow smem
    _paged_decode_kernel[(rows, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=head_dim, PAGE=page,
        BLOCK_N=block_n, IEEE=q.dtype == torch.float32, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
