"""A decode step's GEMMs behind the kernel before each, under programmatic dependent launch (PDL);
one JSON line per (shape, rows), on the GPU.

The engine launches its Triton kernels under PDL (rlx/engine/pdl.py), but not cuBLAS's GEMMs:
each GEMM waits for the norm or SwiGLU ahead of it to end, then starts its weight stream, and
at 64-128 rows a layer's four GEMMs take 1.7× their weights' memory time (docs/benchmarks.md).
A GEMM of rlx's own launched under PDL can ask the L2 for its weight, which no kernel of the
step writes, before its `griddepcontrol.wait`: the weight streams in while the kernel ahead
runs. (Asking from the kernel ahead instead made that kernel last until its prefetches landed:
Decisions.) The engine now runs this GEMM (TMA tiles) for weights up to 64 MiB at up to 64 rows,
asking the L2 for those up to 16 MiB, gate_up with its SwiGLU, o and down split K
(rlx/engine/triton_gemm.py, where a rollout decided it: this bench's chain leaves attention out,
and launches each GEMM whole). Here, `LAYERS` layers' chains (distinct weights, so that no layer finds another's in
the L2) in one CUDA graph, each layer as the engine runs it with its attention left out:

    add_rms_norm -> qkv;  add_rms_norm(q part) -> o;  add_rms_norm(+ residual) -> gate_up;
    silu_mul -> down

with the GEMMs as
- `cublas`: `F.linear`, as the engine runs them;
- `triton`: the engine's Triton GEMM (all rows in one tile, a program a column tile; its launch
  settings the fastest of a small sweep, timed alone) launched under PDL;
- `triton_prefetch`: the same, with each program's weight rows (contiguous) asked of the L2
  before the wait;
- `triton_prefetch_{qkv,o,gate_up,down}_only`: that GEMM prefetching, cuBLAS for the others
  (`gain_us`: what each GEMM gains so, a layer);
- `none`: no GEMM (the kernels ahead alone), subtracted from the others: `*_gemm_us` per layer.
Every variant's last output is checked against cuBLAS's (`max_rel_diff`). At split 1 a GEMM of
few column tiles (o, down) leaves SMs idle; where its `gain_us` is negative, cuBLAS stays.

    source .whl/install.sh && python3 bench/decode_gemm_pdl.py [--rows 64,128] [--shapes qwen3_1.7b]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F
import triton
from engine_step_profile import time_cuda
from rollout_throughput import bandwidth

from rlx.engine.triton_gemm import small_gemm
from rlx.engine.triton_layers import add_rms_norm, silu_mul

LAYERS = 28
SHAPES = {  # hidden, query heads × head dim, q + k + v outputs, intermediate
    "qwen3_1.7b": dict(hidden=2048, q=2048, qkv=4096, inter=6144),
    "qwen3_0.6b": dict(hidden=1024, q=2048, qkv=4096, inter=3072),
}


def pdl_gemm(x, w, setting: dict, prefetch: bool, swiglu: bool = False) -> torch.Tensor:
    """The engine's small GEMM (rlx/engine/triton_gemm.py) under PDL, its weight asked of the L2
    before the wait where `prefetch`."""
    return small_gemm(x, w, None, setting | {"prefetch": prefetch}, swiglu=swiglu)


def layers_for(shape: dict, device) -> list[dict]:
    """LAYERS layers' weights: the four GEMMs' ([N, K], bf16) and the three norms'."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*size, scale=0.02):
        return torch.randn(*size, generator=g, device=device, dtype=torch.bfloat16) * scale

    h, q, qkv, inter = shape["hidden"], shape["q"], shape["qkv"], shape["inter"]

    def layer():
        gemms = dict(qkv=randn(qkv, h), o=randn(h, q), gate_up=randn(2 * inter, h), down=randn(h, inter))
        return gemms | dict(n1=1 + randn(h), nq=1 + randn(q), n2=1 + randn(h))

    return [layer() for _ in range(LAYERS)]


def chain(layers: list[dict], residual: torch.Tensor, gemm, inter: int, q: int) -> torch.Tensor:
    """The layers' kernels in the engine's order, attention left out; `gemm(x, w)`."""
    h = None
    for layer in layers:
        normed, residual = add_rms_norm(h, residual, layer["n1"], 1e-6)
        qkv = gemm(normed, layer["qkv"])
        normed_q, _ = add_rms_norm(None, qkv[:, :q], layer["nq"], 1e-6)  # attention's stand-in
        o = gemm(normed_q, layer["o"])
        normed, residual = add_rms_norm(o, residual, layer["n2"], 1e-6)
        gate_up = gemm(normed, layer["gate_up"])
        h = gemm(silu_mul(gate_up[:, :inter], gate_up[:, inter:]), layer["down"])
    return h


