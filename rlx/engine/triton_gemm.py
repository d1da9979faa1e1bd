"""The layers' GEMMs of a small model at few rows: a Triton GEMM under programmatic dependent launch
(CUDA, sm90+).

At a decode step of 64 rows a Qwen3-0.6B layer's four GEMMs (qkv, o, gate_up, down: 4-13 MB of
weights each) take cuBLAS 24.9 µs where their 31.5 MB take 6.6 at 4.8 TB/s: each is mostly its
launch, its ramp and its tail (1xH200, docs/benchmarks.md). cuBLAS's kernels cannot be
launched under PDL (two of its decode kernels do not wait: bench/cublas_pdl_edges.py); this one
is, like the engine's other Triton kernels (rlx/engine/pdl.py): each program first asks the L2
for its rows of the weight, which no kernel of a forward writes, then waits for the kernel ahead,
so its launch and its weight's first bytes overlap the norm or attention before it. All the rows
in one tile, a program a column tile of `block_n` outputs (`small_gemm_settings`). Decode alone
at batch 64 (1xH200, 2026-12-01, `RLX_ENGINE_SMALL_GEMM=1|0|1 python3 bench/rollout_throughput.py
--engine-only --batches 64 --shapes qwen3_0.6b`): Qwen3-0.6B 29,680 -> 31,437-31,439 tokens/s
(47.9 -> 50.7% of the roofline). Qwen3-1.7B (its gate_up 50 MB) lost, 23,608 -> 23,014 (a
one-off wrapper of the same bench), so the engine takes it only where every layer GEMM's weight
is at most `MAX_WEIGHT_BYTES` (`small_gemms_pay`), at most `SMALL_ROWS` rows (at 128 rows it lost
on the 0.6B too: bench/decode_gemm_pdl.py). `RLX_ENGINE_SMALL_GEMM=0` turns it off. Its sums run
in another order than cuBLAS's: the same products to a bf16 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlx.engine.config import env_switch
from rlx.engine.pdl import pdl_launch, pdl_mode, pdl_prologue

SMALL_ROWS = 64
MAX_WEIGHT_BYTES = 16 << 20


@triton.jit
def prefetch_weight_rows(W, pid, BLOCK_N: tl.constexpr, K, LINE: tl.constexpr):
    """Ask the L2 for rows pid * BLOCK_N .. of W [N, K] (contiguous: one run of BLOCK_N * K
    elements), LINE elements (128 bytes) a prefetch."""
    base = W + pid.to(tl.int64) * BLOCK_N * K
    lines = BLOCK_N * K // LINE
    for start in range(0, lines, 128):
        at = tl.minimum(start + tl.arange(0, 128), lines - 1).to(tl.int64)
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [base + at * LINE],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _small_gemm_kernel(
    X, W, B, Out, M, N, K, stride_xm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    PREFETCH: tl.constexpr, LINE: tl.constexpr, SWIGLU: tl.constexpr = False, PDL: tl.constexpr = 0,
):  # fmt: skip
    """Out[:, tile] = X @ W[tile]^T (+ B[tile]) for W [N, K] contiguous, every row of X in one
    tile; N and K multiples of BLOCK_N and BLOCK_K. PREFETCH: the tile's BLOCK_N rows of W (one
    contiguous run) asked of the L2 before the PDL wait, LINE elements (128 bytes) a prefetch.
    SWIGLU: W [2N, K] holds gate and up (B too), Out = silu(gate) * up, each rounded to Out's
    dtype where `triton_layers.silu_mul` rounds (the GEMM's bf16 gate and up, then silu)."""
    pid = tl.program_id(0)
    if PREFETCH:
        prefetch_weight_rows(W, pid, BLOCK_N, K, LINE)
        if SWIGLU:
            prefetch_weight_rows(W + N.to(tl.int64) * K, pid, BLOCK_N, K, LINE)
    pdl_prologue(PDL)  # after the prefetch: the weight is no kernel's output
    rm = tl.arange(0, BLOCK_M)
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rows = rm[:, None] < M
    x_ptrs = X + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = W + rn[None, :].to(tl.int64) * K + rk[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):
        x = tl.load(x_ptrs, mask=rows, other=0.0)
        acc = tl.dot(x, tl.load(w_ptrs), acc)
        if SWIGLU:
            acc_up = tl.dot(x, tl.load(w_ptrs + N.to(tl.int64) * K), acc_up)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(B + rn).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up += tl.load(B + N + rn).to(tl.float32)[None, :]
    dt = Out.dtype.element_ty
    out = acc.to(dt)
    if SWIGLU:
        gate = out.to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
        out = (silu * acc_up.to(dt).to(tl.float32)).to(dt)
    tl.store(Out + rm[:, None] * stride_om + rn[None, :], out, mask=rows)


def small_gemm_settings(n: int, k: int) -> dict | None:
    """The launch settings for a weight [n, k], None where the kernel does not take it: about 96
    column tiles or more (`block_n` 16-128 outputs), `block_k` 128 (64 beside 128-output tiles,
    whose six stages would not fit in shared memory); both dividing the weight. The fastest of a
    sweep at 64 rows for Qwen3-0.6B's and 1.7B's weights (1xH200, a one-off, 2026-12-01):
    outputs 1,024-2,048 in 16s, 4,096 in 32s, 6,144 in 64s, 12,288 in 128s, 6 stages."""
    block_n = 128
    while block_n > 16 and (n // block_n < 96 or n % block_n):
        block_n //= 2
    block_k = 128 if block_n < 128 else 64
    while block_k > 16 and k % block_k:
        block_k //= 2
    if n % block_n or k % block_k:
        return None
    return {"block_n": block_n, "block_k": block_k, "num_stages": 6, "num_warps": 4}


def small_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, settings: dict, swiglu: bool = False
) -> torch.Tensor:
    """x [M <= SMALL_ROWS, K] @ weight [N, K]^T (+ bias) in x's dtype; `settings` from
    `small_gemm_settings(N, K)`. `swiglu`: weight [2N, K] is gate and up, the product
    silu(x @ gate^T) * (x @ up^T) [M, N], as `silu_mul` after the GEMM rounds it."""
    m, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    _small_gemm_kernel[(n // settings["block_n"],)](
        x, weight, bias if bias is not None else weight, out, m, n, k, x.stride(0), out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=settings["block_n"], BLOCK_K=settings["block_k"],
        HAS_BIAS=bias is not None, PREFETCH=x.is_cuda, LINE=128 // weight.element_size(), SWIGLU=swiglu,
        num_warps=settings["num_warps"], num_stages=settings["num_stages"], **pdl_launch(x.device),
    )  # fmt: skip
    return out


def small_gemms_pay(weights: list[torch.Tensor], device: torch.device) -> bool:
    """Whether a model whose layer GEMMs have these weights takes `small_gemm` at few rows on
    `device`: an sm90+ GPU under PDL, 2-byte weights, each at most MAX_WEIGHT_BYTES and of a shape
    the kernel takes; unless `RLX_ENGINE_SMALL_GEMM=0`."""
    if (
        env_switch("RLX_ENGINE_SMALL_GEMM") == "0"
        or not weights
        or device.type != "cuda"
        or not pdl_mode(device)
    ):
        return False
    return all(
        w.element_size() == 2
        and w.is_contiguous()
        and w.numel() * 2 <= MAX_WEIGHT_BYTES
        and small_gemm_settings(*w.shape) is not None
        for w in weights
    )
