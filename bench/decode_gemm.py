"""The decode step's GEMMs at RL batch sizes: cuBLAS, cuBLASLt and a split-K Triton GEMM; one JSON
line per GEMM and per layer, on the GPU.

At 64-256 rows a decode GEMM reads its whole weight for little arithmetic, so it is bound by
memory, yet cuBLAS leaves much of the bandwidth unused on the small ones (o_proj, down_proj):
their few output tiles occupy few SMs. A split-K GEMM cuts the reduction dimension into shares,
each program writing an fp32 partial ([splits, rows, N]) that a consumer sums. `split_k_us`
times the partials' write alone (a consumer that sums them for free); `split_k_sum_us` the
same kernel whose last program of each column tile adds the tile's partials in share order
(deterministic) and writes the bf16 product, a drop-in for the GEMM (`drop_in_us`: the faster
of it and cuBLAS, summed over the layer). Summing in the next `add_rms_norm` instead cost that
norm as much as the GEMMs saved (docs/benchmarks.md, Decisions). For each shape the
Triton kernel's settings are swept (splits 1-8, BLOCK_N 32-128, BLOCK_K 64/128, 3-5 stages) and
the fastest correct one is kept; every call is timed inside a CUDA graph, as the engine runs
decode (`engine_step_profile.time_cuda`). Shapes: Qwen3-0.6B's and Qwen3-1.7B's qkv, o, gate_up and down projections (the
engine's merged layouts).

    source .whl/install.sh && python3 bench/decode_gemm.py [--rows 64,128,256]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from engine_step_profile import time_cuda
from rollout_throughput import bandwidth

SHAPES = {  # name -> (K, N) of weight [N, K]
    "qwen3_1.7b": {"qkv": (2048, 4096), "o": (2048, 2048), "gate_up": (2048, 12288), "down": (6144, 2048)},
    "qwen3_0.6b": {"qkv": (1024, 4096), "o": (2048, 1024), "gate_up": (1024, 6144), "down": (3072, 1024)},
}


@triton.jit
def _split_k_gemm(
    X, W, Out, Sum, Counters, M, K_SHARE, stride_xm, stride_wn, stride_os, stride_om, stride_sm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    SUM: tl.constexpr,
):  # fmt: skip
    """Out[share] = X[:, share's K] @ W[:, share's K]^T, all M rows in one tile; K_SHARE and N
    multiples of BLOCK_K and BLOCK_N. SUM: the last of a column tile's SPLITS programs to finish
    (an int32 counter a tile, zero before and after) adds the tile's partials in share order,
    so the sum is deterministic, and writes it to Sum in Sum's dtype."""
    pid_n = tl.program_id(0)
    share = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k0 = share * K_SHARE
    x_ptrs = X + rm[:, None] * stride_xm + (k0 + rk)[None, :]
    w_ptrs = W + rn[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None]
    rows = rm[:, None] < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, K_SHARE, BLOCK_K):
        acc = tl.dot(tl.load(x_ptrs, mask=rows, other=0.0), tl.load(w_ptrs), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    tile = rm[:, None] * stride_om + rn[None, :]
    tl.store(Out + share * stride_os + tile, acc.to(Out.dtype.element_ty), mask=rows)
    if SUM:
        tl.debug_barrier()  # every warp's partial stored before the tile's counter moves
        arrived = tl.atomic_add(Counters + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLITS - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                total += tl.load(Out + s * stride_os + tile, mask=rows, other=0.0, cache_modifier=".cg")
            out = Sum + rm[:, None] * stride_sm + rn[None, :]
            tl.store(out, total.to(Sum.dtype.element_ty), mask=rows)
            tl.atomic_xchg(Counters + pid_n, 0)


def split_k_gemm(
    x, w, out, splits: int, block_n: int, block_k: int, stages: int, sum_into=None, counters=None
):
    """`out` [splits, M, N] fp32 partials; with `sum_into` [M, N] (and `counters`, int32 zeros, a
    column tile each) their sum too, in the same kernel."""
    m, k = x.shape
    block_m = max(16, triton.next_power_of_2(m))
    total = sum_into if sum_into is not None else out
    _split_k_gemm[(w.shape[0] // block_n, splits)](
        x, w, out, total, counters if counters is not None else out, m, k // splits, x.stride(0),
        w.stride(0), out.stride(0), out.stride(1), total.stride(-2),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SPLITS=splits, SUM=sum_into is not None,
        num_warps=8 if block_m * block_n >= 128 * 128 else 4, num_stages=stages,
    )  # fmt: skip


def best_split_k(x, w, reference, with_sum: bool = False) -> tuple[float, dict | None]:
    """The fastest correct setting of the sweep: (microseconds, setting); `with_sum`: the
    partials summed in the kernel (`_split_k_gemm`'s SUM), the product written in bf16."""
    m, k = x.shape
    n = w.shape[0]
    block_m = max(16, triton.next_power_of_2(m))
    best = (float("inf"), None)
    for splits, block_n, block_k, stages in itertools.product(
        (2, 4, 8) if with_sum else (1, 2, 4, 8), (32, 64, 128), (64, 128), (3, 4, 5)
    ):
        if k % (splits * block_k) or n % block_n or block_m * block_n > 128 * 128:
            continue
        if (block_m + block_n) * block_k * 2 * stages > 200_000:  # shared memory of the pipeline
            continue
        dtype = torch.float32 if splits > 1 else torch.bfloat16
        out = torch.empty(splits, m, n, device="cuda", dtype=dtype)
        setting = dict(splits=splits, block_n=block_n, block_k=block_k, stages=stages)
        if with_sum:
            setting["sum_into"] = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            setting["counters"] = torch.zeros(n // block_n, device="cuda", dtype=torch.int32)
        try:
            split_k_gemm(x, w, out, **setting)
        except triton.runtime.errors.OutOfResources:
            continue
        got = setting["sum_into"].float() if with_sum else out.float().sum(0)
        if (got - reference).abs().max().item() > 0.02 * reference.abs().max().item():
            continue  # a setting that computes something else is no candidate
        us = time_cuda(lambda out=out, setting=setting: split_k_gemm(x, w, out, **setting), graph=True) * 1e6
        if with_sum:  # after the graph's replays too: counters back at zero, the same product
            counters = setting.pop("counters")
            again = setting.pop("sum_into").float()
            if counters.any() or (again - got).abs().max().item() > 0:
                continue
        if us < best[0]:
            best = (us, setting)
    return best


def cublas_us(x, w, library: str) -> float:
    torch.backends.cuda.preferred_blas_library(library)
    try:
        return time_cuda(lambda: F.linear(x, w), graph=True) * 1e6
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")


def time_gemm(m: int, k: int, n: int) -> dict:
    """One GEMM's row: cuBLAS, cuBLASLt, the best split-K setting, with and without its sum."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    reference = F.linear(x, w).float()
    row = {
        "cublas_us": round(cublas_us(x, w, "cublas"), 2),
        "cublaslt_us": round(cublas_us(x, w, "cublaslt"), 2),
    }
    us, setting = best_split_k(x, w, reference)
    row["split_k_us"], row["split_k_setting"] = round(us, 2), setting
    us_sum, setting_sum = best_split_k(x, w, reference, with_sum=True)
    row["split_k_sum_us"], row["split_k_sum_setting"] = round(us_sum, 2), setting_sum
    row["drop_in_us"] = min(row["cublas_us"], row["split_k_sum_us"])  # the faster bf16 product
    row["cublas_TB_s"] = round(k * n * 2 / row["cublas_us"] / 1e6, 2)
    row["split_k_TB_s"] = round(k * n * 2 / us / 1e6, 2)
    return row


def sweep_layers(bench: str, shapes: list[str], rows: list[int], measure, sum_keys: tuple[str, ...]) -> None:
    """For each shape and row count: `measure(m, k, n)`'s dict for each of a layer's GEMMs, a JSON
    line each; the layer's sums of `sum_keys` beside its weights' time at the HBM bandwidth and
    its FLOPs' at the 790 TFLOP/s a large GEMM reaches, a JSON line; then the bench's line."""
    name = torch.cuda.get_device_name()
    hbm = bandwidth(name)
    start = time.perf_counter()
    for shape in shapes:
        for m in rows:
            layer, weight_bytes, flop = dict.fromkeys(sum_keys, 0.0), 0, 0
            for gemm, (k, n) in SHAPES[shape].items():
                row = {
                    "device": name,
                    "shape": shape,
                    "rows": m,
                    "gemm": gemm,
                    "MB": round(k * n * 2 / 1e6, 1),
                }
                row |= measure(m, k, n)
                print(json.dumps(row), flush=True)
                for key in sum_keys:
                    layer[key] += row[key]
                weight_bytes, flop = weight_bytes + k * n * 2, flop + 2 * m * n * k
            layer |= {"roofline_us": weight_bytes / hbm * 1e6, "matmul_ceiling_us": flop / 790e12 * 1e6}
            print(json.dumps({"device": name, "shape": shape, "rows": m, "layer": {
                key: round(v, 2) for key, v in layer.items()
            }}), flush=True)  # fmt: skip
    print(json.dumps({"bench": bench, "device": name, "date": time.strftime("%Y-%m-%d"),
                      "wall_s": round(time.perf_counter() - start, 1)}))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="64,128,256", help="decode batch sizes (GEMM rows)")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    sum_keys = ("cublas_us", "cublaslt_us", "split_k_us", "drop_in_us")
    sweep_layers("decode_gemm", list(SHAPES), rows, time_gemm, sum_keys)


if __name__ == "__main__":
    main()
