"""The layers' GEMMs at few rows: a Triton GEMM under programmatic dependent launch (CUDA, sm90+).

At a decode step of 64 rows a Qwen3-0.6B layer's four GEMMs (qkv, o, gate_up, down: 4-13 MB of
weights each) take cuBLAS 24.9 µs where their 31.5 MB take 6.6 at 4.8 TB/s: each is mostly its
launch, its ramp and its tail (1xH200, docs/benchmarks.md). cuBLAS's kernels cannot be
launched under PDL (two of its decode kernels do not wait: bench/cublas_pdl_edges.py); this one
is, like the engine's other Triton kernels (rlx/engine/pdl.py): each program first asks the L2
for its part of a weight of at most PREFETCH_BYTES, which no kernel of a forward writes, then
waits for the kernel ahead, so its launch and its weight's first bytes overlap the norm or
attention before it. All the rows in one tile (BLOCK_M), a program a column tile of `block_n`
outputs (`small_gemm_settings`), both read by TMA. Two of a layer's GEMMs go further: gate_up
computes its SwiGLU in its epilogue (`small_swiglu_settings`: no silu_mul kernel), and o and
down, whose outputs only the next `add_rms_norm` reads, split their K while their programs stay
within one wave of the SMs (`small_split_settings`: the 0.6B's in 4, the 1.7B's in 2), the norm
summing the fp32 partials. `RLX_ENGINE_SMALL_GEMM=0` turns it all off.

Decode alone at batch 64 (1xH200, 2026-12-01, one-off wrappers of `bench/rollout_throughput.py`: the
variants in one process, a fresh engine each; docs/benchmarks.md, Decisions): Qwen3-0.6B 47.8% of
the roofline with cuBLAS, 55.8% with this kernel's loads by pointer, 56.9% by TMA; Qwen3-1.7B 55.9%
with cuBLAS, 57.5% with the loads by pointer for its qkv and o (its down, 25 MB, or gate_up, 50 MB,
lost so), 62.6% by TMA for all four. A weight takes it where it is at most `MAX_WEIGHT_BYTES`
(`small_gemm_takes`); asking the L2 for the 1.7B's down and gate_up too gave 59.7%. At most
`SMALL_ROWS` rows: at 128 rows (two tiles of rows) it lost 0.4 points on the 0.6B and 5.3 on the
1.7B, and at 256 rows, tiles of 64-128 rows swept, it gave no more than cuBLAS on the 1.7B's qkv and
o and lost on its down.
Its sums run in another order than cuBLAS's: the same products to a bf16 rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host-side TMA descriptors: `small_gemms_on` says no
    TensorDescriptor = None

from rlx.engine.config import env_switch
from rlx.engine.pdl import pdl_launch, pdl_mode, pdl_prologue

SMALL_ROWS = 64
BLOCK_M = 64  # rows a program, at most
MAX_WEIGHT_BYTES = 64 << 20
PREFETCH_BYTES = 16 << 20
SHARED_BYTES = 200 << 10  # a program's pipelined tiles (H100 and H200 give a block up to 227 KB)


@triton.jit
def prefetch_weight_rows(W, row0, ROWS: tl.constexpr, K, k0, KS, LINE: tl.constexpr):
    """Ask the L2 for W[row0 : row0 + ROWS, k0 : k0 + KS] (W [N, K] contiguous; one run of ROWS * K
    elements where KS is K), LINE elements (128 bytes) a prefetch."""
    base = W + row0.to(tl.int64) * K + k0
    per_row = KS // LINE
    lines = ROWS * per_row
    for start in range(0, lines, 128):
        at = tl.minimum(start + tl.arange(0, 128), lines - 1)
        offset = (at // per_row).to(tl.int64) * K + (at % per_row) * LINE
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [base + offset],
            dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip


@triton.jit
def _small_gemm_kernel(
    x_desc, w_desc, out_desc, W, B, N, K,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    PREFETCH: tl.constexpr, LINE: tl.constexpr, SWIGLU: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    PDL: tl.constexpr = 0,
):  # fmt: skip
    """Out[rows, tile] = X[rows] @ W[tile]^T (+ B[tile]) for W [N, K] contiguous, program (n, s, m)
    the m-th BLOCK_M rows, its tiles read by TMA (`x_desc` [M, K], `w_desc` [N, K]: rows past
    M read as zeros, and stores past them dropped); N and K / SPLIT multiples of BLOCK_N and
    BLOCK_K. PREFETCH: the program's part of W (`W`, the same tensor) asked of the L2 before the
    PDL wait, LINE elements (128 bytes) a prefetch.
    SWIGLU: W [2N, K] holds gate and up (B too), Out = silu(gate) * up, each rounded to Out's
    dtype where `triton_layers.silu_mul` rounds (the GEMM's bf16 gate and up, then silu).
    SPLIT > 1: program (tile, s) sums the s-th of SPLIT equal runs of K into Out[s] (`out_desc`
    [SPLIT, M, N] fp32, unrounded; B in Out[0]): their sum is the product (`triton_layers.add_rms_norm`
    sums them)."""
    pid = tl.program_id(0)
    part = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    n0 = pid * BLOCK_N
    k_part = K // SPLIT
    k0 = part * k_part
    if PREFETCH:
        prefetch_weight_rows(W, n0, BLOCK_N, K, k0, k_part, LINE)
        if SWIGLU:
            prefetch_weight_rows(W, N + n0, BLOCK_N, K, k0, k_part, LINE)
    pdl_prologue(PDL)  # after the prefetch: the weight is no kernel's output
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(k0, k0 + k_part, BLOCK_K):
        x = x_desc.load([m0, k])
        acc = tl.dot(x, w_desc.load([n0, k]).T, acc)
        if SWIGLU:
            acc_up = tl.dot(x, w_desc.load([N + n0, k]).T, acc_up)
    if HAS_BIAS:
        rn = n0 + tl.arange(0, BLOCK_N)
        bias = tl.load(B + rn).to(tl.float32)
        acc += tl.where(part == 0, bias, 0.0)[None, :]  # a split product's bias once, in Out[0]
        if SWIGLU:
            acc_up += tl.load(B + N + rn).to(tl.float32)[None, :]
    if SPLIT > 1:
        out_desc.store([part, m0, n0], tl.reshape(acc, (1, BLOCK_M, BLOCK_N)))
    else:
        dt = out_desc.dtype
        out = acc.to(dt)
        if SWIGLU:
            gate = out.to(tl.float32)
            silu = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)
            out = (silu * acc_up.to(dt).to(tl.float32)).to(dt)
        out_desc.store([m0, n0], out)


def small_gemm_settings(n: int, k: int, wide: int = 1) -> dict | None:
    """The launch settings for a weight [wide * n, k] (`wide` 2: gate_up with its SwiGLU, two
    weight tiles a program), None where the kernel does not take it: about 96 column tiles or
    more, of 32-128 outputs (16 where 32 does not divide n); `block_k` 128 (64 beside 128-output
    tiles), both dividing the weight; at most 6 stages, as many as a stage's row tile and weight
    tiles fit in SHARED_BYTES; the weight asked of the L2 before the PDL wait where it is at most
    PREFETCH_BYTES. The fastest of a sweep at 64 rows for Qwen3-0.6B's and 1.7B's weights (1xH200,
    a one-off, 2026-12-01): outputs 1,024-4,096 in 32s, 6,144 in 64s (gate_up's halves: 3,072 in
    32s, 6,144 in 64s, 4 stages), 128-element K steps."""
    block_n = 128
    while block_n > 16 and (n % block_n or (block_n > 32 and n // block_n < 96)):
        block_n //= 2
    block_k = 128 if block_n < 128 else 64
    while block_k > 16 and k % block_k:
        block_k //= 2
    if n % block_n or k % block_k:
        return None
    stage_bytes = (BLOCK_M + wide * block_n) * block_k * 2
    return {
        "block_n": block_n, "block_k": block_k, "num_stages": min(6, SHARED_BYTES // stage_bytes), "num_warps": 4,
        "prefetch": wide * n * k * 2 <= PREFETCH_BYTES,
    }  # fmt: skip


def small_swiglu_settings(n: int, k: int) -> dict | None:
    """The launch settings for gate_up [2n, k] with its SwiGLU (`small_gemm(swiglu=True)`)."""
    return small_gemm_settings(n, k, wide=2)


def small_split_settings(n: int, k: int, programs: int = 128) -> dict | None:
    """The launch settings for a weight [n, k] whose product is read only as the sum of its
    partial products (a layer's o and down, summed by `add_rms_norm`): `small_gemm_settings`'
    tiles, and K halved into `split` runs while the programs stay at most `programs` (about one
    wave of an H100's or H200's 132 SMs) and the runs whole `block_k` steps. Qwen3-0.6B's o and down
    (32 column tiles of 32) split in 4, the 1.7B's (64) in 2."""
    settings = small_gemm_settings(n, k)
    if settings is not None:
        tiles, split = n // settings["block_n"], 1
        while tiles * split * 2 <= programs and k % (split * 2 * settings["block_k"]) == 0:
            split *= 2
        settings["split"] = split
    return settings


def small_gemm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, settings: dict, swiglu: bool = False
) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) in x's dtype (the engine's M at most SMALL_ROWS; past
    BLOCK_M in tiles of rows); `settings` from `small_gemm_settings(N, K)`. `swiglu`
    (`small_swiglu_settings`): weight [2N, K] is gate and up, the product silu(x @ gate^T) *
    (x @ up^T) [M, N], as `silu_mul` after the GEMM rounds it. A `split` of S > 1
    (`small_split_settings`): the S partial products [S, M, N] in fp32, whose sum is the product
    before its rounding."""
    m, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    split = settings.get("split", 1)
    assert not (swiglu and split > 1), "SwiGLU needs the whole product"
    if x.stride(1) != 1 or x.data_ptr() % 16 or x.stride(0) * x.element_size() % 16:
        x = x.contiguous()  # what a TMA descriptor takes
    block_m = min(BLOCK_M, max(16, triton.next_power_of_2(m)))
    block_n, block_k = settings["block_n"], settings["block_k"]
    if split > 1:
        out = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
        out_desc = TensorDescriptor(out, [split, m, n], [m * n, n, 1], [1, block_m, block_n])
    else:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
        out_desc = TensorDescriptor(out, [m, n], [n, 1], [block_m, block_n])
    _small_gemm_kernel[(n // block_n, split, triton.cdiv(m, block_m))](
        TensorDescriptor(x, [m, k], [x.stride(0), 1], [block_m, block_k]),
        TensorDescriptor(weight, list(weight.shape), [k, 1], [block_n, block_k]), out_desc,
        weight, bias if bias is not None else weight, n, k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HAS_BIAS=bias is not None,
        PREFETCH=x.is_cuda and settings["prefetch"], LINE=128 // weight.element_size(), SWIGLU=swiglu,
        SPLIT=split, num_warps=settings["num_warps"], num_stages=settings["num_stages"], **pdl_launch(x.device),
    )  # fmt: skip
    return out


def small_gemms_on(device: torch.device) -> bool:
    """Whether the engine on `device` takes `small_gemm` at few rows at all: an sm90+ GPU under
    PDL, with a Triton that has TMA descriptors, unless `RLX_ENGINE_SMALL_GEMM=0`."""
    if env_switch("RLX_ENGINE_SMALL_GEMM") == "0" or TensorDescriptor is None:
        return False
    return device.type == "cuda" and pdl_mode(device) > 0


def small_gemm_takes(weight: torch.Tensor) -> bool:
    """Whether a layer GEMM of this weight takes `small_gemm` at few rows: 2-byte, contiguous, at
    most MAX_WEIGHT_BYTES, of a shape the kernel takes."""
    return (
        weight.element_size() == 2
        and weight.is_contiguous()
        and weight.numel() * 2 <= MAX_WEIGHT_BYTES
        and small_gemm_settings(*weight.shape) is not None
    )
