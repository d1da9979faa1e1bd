"""Which of cuBLAS's decode GEMM kernels wait for the kernel before them (`griddepcontrol.wait`),
and what a CUDA graph's programmatic edges into those would save; one JSON line each, on the GPU.

The engine's Triton kernels run under programmatic dependent launch (rlx/engine/pdl.py), cuBLAS's
GEMMs do not: in a rollout's decode step the GPU idles about 0.14 ms at batch 64 in gaps under 5
µs between kernels (docs/benchmarks.md). A captured graph's edge into a kernel node can be made
programmatic (CUDA 12.3+ edge data: from port `CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC`, type
`CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC`), so that the kernel launches before the one ahead has
finished; that is safe only for a kernel that waits before it reads. Here, through the driver
API on the graph that `torch.cuda.CUDAGraph(keep_graph=True)` keeps:

1. `stale`: a graph [late writer -> consumer]. The writer lets its dependents launch at once,
   spins SPIN_NS, then writes X = v (v new each replay); with the edge made programmatic a
   consumer that does not wait reads the previous replay's X. A Triton copy without a wait is
   the control (it must read stale data); then `F.linear` at the decode shapes, by the kernel
   cuBLAS picks (`stale_rounds` of ROUNDS: ROUNDS, it does not wait; 0, no stale read seen).
2. `timing`: bench/decode_gemm_pdl.py's chain (28 layers' norms, SwiGLU and GEMMs, attention left
   out) in one graph, the edges into the kernels that waited in (1) made programmatic, against
   the same graph as captured; outputs compared bit for bit.

Measured (1×H200, 2026-11-29, torch 2.11 + CUDA 13; docs/benchmarks.md, Decisions): two of the
six kernels do not wait (`nvjet_sm90_tst_48x64_64x15_4x1_v_bz_TNN` at 64 × 1024 -> 4096,
`..._64x8_64x16_1x2_h_bz_TNT` at 64 × 2048 -> 1024: stale in 20 of 20 rounds); with edges into
the four that passed, the 1.7B chain at 64 rows took 48.6 -> 46.8 µs a layer but its output
changed (max abs diff 1.5, where the graph as captured repeats itself bit for bit): a race the
probe in (1) does not see. The 0.6B at 64 rows 31.0-31.9 -> 30.2-30.5, the 1.7B at 256 59.5-59.9
-> 59.2-59.3, both bit for bit; at 128 rows cuBLAS picks none of the four.

    source .whl/install.sh && python3 bench/cublas_pdl_edges.py
"""

from __future__ import annotations

import ctypes
import json
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from decode_gemm_pdl import SHAPES, chain, layers_for
from engine_step_profile import time_cuda
from triton.language.extra import cuda as tlc

SPIN_NS, ROUNDS = 30_000, 20
DECODE_SHAPES = [(64, 1024, 4096), (64, 2048, 1024), (64, 3072, 1024), (64, 2048, 12288), (64, 6144, 2048),
                 (256, 2048, 12288)]  # fmt: skip
_cu = None


def driver():
    global _cu
    if _cu is None:
        _cu = ctypes.CDLL("libcuda.so.1")
    return _cu


class EdgeData(ctypes.Structure):  # CUgraphEdgeData
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]  # fmt: skip


class KernelParams(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
    _fields_ = [("func", ctypes.c_void_p)] + [(n, ctypes.c_uint) for n in ("gx", "gy", "gz", "bx", "by", "bz", "smem")] + [
        ("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)
    ]  # fmt: skip


def check(rc: int, what: str) -> None:
    if rc != 0:
        name = ctypes.c_char_p()
        driver().cuGetErrorName(rc, ctypes.byref(name))
        raise RuntimeError(f"{what}: CUresult {rc} ({name.value})")


def kernel_names(graph: int) -> dict[int, str]:
    """{node: its kernel's name} for the kernel nodes of a CUgraph."""
    cu, n = driver(), ctypes.c_size_t(0)
    check(cu.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(n)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * n.value)()
    check(cu.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(n)), "cuGraphGetNodes")
    names = {}
    for node in nodes:
        kind = ctypes.c_int(-1)
        check(cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value != 0:  # CU_GRAPH_NODE_TYPE_KERNEL
            continue
        params, name = KernelParams(), ctypes.c_char_p()
        check(cu.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(params)), "kernel params")
        if params.func:
            check(cu.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)), "cuFuncGetName")
        else:
            check(cu.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern)), "cuKernelGetName")
        names[node] = name.value.decode()
    return names


def make_programmatic(graph: int, into) -> list[str]:
    """Every plain kernel -> kernel edge of `graph` whose target kernel's name passes `into`, made
    programmatic; the targets' names."""
    cu, n = driver(), ctypes.c_size_t(0)
    names = kernel_names(graph)
    check(cu.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(n)), "cuGraphGetEdges")
    frm, to, data = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)(), (EdgeData * n.value)()
    check(cu.cuGraphGetEdges_v2(ctypes.c_void_p(graph), frm, to, data, ctypes.byref(n)), "cuGraphGetEdges")
    done = []
    for a, b, d in zip(frm, to, data, strict=True):
        if d.type != 0 or a not in names or b not in names or not into(names[b]):
            continue
        one = ctypes.c_size_t(1)
        args = (ctypes.c_void_p(graph), ctypes.byref(ctypes.c_void_p(a)), ctypes.byref(ctypes.c_void_p(b)))
        check(cu.cuGraphRemoveDependencies_v2(*args, ctypes.byref(d), one), "cuGraphRemoveDependencies")
        programmatic = EdgeData(from_port=1, to_port=0, type=1)
        check(cu.cuGraphAddDependencies_v2(*args, ctypes.byref(programmatic), one), "cuGraphAddDependencies")
        done.append(names[b])
    return done


