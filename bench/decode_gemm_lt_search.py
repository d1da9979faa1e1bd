"""Every cuBLASLt configuration of its NVJET algorithm for the decode step's GEMMs, not only what
its heuristic offers (bench/decode_gemm_lt.py times those): each tile, stage count, split-K count
(1-8, with each reduction), custom option and cluster shape its capabilities list
(`cublasLtMatmulAlgoCapGetAttribute`), and the heuristic's 64 first with each split-K count and
cluster shape; kept where `cublasLtMatmulAlgoCheck` accepts it within the workspace; all timed by
a quick pass (one weight, 8 calls in a CUDA graph), the `--final` fastest again as
decode_gemm_lt.py times (CUDA graphs, weights rotated), checked against F.linear. One JSON line
per GEMM: torch's time, the heuristic's first, the best configuration's and how many were tried.
cuBLASLt's other algorithm ids (21, 23, 24 on the H200) were all 1.4-2x slower at these shapes.

Why: at 256 rows a 1.7B layer's GEMMs take about 1.5x the matmul ceiling's time
(docs/benchmarks.md); TensorRT-LLM keeps a table of cuBLASLt configurations for small-M bf16
GEMMs because the heuristic's pick is not always the fastest there. About 5 minutes a shape.

    source .whl/install.sh && python3 bench/decode_gemm_lt_search.py [--rows 256] [--shapes qwen3_1.7b]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import math
import time

import torch
import torch.nn.functional as F
from decode_gemm import SHAPES
from decode_gemm_lt import (
    COMPUTE_32F,
    CONFIG,
    R_16BF,
    R_32F,
    WORKSPACE,
    Algo,
    Heuristic,
    LtGemm,
    load_lt,
    rotating,
)
from engine_step_profile import time_cuda

CAP_SPLITK, CAP_REDUCTION_MASK, CAP_TILE_IDS, CAP_STAGES_IDS = 0, 1, 6, 13
CONFIG_INNER, CONFIG_CLUSTER = 7, 8  # uint16 attributes (decode_gemm_lt.CONFIG's are uint32)
CAP_CUSTOM_MAX = 7
NVJET = 66
CLUSTERS = (0, 2, 3, 5, 6, 8, 9)
SPLITS = (1, 2, 3, 4, 6, 8)


def cap_array(lt, algo: Algo, attr: int) -> list[int]:
    written = ctypes.c_size_t()
    lt.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(written))
    count = written.value // 4
    if count == 0:
        return []
    values = (ctypes.c_uint32 * count)()
    LtGemm._ok(
        lt.cublasLtMatmulAlgoCapGetAttribute(
            ctypes.byref(algo), attr, values, written.value, ctypes.byref(written)
        )
    )
    return list(values)


def cap_int(lt, algo: Algo, attr: int) -> int:
    value, written = ctypes.c_uint32(), ctypes.c_size_t()
    status = lt.cublasLtMatmulAlgoCapGetAttribute(
        ctypes.byref(algo), attr, ctypes.byref(value), 4, ctypes.byref(written)
    )
    return value.value if status == 0 else 0


def set_config(lt, algo: Algo, attr: int, value: int, size: int = 4) -> bool:
    v = ctypes.c_uint32(value) if size == 4 else ctypes.c_uint16(value)
    return lt.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), size) == 0


def configured(lt, handle, gemm: LtGemm, base: Algo, values: dict) -> Algo | None:
    """A copy of `base` with `values` (CONFIG's names, and "cluster"), if cuBLASLt takes it for
    this GEMM within the workspace."""
    algo = Algo()
    ctypes.memmove(ctypes.byref(algo), ctypes.byref(base), ctypes.sizeof(Algo))
    for name, value in values.items():
        attr, size = (CONFIG_CLUSTER, 2) if name == "cluster" else (CONFIG[name], 4)
        if not set_config(lt, algo, attr, value, size):
            return None
    result = Heuristic()
    status = lt.cublasLtMatmulAlgoCheck(
        handle, gemm.desc, gemm.a, gemm.b, gemm.c, gemm.c, ctypes.byref(algo), ctypes.byref(result)
    )
    return algo if status == 0 and result.state == 0 and result.workspace <= WORKSPACE else None


def candidates(lt, handle, gemm: LtGemm) -> list[Algo]:
    """NVJET's configurations (tile, stages, split-K with each reduction, custom option, cluster),
    and the heuristic's 64 first with each split-K and cluster shape."""
    ids = (ctypes.c_int * 256)()
    count = ctypes.c_int()
    types = (COMPUTE_32F, R_32F, R_16BF, R_16BF, R_16BF, R_16BF)
    LtGemm._ok(lt.cublasLtMatmulAlgoGetIds(handle, *types, 256, ids, ctypes.byref(count)))
    found = []
    for algo_id in ids[: count.value]:
        base = Algo()
        # the other ids were all slower, by 1.4-2x (1xH200, 2026-12-01)
        if algo_id != NVJET or lt.cublasLtMatmulAlgoInit(handle, *types, algo_id, ctypes.byref(base)):
            continue
        mask = cap_int(lt, base, CAP_REDUCTION_MASK)
        settings = itertools.product(
            cap_array(lt, base, CAP_TILE_IDS) or [0],
            cap_array(lt, base, CAP_STAGES_IDS) or [0],
            SPLITS if cap_int(lt, base, CAP_SPLITK) else (1,),
            range(cap_int(lt, base, CAP_CUSTOM_MAX) + 1),
            CLUSTERS,
        )
        for tile, stages, split, custom, cluster in settings:
            for scheme in [s for s in (1, 2, 4) if mask & s] or [0] if split > 1 else [0]:
                values = dict(tile=tile, stages=stages, split_k=split, reduction=scheme, custom=custom)
                found.append(configured(lt, handle, gemm, base, values | {"cluster": cluster}))
    for h in gemm.heuristics(64):
        for split, cluster in itertools.product(SPLITS, range(48)):
            found.append(configured(lt, handle, gemm, h.algo, {"split_k": split, "cluster": cluster}))
    return [algo for algo in found if algo is not None]


def describe(lt, gemm: LtGemm, algo: Algo) -> dict:
    out = gemm.config(algo)
    for name, attr in (("inner", CONFIG_INNER), ("cluster", CONFIG_CLUSTER)):
        value, written = ctypes.c_uint16(), ctypes.c_size_t()
        if (
            lt.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(algo), attr, ctypes.byref(value), 2, ctypes.byref(written)
            )
            == 0
        ):
            out[name] = value.value
    return out