def best_setting(x_rows: int, layers: list[dict], name: str) -> dict:
    """The fastest launch setting of `pdl_gemm` for one GEMM alone (no prefetch), cycling over the
    layers' weights in a CUDA graph."""
    best, best_us = None, float("inf")
    k = layers[0][name].shape[1]
    x = torch.randn(x_rows, k, device="cuda", dtype=torch.bfloat16)
    reference = F.linear(x, layers[0][name]).float()
    for block_n, block_k, stages, warps in itertools.product((16, 32, 64, 128), (64, 128), (4, 6), (4,)):
        setting = dict(block_n=block_n, block_k=block_k, num_stages=stages, num_warps=warps)
        try:
            got = pdl_gemm(x, layers[0][name], setting, prefetch=False).float()
        except (triton.runtime.errors.OutOfResources, AssertionError):
            continue
        if (got - reference).abs().max().item() > 0.02 * reference.abs().max().item():
            continue
        turn = itertools.cycle(layers)
        call = lambda turn=turn, setting=setting: pdl_gemm(x, next(turn)[name], setting, False)  # noqa: E731
        us = time_cuda(call, graph=True) * 1e6
        if us < best_us:
            best, best_us = setting, us
    return best


def run(shape_name: str, rows: int, hbm: float) -> dict:
    shape = SHAPES[shape_name]
    layers = layers_for(shape, "cuda")
    settings = {name: best_setting(rows, layers, name) for name in ("qkv", "o", "gate_up", "down")}
    by_w = {layer[name].data_ptr(): name for layer in layers for name in settings}
    residual = torch.randn(rows, shape["hidden"], device="cuda", dtype=torch.bfloat16)
    spare = {}  # `none`: a product of the right shape, not computed

    def none(x, w):
        key = (x.shape[0], w.shape[0])
        if key not in spare:
            spare[key] = torch.zeros(key, device="cuda", dtype=torch.bfloat16)
        return spare[key]

    def triton(only: str | None = None, prefetch: bool = True):
        """Triton GEMMs under PDL (for the GEMM named `only`, cuBLAS for the others)."""

        def gemm(x, w):
            name = by_w[w.data_ptr()]
            if only is not None and name != only:
                return F.linear(x, w)
            return pdl_gemm(x, w, settings[name], prefetch=prefetch)

        return gemm

    variants = {
        "cublas": F.linear,
        "triton": triton(prefetch=False),
        "triton_prefetch": triton(),
        "none": none,
    }
    variants |= {f"triton_prefetch_{name}_only": triton(only=name) for name in settings}
    result = {"shape": shape_name, "rows": rows, "layers": LAYERS, "settings": settings}
    outputs = {}
    for name, gemm in variants.items():
        step = lambda gemm=gemm: chain(layers, residual, gemm, shape["inter"], shape["q"])  # noqa: E731
        outputs[name] = step().float()
        result[f"{name}_us"] = round(time_cuda(step, iters=5, graph=True) * 1e6 / LAYERS, 2)
    for name in ("cublas", "triton", "triton_prefetch"):
        result[f"{name}_gemm_us"] = round(result[f"{name}_us"] - result["none_us"], 2)
    # what each GEMM alone gains as a prefetching Triton GEMM, among cuBLAS's others: the layer's
    # best mix is cuBLAS where this is negative
    result["gain_us"] = {
        n: round(result["cublas_us"] - result[f"triton_prefetch_{n}_only_us"], 2) for n in settings
    }
    scale = outputs["cublas"].abs().max().item()
    result["max_rel_diff"] = {
        name: round((outputs[name] - outputs["cublas"]).abs().max().item() / scale, 4)
        for name in variants
        if name.startswith("triton")
    }
    weight_bytes = sum(w.numel() * 2 for name, w in layers[0].items() if name in settings)
    result["roofline_gemm_us"] = round(weight_bytes / hbm * 1e6, 2)
    return result


def print_runs(bench: str, shapes: str, sizes: str, run) -> None:
    """One JSON line per (shape, size) of the comma lists, from `run(shape, size, hbm)`, then the
    bench's own line (bench/decode_gemm_fused.py and decode_overlap.py print theirs so too)."""
    name = torch.cuda.get_device_name()
    start = time.perf_counter()
    for shape in shapes.split(","):
        for size in (int(s) for s in sizes.split(",")):
            print(json.dumps({"device": name, **run(shape, size, bandwidth(name))}), flush=True)
            torch.cuda.empty_cache()  # the last run's layers
    print(json.dumps({"bench": bench, "device": name, "date": time.strftime("%Y-%m-%d"),
                      "wall_s": round(time.perf_counter() - start, 1)}))  # fmt: skip


def gemm_bench_main(bench: str, run, rows: str, rows_help: str) -> None:
    """A decode-GEMM bench's command line (`--rows`, `--shapes`), then `print_runs`; this bench's
    and bench/decode_gemm_fused.py's."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default=rows, help=rows_help)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    print_runs(bench, args.shapes, args.rows, run)


def main() -> None:
    gemm_bench_main("decode_gemm_pdl", run, "64,128", "decode batch sizes (GEMM rows)")


if __name__ == "__main__":
    main()