@triton.jit
def _late_writer(X, V, N, SPIN_NS, BLOCK: tl.constexpr):
    """Lets the next kernel launch at once, then waits SPIN_NS, then writes X[:] = V[0]."""
    tlc.gdc_launch_dependents()
    start = tlc.globaltimer()
    while tlc.globaltimer() - start < SPIN_NS:
        pass
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(V)
    tl.store(X + offs, (tl.zeros([BLOCK], tl.float32) + v).to(X.dtype.element_ty), mask=offs < N)


@triton.jit
def _copy_without_wait(X, Y, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < N), mask=offs < N)


def stale_rounds(consumer, x: torch.Tensor, expect, into) -> tuple[int, list[str]]:
    """(rounds of ROUNDS in which the consumer read the replay before's X, the kernels whose
    incoming edge was made programmatic)."""
    v = torch.zeros(1, device="cuda")

    def step():
        _late_writer[(triton.cdiv(x.numel(), 1024),)](x, v, x.numel(), SPIN_NS, BLOCK=1024)
        return consumer(x)

    step()  # compiled, and cuBLAS's handle made, before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        y = step()
    kernels = make_programmatic(graph.raw_cuda_graph(), into)
    graph.instantiate()
    stale = 0
    for r in range(ROUNDS):
        v.fill_(float(r % 7 + 1))
        graph.replay()
        torch.cuda.synchronize()
        stale += int(not torch.equal(y.float(), expect(float(r % 7 + 1))))
    return stale, kernels


def stale() -> dict[str, dict]:
    x = torch.zeros(64, 2048, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)

    def copy(x):
        _copy_without_wait[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
        return y

    found = {}
    rounds, _ = stale_rounds(copy, x, lambda v: torch.full(x.shape, v, device="cuda"), lambda n: "copy" in n)
    found["control: a Triton copy without a wait"] = {"stale_rounds": rounds}
    for m, k, n in DECODE_SHAPES:
        x = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.ones(n, k, device="cuda", dtype=torch.bfloat16)  # Y = v * k, exact in bf16 here
        rounds, kernels = stale_rounds(
            lambda x, w=w: F.linear(x, w), x, lambda v, m=m, n=n, k=k: torch.full((m, n), v * k, device="cuda"),
            lambda name: name.startswith("nvjet") or "cublas" in name,
        )  # fmt: skip
        found[f"{m}x{k}->{n}"] = {"kernels": kernels, "stale_rounds": rounds}  # split-K: the GEMM, its reduce
    return found


def timing(waiting: set[str]) -> list[dict]:
    rows_out = []
    for shape_name, shape in SHAPES.items():
        layers = layers_for(shape, "cuda")
        for rows in (64, 128, 256):
            residual = torch.randn(rows, shape["hidden"], device="cuda", dtype=torch.bfloat16)
            result, outputs = {"shape": shape_name, "rows": rows}, {}
            chain(layers, residual, F.linear, shape["inter"], shape["q"])  # compiled before the captures
            torch.cuda.synchronize()
            for programmatic in (False, True, False, True):
                graph = torch.cuda.CUDAGraph(keep_graph=True)
                with torch.cuda.graph(graph):
                    out = chain(layers, residual, F.linear, shape["inter"], shape["q"])
                edges = (
                    make_programmatic(graph.raw_cuda_graph(), waiting.__contains__) if programmatic else []
                )
                graph.instantiate()
                key = "programmatic" if programmatic else "as_captured"
                us = round(time_cuda(graph.replay) * 1e6 / len(layers), 2)
                result.setdefault(f"{key}_us_per_layer", []).append(us)
                result[f"{key}_edges"] = len(edges)
                outputs.setdefault(key, []).append(out.clone())
            first = outputs["as_captured"][0]
            # as captured, the graph repeats itself bit for bit; a race shows as a difference
            result["as_captured_repeats"] = torch.equal(first, outputs["as_captured"][1])
            result["bitwise_equal"] = all(torch.equal(first, o) for o in outputs["programmatic"])
            result["max_abs_diff"] = max(
                (first.float() - o.float()).abs().max().item() for o in outputs["programmatic"]
            )
            print(json.dumps(result), flush=True)
            rows_out.append(result)
    return rows_out


def main() -> None:
    start = time.perf_counter()
    name = torch.cuda.get_device_name()
    found = stale()
    print(json.dumps({"device": name, "stale": found}), flush=True)
    if found["control: a Triton copy without a wait"]["stale_rounds"] == 0:
        raise SystemExit("the control read no stale data: the programmatic edges did not launch early")
    waiting = {k for f in found.values() if f["stale_rounds"] == 0 for k in f.get("kernels", [])}
    timing(waiting)
    print(json.dumps({"bench": "cublas_pdl_edges", "device": name, "date": time.strftime("%Y-%m-%d"),
                      "wall_s": round(time.perf_counter() - start, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