def quick_us(fn, iters: int = 8) -> float:
    """µs a call, `iters` calls in a CUDA graph (ctypes' launch costs the host more than the GEMM);
    infinite where cuBLASLt refuses the launch after all."""
    try:
        return time_cuda(fn, iters=iters, graph=True) * 1e6
    except RuntimeError:
        return math.inf


def search(lt, handle, m: int, k: int, n: int, final: int) -> dict:
    """torch's time, the heuristic's first, and the best configuration's (of the quick pass's
    `final` fastest, each checked against F.linear), timed with weights rotated."""
    copies = max(2, math.ceil((256 << 20) / (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    reference = F.linear(x, weights[0]).float()
    gemm = LtGemm(lt, handle, m, n, k)
    start = time.perf_counter()
    algos = candidates(lt, handle, gemm)
    quick = sorted(
        ((quick_us(lambda a=a: gemm(x, weights[0], out, a)), a) for a in algos), key=lambda t: t[0]
    )
    timed = lambda algo: rotating(lambda w: gemm(x, w, out, algo), weights) * 1e6  # noqa: E731
    heuristic = gemm.heuristics(1)[0].algo
    row = {
        "torch_us": round(rotating(lambda w: F.linear(x, w), weights) * 1e6, 2),
        "heuristic_us": round(timed(heuristic), 2),
        "heuristic": describe(lt, gemm, heuristic),
        "candidates": len(algos),
    }
    best = None
    for _, algo in quick[:final]:
        out.zero_()
        gemm(x, weights[0], out, algo)
        torch.cuda.synchronize()
        if torch.allclose(out.float(), reference, atol=2e-2, rtol=2e-2):
            us = timed(algo)
            best = (us, algo) if best is None or us < best[0] else best
    row["best_us"], row["best"] = round(best[0], 2), describe(lt, gemm, best[1])
    row["best_TFLOP_s"] = round(2 * m * n * k / best[0] / 1e6, 1)
    row["search_s"] = round(time.perf_counter() - start, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="256")
    parser.add_argument("--shapes", default="qwen3_1.7b")
    parser.add_argument("--gemms", default="qkv,o,gate_up,down")
    parser.add_argument("--final", type=int, default=12, help="the quick pass's fastest, timed again")
    args = parser.parse_args()
    torch.randn(8, 8, device="cuda") @ torch.randn(8, 8, device="cuda")  # loads cuBLAS(Lt)
    lt = load_lt()
    handle = ctypes.c_void_p()
    LtGemm._ok(lt.cublasLtCreate(ctypes.byref(handle)))
    for shape in args.shapes.split(","):
        for m in (int(r) for r in args.rows.split(",")):
            for name, (k, n) in ((g, SHAPES[shape][g]) for g in args.gemms.split(",")):
                row = {"device": torch.cuda.get_device_name(), "shape": shape, "rows": m, "gemm": name}
                print(json.dumps(row | search(lt, handle, m, k, n, args.final)), flush=True)


if __name__ == "__main__":
    main()
