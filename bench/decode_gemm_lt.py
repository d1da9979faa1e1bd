"""The decode step's GEMMs: torch's cuBLAS pick against every algorithm cuBLASLt's heuristic offers
(up to `--top`; it offers 8 at these shapes, 1xH200), each timed in CUDA graphs, weights rotated through 256 MB of copies so
that the L2 does not hold the next call's weight (the engine reads a layer's other weights between
two calls of one GEMM). One JSON line per GEMM and per layer: torch's time, the heuristic's first
(what cuBLASLt would pick by itself), the fastest and its settings (tile, split-K, stages).

At 256 rows a 1.7B layer's GEMMs take about 1.6x the matmul ceiling's time (the profile in
docs/benchmarks.md): o_proj and down_proj (2,048 outputs) make 32 tiles of 128 x 128 for 132 SMs.
Does cuBLASLt have an algorithm that spreads them (split-K, smaller tiles) which its heuristic
does not put first? No: its picks already fill the SMs (waves about 1), and the fastest of all is
within 0-5% of torch's (docs/benchmarks.md, Decisions: "The decode GEMMs stay cuBLAS's").

    source .whl/install.sh && python3 bench/decode_gemm_lt.py [--rows 64,128,256] [--top 32]
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import math

import torch
import torch.nn.functional as F
from decode_gemm import SHAPES, sweep_layers
from engine_step_profile import time_cuda

COMPUTE_32F, R_32F, R_16BF = 68, 0, 14  # cublasComputeType_t, cudaDataType_t
DESC_TRANSA, DESC_TRANSB, OP_N, OP_T = 3, 4, 0, 1
PREF_MAX_WORKSPACE = 1
CONFIG = {"id": 0, "tile": 1, "split_k": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6}
WORKSPACE = 32 << 20


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
        ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4),
    ]  # fmt: skip


def load_lt() -> ctypes.CDLL:
    for name in ("libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("no libcublasLt (torch's CUDA build loads one: import torch and run a matmul first)")


class LtGemm:
    """Y[M, N] = X[M, K] @ W[N, K]^T in bf16 through cuBLASLt (column-major: D[N, M] = W^T' X')."""

    def __init__(self, lt: ctypes.CDLL, handle, m: int, n: int, k: int):
        self.lt, self.handle = lt, handle
        self.desc = ctypes.c_void_p()
        self._ok(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F))
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            value = ctypes.c_int32(op)
            self._ok(lt.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), 4))
        self.a, self.b, self.c = (self._layout(r, c) for r, c in ((k, n), (k, m), (n, m)))
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _ok(status: int) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLASLt status {status}")

    def _layout(self, rows: int, cols: int):
        layout = ctypes.c_void_p()
        self._ok(self.lt.cublasLtMatrixLayoutCreate(
            ctypes.byref(layout), R_16BF, ctypes.c_uint64(rows), ctypes.c_uint64(cols), ctypes.c_int64(rows)
        ))  # fmt: skip
        return layout

    def heuristics(self, top: int) -> list[Heuristic]:
        pref = ctypes.c_void_p()
        self._ok(self.lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)))
        size = ctypes.c_uint64(WORKSPACE)
        self._ok(
            self.lt.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE, ctypes.byref(size), 8)
        )
        results = (Heuristic * top)()
        count = ctypes.c_int()
        self._ok(self.lt.cublasLtMatmulAlgoGetHeuristic(
            self.handle, self.desc, self.a, self.b, self.c, self.c, pref, top, results, ctypes.byref(count)
        ))  # fmt: skip
        return [results[i] for i in range(count.value) if results[i].state == 0]

    def config(self, algo: Algo) -> dict:
        out = {}
        for name, attr in CONFIG.items():
            value, written = ctypes.c_uint32(), ctypes.c_size_t()
            status = self.lt.cublasLtMatmulAlgoConfigGetAttribute(
                ctypes.byref(algo), attr, ctypes.byref(value), 4, ctypes.byref(written)
            )
            if status == 0:
                out[name] = value.value
        return out

    def __call__(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, algo: Algo) -> None:
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self._ok(self.lt.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha), ctypes.c_void_p(w.data_ptr()), self.a,
            ctypes.c_void_p(x.data_ptr()), self.b, ctypes.byref(self.beta), ctypes.c_void_p(out.data_ptr()),
            self.c, ctypes.c_void_p(out.data_ptr()), self.c, ctypes.byref(algo),
            ctypes.c_void_p(self.workspace.data_ptr()), ctypes.c_size_t(WORKSPACE), stream,
        ))  # fmt: skip


def rotating(fn_of_w, weights: list[torch.Tensor]) -> float:
    turn = iter(range(1 << 30))
    return time_cuda(lambda: fn_of_w(weights[next(turn) % len(weights)]), iters=4 * len(weights), graph=True)


def time_gemm(lt: ctypes.CDLL, handle, m: int, k: int, n: int, *, top: int) -> dict:
    """torch's F.linear and every cuBLASLt heuristic algorithm that gives the right product, timed."""
    copies = max(2, math.ceil((256 << 20) / (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    reference = F.linear(x, weights[0]).float()
    row = {"torch_us": round(rotating(lambda w: F.linear(x, w), weights) * 1e6, 2)}
    gemm_lt = LtGemm(lt, handle, m, n, k)
    timed = []
    for rank, h in enumerate(gemm_lt.heuristics(top)):
        out.zero_()
        gemm_lt(x, weights[0], out, h.algo)
        torch.cuda.synchronize()
        if not torch.allclose(out.float(), reference, atol=2e-2, rtol=2e-2):
            continue
        us = rotating(lambda w, a=h.algo: gemm_lt(x, w, out, a), weights) * 1e6
        timed.append((us, rank, gemm_lt.config(h.algo), h.waves))
    first = min(timed, key=lambda t: t[1])
    best = min(timed, key=lambda t: t[0])
    row.update({
        "lt_first_us": round(first[0], 2), "lt_first": first[2],
        "lt_best_us": round(best[0], 2), "lt_best_rank": best[1], "lt_best": best[2],
        "lt_best_waves": round(best[3], 2), "algos": len(timed),
        "torch_TB_s": round(k * n * 2 / row["torch_us"] / 1e6, 2),
        "best_TB_s": round(k * n * 2 / best[0] / 1e6, 2),
        "best_TFLOP_s": round(2 * m * n * k / best[0] / 1e6, 1),
    })  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="64,128,256")
    parser.add_argument("--top", type=int, default=32, help="heuristic results to time a shape")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    torch.randn(8, 8, device="cuda") @ torch.randn(8, 8, device="cuda")  # loads cuBLAS(Lt)
    lt = load_lt()
    handle = ctypes.c_void_p()
    LtGemm._ok(lt.cublasLtCreate(ctypes.byref(handle)))
    rows = [int(r) for r in args.rows.split(",")]
    measure = functools.partial(time_gemm, lt, handle, top=args.top)
    sweep_layers(
        "decode_gemm_lt", args.shapes.split(","), rows, measure, ("torch_us", "lt_first_us", "lt_best_us")
    )


if __name__ == "__main__":
    main()
