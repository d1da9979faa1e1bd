"""RMSNorm in Triton for training: a forward and a backward kernel over blocks of rows.

torch's `rms_norm` (megatron's local norm) is one CUDA kernel each way, but its backward reduces
the weight's gradient with a generic gamma/beta kernel that runs at a quarter of the memory
bandwidth on Qwen3's per-head q/k norms (131,072 rows of 128 at 2 x 4,096 tokens): at the 1.7B
shape, seq 4096, the norms took 0.34 s of a 3.3 s step on 1×H100 (docs/benchmarks.md). Here:

- forward: each program normalises BLOCK_M rows at once (BLOCK_M x BLOCK_N ≈ 4,096 elements,
  so a 128-wide head norm takes 32 rows a program), in fp32, `y = x * rsqrt(mean(x²) + eps) * w`
  cast once to x's dtype (torch's `rms_norm`'s arithmetic), and keeps each row's 1/rms (fp32);
- backward: a fixed grid of programs (a few per SM) each walks its share of the rows, writes
  `dx = (dy·w - x̂ · mean(x̂ · dy·w)) / rms` and sums `dy · x̂` for the weight in registers; the
  programs' partial sums ([programs, N] fp32) are added up by one `sum`, or by one kernel straight
  into the weight's fp32 `main_grad` under megatron's DDP.

`add_rms_norm` takes the residual add before a norm into the same kernels: the forward writes the
rounded sum s = x + residual and normalises it, the backward adds the sum's own gradient (the
residual stream's) into the input gradient before rounding it once.

Rows of any stride along the leading dimensions are read as they lie when the last dimension is
contiguous and the rows are evenly spaced (the keys' split of the fused QKV projection), or come in
evenly spaced groups of evenly spaced rows (its query heads, several a KV group:
`rlx.models.self_attention` hands them over as such a view); anything else is made contiguous first. CUDA only: importing this module imports triton.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from rlx.models.residual_norm import PendingAddNorm
from rlx.models.rows import grouped_rows as _grouped_rows
from rlx.models.rows import rows as _rows

ELEMENTS_PER_PROGRAM = 4096  # BLOCK_M x BLOCK_N: 32 rows of a 128-wide head norm, 2 of a 2,048 one
MAX_WIDTH = 16384  # wider rows are torch's (a row's block must fit a program's registers)


@triton.jit
def _forward_kernel(X, R, S, W, Y, RSTD, n_rows, x_outer, x_inner, x_group, r_stride, y_stride, eps,
                    N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ADD: tl.constexpr):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < N)[None, :]
    r64 = rows[:, None].to(tl.int64)
    x_at = (r64 // x_group) * x_outer + (r64 % x_group) * x_inner  # x's rows: groups of evenly spaced
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)  # first: issued before the reduction
    x = tl.load(X + x_at + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if ADD:  # s = x + residual, rounded to the inputs' dtype (a separate add's result), is normalised
        r = tl.load(R + r64 * r_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(S.dtype.element_ty)
        tl.store(S + r64 * y_stride + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(Y + r64 * y_stride + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@triton.jit
def _backward_kernel(DY, X, W, RSTD, DS, DX, DW, n_rows, rows_per_program, x_outer, x_inner, x_group,
                     dy_stride, ds_stride, dx_stride, N: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, ADD: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_program
    for offset in range(0, rows_per_program, BLOCK_M):  # a multiple of BLOCK_M
        rows = first + offset + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        r64 = rows[:, None].to(tl.int64)
        x_at = (r64 // x_group) * x_outer + (r64 % x_group) * x_inner
        x = tl.load(X + x_at + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + r64 * dy_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        x_hat = x * rstd[:, None]
        wdy = dy * w[None, :]
        c = tl.sum(x_hat * wdy, axis=1) / N
        dx = (wdy - x_hat * c[:, None]) * rstd[:, None]
        if ADD:  # the gradient the sum got around the norm (the residual stream's), added before rounding
            dx += tl.load(DS + r64 * ds_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + r64 * dx_stride + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(DW + pid * N + cols, tl.sum(dw, axis=0), mask=col_ok)


@triton.jit
def _sum_into_kernel(
    PARTIALS, OUT, n_partials, N: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for first in range(0, n_partials, BLOCK_P):
        rows = first + tl.arange(0, BLOCK_P)
        mask = (rows < n_partials)[:, None] & col_ok[None, :]
        acc += tl.load(PARTIALS + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0) + tl.load(OUT + cols, mask=col_ok, other=0.0)
    tl.store(OUT + cols, total, mask=col_ok)


@cache
def _blocks(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for rows of `n`."""
    block_n = triton.next_power_of_2(n)
    block_m = max(1, ELEMENTS_PER_PROGRAM // block_n)
    return block_m, block_n, min(16, max(4, block_m * block_n // 1024))


@cache
def _programs(device: torch.device) -> int:
    """Backward programs: 4 a streaming multiprocessor (each holds few registers); off CUDA (Triton's
    CPU interpreter, tests/kernels) 4, so that the weight's gradient still sums several partials."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device.index or 0).multi_processor_count


def _norm_forward(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """The forward kernel over x's rows, or over s = x + `residual` (rounded) where one is given:
    (what was normalised, as the kernel reads it: x's rows as they lie, or s; its row layout
    (outer, inner, group) as `rlx.models.rows`'; rstd, y)."""
    n = x.shape[-1]
    rows = x.numel() // n
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    if residual is None:
        x_rows, layout = _grouped_rows(x)
        r_rows, r_stride, s = x_rows, 0, y
    else:
        (x_rows, x_stride), (r_rows, r_stride) = _rows(x), _rows(residual)
        layout, s = (x_stride, 0, 1), torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_m, block_n, warps = _blocks(n)
    _forward_kernel[(triton.cdiv(rows, block_m),)](
        x_rows, r_rows, s, weight, y, rstd, rows, *layout, r_stride, n, eps, N=n, BLOCK_M=block_m,
        BLOCK_N=block_n, ADD=residual is not None, num_warps=warps,
    )  # fmt: skip
    if residual is None:
        return x_rows, layout, rstd, y
    return s, (n, 0, 1), rstd, y


def _norm_backward(ctx, dy: torch.Tensor, ds: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dw) from the saved rows, weight and rstd; `ds` (the sum's own gradient) added into dx."""
    x, weight, rstd = ctx.saved_tensors
    n = x.shape[-1]
    rows = rstd.numel()
    dy, dy_stride = _rows(dy)
    ds_rows, ds_stride = (dy, dy_stride) if ds is None else _rows(ds)
    dx = torch.empty(ctx.shape, dtype=x.dtype, device=x.device)
    block_m, block_n, warps = _blocks(n)
    programs = min(_programs(x.device), triton.cdiv(rows, block_m))
    rows_per_program = triton.cdiv(triton.cdiv(rows, programs), block_m) * block_m
    programs = triton.cdiv(rows, rows_per_program)
    dw = torch.empty(programs, n, dtype=torch.float32, device=x.device)
    _backward_kernel[(programs,)](
        dy, x, weight, rstd, ds_rows, dx, dw, rows, rows_per_program, *ctx.layout, dy_stride, ds_stride,
        n, N=n, BLOCK_M=block_m, BLOCK_N=block_n, ADD=ds is not None, num_warps=warps,
    )  # fmt: skip
    needs_dw = ctx.needs_input_grad[-2]  # the weight: both functions' second-to-last input
    return dx, _weight_grad(dw, ctx.weight) if needs_dw else None


def _weight_grad(partials: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The weight's gradient from the backward programs' partial sums [programs, N] (fp32): where
    megatron's DDP gave the weight an fp32 `main_grad`, added straight into it by one kernel, with
    megatron's own protocol for gradients its layers accumulate themselves (`grad_added_to_main_grad`
    set, so DDP's hook adds nothing; a placeholder returned, so the hook still runs); else summed
    and returned in the weight's dtype (the sum, the cast and DDP's add: three small kernels a norm
    where this is one; at the 1.7B shape on an H200, 904 norms a step, 17 -> 15 ms of GPU time)."""
    main_grad = getattr(weight, "main_grad", None)
    if (
        main_grad is None
        or not hasattr(weight, "grad_added_to_main_grad")
        or main_grad.dtype != torch.float32
        or main_grad.shape != weight.shape
        or not main_grad.is_contiguous()
    ):
        return partials.sum(0).to(weight.dtype)
    n = partials.shape[1]
    block_n = min(128, triton.next_power_of_2(n))
    _sum_into_kernel[(triton.cdiv(n, block_n),)](
        partials, main_grad, partials.shape[0], N=n, BLOCK_P=32, BLOCK_N=block_n
    )
    weight.grad_added_to_main_grad = True
    placeholder = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return placeholder(weight.shape, dtype=weight.dtype, device=weight.device)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x_rows, ctx.layout, rstd, y = _norm_forward(x, None, weight, eps)
        ctx.save_for_backward(x_rows, weight, rstd)
        ctx.weight = weight  # the parameter itself, whose main_grad the backward may add into
        ctx.shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dx, dw = _norm_backward(ctx, dy, None)
        return dx, dw, None


class AddRMSNormFunction(torch.autograd.Function):
    """(s, y) = (x + residual, rms_norm(x + residual)) in one kernel each way: the backward adds the
    sum's own gradient (the residual stream's) to the norm's input gradient, which is then the
    gradient of both x and residual."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        ctx.set_materialize_grads(False)
        s, ctx.layout, rstd, y = _norm_forward(x, residual, weight, eps)
        # s itself, not its [rows, N] view: autograd saves an output without a reference to its own
        # node, but a view of it as any tensor, a cycle (s -> node -> view -> s) that kept every sum
        # of a forward with gradients and no backward alive, out of the cyclic GC's sight
        ctx.save_for_backward(s, weight, rstd)
        ctx.weight = weight
        ctx.shape = x.shape
        return s, y

    @staticmethod
    def backward(ctx, ds: torch.Tensor | None, dy: torch.Tensor | None):
        if dy is None:  # the normalised output was not used
            return ds, ds, None, None
        dx, dw = _norm_backward(ctx, dy, ds)
        return dx, dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`torch.nn.functional.rms_norm(x, (N,), weight, eps)` over x's last dimension N."""
    if x.shape[-1] > MAX_WIDTH or x.numel() == 0:
        return torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return RMSNormFunction.apply(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(s, rms_norm(s))` for `s = x + residual` (rounded to their dtype, as a separate add would)."""
    if x.shape[-1] > MAX_WIDTH or x.numel() == 0:
        s = x + residual
        return s, torch.nn.functional.rms_norm(s, (s.shape[-1],), weight, eps)
    return AddRMSNormFunction.apply(x, residual, weight, eps)


class TritonRMSNorm(PendingAddNorm, torch.nn.RMSNorm):
    """`torch.nn.RMSNorm` (what megatron's local spec builds) through `rms_norm`'s kernels, and
    through `add_rms_norm`'s where the residual add before it is fused in
    (`rlx.models.residual_norm`).

    Takes megatron's norm constructor arguments; parameters and state-dict keys are the torch
    norm's (`weight`)."""

    reads_grouped_rows = True  # rows in evenly spaced groups are read in place (`_grouped_rows`)

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def _add_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, self.weight, self.eps)
