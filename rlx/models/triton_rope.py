"""RoPE in Triton for training: megatron's `_apply_rotary_pos_emb_bshd` (non-interleaved) in one
kernel each way, with each position's cos/sin computed once per program.

The torch.compile of megatron's RoPE (what the fused kernel sets ran before) evaluated cos and sin
of the fp32 angles for every element of q and k, forward and backward: at the Qwen3-1.7B shape,
seq 4096, RoPE took 0.09 s of a 3.15 s training step on 1×H100, three times its memory traffic
(docs/benchmarks.md). Here a program takes one position and a block of its [batch x heads] rows:
it computes that position's `rot_dim` cos/sin once (fp32, rounded to the input's dtype as megatron
does), then rotates every row of the block in fp32 and rounds once:

    y[:h] = x[:h] * cos[:h] - x[h:r] * sin[:h]      (h = rot_dim / 2, r = rot_dim)
    y[h:r] = x[h:r] * cos[h:r] + x[:h] * sin[h:r]
    y[r:] = x[r:]                                   (the unrotated tail, if any)

and the backward is the transposed rotation (`dx[:h] = dy[:h]·cos[:h] + dy[h:r]·sin[h:r]`,
`dx[h:r] = dy[h:r]·cos[h:r] - dy[:h]·sin[:h]`), which needs nothing saved but the angles.
`t` is read where it lies ([s, b, heads, d] of any strides whose last dimension is contiguous: a
head split of the fused QKV projection is); outputs are contiguous. CUDA only: importing this
module imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ELEMENTS_PER_PROGRAM = 4096  # rows x head dim a program rotates: 32 rows of a 128-wide head


@triton.jit
def _rope_kernel(X, FREQS, Y, n_rows, n_heads, x_s, x_b, x_h, y_s, freqs_s, ROT: tl.constexpr,
                 D: tl.constexpr, HALF_BLOCK: tl.constexpr, TAIL_BLOCK: tl.constexpr,
                 BLOCK_ROWS: tl.constexpr, BACKWARD: tl.constexpr):  # fmt: skip
    pos = tl.program_id(0)  # a position (s); its rows are batch x heads, row = b * heads + h
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < n_rows
    half = ROT // 2
    cols = tl.arange(0, HALF_BLOCK)
    col_ok = cols < half
    f1 = tl.load(FREQS + pos * freqs_s + cols, mask=col_ok, other=0.0).to(tl.float32)
    f2 = tl.load(FREQS + pos * freqs_s + half + cols, mask=col_ok, other=0.0).to(tl.float32)
    dtype = Y.dtype.element_ty
    c1 = tl.cos(f1).to(dtype).to(tl.float32)[None, :]
    s1 = tl.sin(f1).to(dtype).to(tl.float32)[None, :]
    c2 = tl.cos(f2).to(dtype).to(tl.float32)[None, :]
    s2 = tl.sin(f2).to(dtype).to(tl.float32)[None, :]
    b = rows // n_heads
    h = rows - b * n_heads
    x_row = X + pos.to(tl.int64) * x_s + b.to(tl.int64)[:, None] * x_b + h.to(tl.int64)[:, None] * x_h
    y_row = Y + (pos.to(tl.int64) * y_s + rows.to(tl.int64) * D)[:, None]
    mask = row_ok[:, None] & col_ok[None, :]
    x1 = tl.load(x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y_row + cols[None, :], y1.to(dtype), mask=mask)
    tl.store(y_row + half + cols[None, :], y2.to(dtype), mask=mask)
    if TAIL_BLOCK > 0:  # the unrotated columns ROT..D, copied
        tail = tl.arange(0, TAIL_BLOCK)
        tail_mask = row_ok[:, None] & (tail < D - ROT)[None, :]
        rest = tl.load(x_row + ROT + tail[None, :], mask=tail_mask, other=0.0)
        tl.store(y_row + ROT + tail[None, :], rest, mask=tail_mask)


def _rotate(t: torch.Tensor, freqs: torch.Tensor, backward: bool) -> torch.Tensor:
    s, b, heads, d = t.shape
    rot = freqs.shape[-1]
    out = torch.empty((s, b, heads, d), dtype=t.dtype, device=t.device)
    n_rows = b * heads
    half_block = triton.next_power_of_2(rot // 2)
    tail_block = triton.next_power_of_2(d - rot) if d > rot else 0
    block_rows = min(triton.next_power_of_2(n_rows), max(1, ELEMENTS_PER_PROGRAM // (2 * half_block)))
    _rope_kernel[(s, triton.cdiv(n_rows, block_rows))](
        t, freqs, out, n_rows, heads, t.stride(0), t.stride(1), t.stride(2), n_rows * d, freqs.stride(0),
        ROT=rot, D=d, HALF_BLOCK=half_block, TAIL_BLOCK=tail_block, BLOCK_ROWS=block_rows,
        BACKWARD=backward, num_warps=4,
    )  # fmt: skip
    return out


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(freqs)
        return _rotate(t, freqs, backward=False)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (freqs,) = ctx.saved_tensors
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        return _rotate(dy, freqs, backward=True), None


def supported(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether `apply_rope` takes (t, freqs) to its kernel: [s, b, heads, d] with a contiguous last
    dimension on CUDA, angles [s, 1, 1, rot_dim] (one per position, an even rot_dim ≤ d)."""
    return (
        t.is_cuda
        and t.dim() == 4
        and t.stride(-1) == 1
        and t.numel() > 0
        and freqs.dim() == 4
        and freqs.shape[0] == t.shape[0]
        and freqs.shape[1] == 1
        and freqs.shape[2] == 1
        and freqs.shape[-1] % 2 == 0
        and freqs.shape[-1] <= t.shape[-1]
        and freqs.stride(-1) == 1
    )


def apply_rope(t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """megatron's non-interleaved `_apply_rotary_pos_emb_bshd(t, freqs)` (mscale 1) where
    `supported`; the caller falls back otherwise."""
    return RoPEFunction.apply(t, freqs)
