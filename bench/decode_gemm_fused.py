"""A decode layer's GEMMs at 16-64 rows as Triton GEMMs under PDL (bench/decode_gemm_pdl.py's),
SwiGLU inside the gate_up GEMM, against cuBLAS's; one JSON line per (shape, rows), on the GPU.
Whether the engine should run them so (docs/benchmarks.md, Decisions).

`LAYERS` layers (distinct weights, so that no layer finds another's in the L2) in one CUDA graph,
attention left out (a norm of the q part stands in for it, as in bench/decode_gemm_pdl.py):

- `cublas`: add_rms_norm -> qkv; o; add_rms_norm -> gate_up; silu_mul -> down (`F.linear`);
- `triton`: the same kernels with Triton GEMMs launched by the engine's settings (`rule`);
- `swiglu`: as `triton`, SwiGLU in the gate_up GEMM (eight kernels of nine);
- `swiglu_best`: the same with each GEMM's best setting of the sweep;
- `none`: the kernels other than the GEMMs alone, subtracted from the others' `*_gemm_us`.

First each GEMM's launch settings are swept alone (`sweep`: microseconds a call, cycling over the
layers' weights in a graph; `default_us`: the rule's). `max_rel_diff`: each chain's output
against cuBLAS's, relative to its largest magnitude.

    source .whl/install.sh && python3 bench/decode_gemm_fused.py [--rows 16,32,64] [--shapes qwen3_1.7b]
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
import triton
from decode_gemm_pdl import LAYERS, SHAPES, gemm_bench_main, layers_for, pdl_gemm
from engine_step_profile import time_cuda

from rlx.engine.triton_gemm import small_gemm_settings, small_swiglu_settings
from rlx.engine.triton_layers import add_rms_norm, silu_mul

EPS = 1e-6
SHAPES = SHAPES | {"llama3_8b": dict(hidden=4096, q=4096, qkv=6144, inter=14336)}
ROLES = {  # role: (weight, SwiGLU)
    "qkv": ("qkv", False),
    "o": ("o", False),
    "gate_up": ("gate_up", False),
    "gate_up_swiglu": ("gate_up", True),
    "down": ("down", False),
}


def rule(n: int, k: int, swiglu: bool) -> dict:
    """One launch setting by shape: the engine's (rlx/engine/triton_gemm.py), whole K."""
    return (small_swiglu_settings if swiglu else small_gemm_settings)(n, k)


def decode_gemm(x, w, swiglu: bool, setting: dict | None) -> torch.Tensor:
    """Under PDL, with `setting` (None: `rule`'s)."""
    n, k = w.shape[0] // (2 if swiglu else 1), w.shape[1]
    return pdl_gemm(x, w, setting or rule(n, k, swiglu), prefetch=False, swiglu=swiglu)


def sweep(rows: int, layers: list[dict]) -> dict:
    """Each role's settings timed alone: {role: {"best": setting, "us": ..., "default_us": ...}}."""
    result = {}
    for role, (name, swiglu) in ROLES.items():
        n = layers[0][name].shape[0] // (2 if swiglu else 1)
        k = layers[0][name].shape[1]
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        timed = {}
        for block_n, block_k, stages in itertools.product((16, 32, 64), (64, 128, 256), (3, 4, 6)):
            setting = dict(block_n=block_n, block_k=block_k, num_stages=stages, num_warps=4)
            if n % block_n or k % block_k:
                continue
            try:
                decode_gemm(x, layers[0][name], swiglu, setting)
            except triton.runtime.errors.OutOfResources:
                continue

            turn = itertools.cycle(layers)

            def fn(turn=turn, s=setting, x=x, name=name, swiglu=swiglu):
                return decode_gemm(x, next(turn)[name], swiglu, s)

            timed[tuple(setting.items())] = time_cuda(fn, graph=True) * 1e6
        best = min(timed, key=timed.get)
        default = tuple(rule(n, k, swiglu).items())
        result[role] = {
            "best": dict(best),
            "us": round(timed[best], 2),
            "default_us": round(timed.get(default, -1), 2),
        }
    return result


def chain(layers, residual, shape: dict, variant: str, settings: dict | None) -> torch.Tensor:
    """The layers' kernels in the engine's order, attention left out; `settings` None: `rule`'s."""
    inter, q = shape["inter"], shape["q"]
    h = None
    for layer in layers:

        def gemm(x, role, layer=layer):
            name, swiglu = ROLES[role]
            if variant == "cublas":
                return F.linear(x, layer[name])
            if variant == "none":
                return x.new_zeros(x.shape[0], layer[name].shape[0])
            return decode_gemm(x, layer[name], swiglu, settings and settings[role])

        normed, residual = add_rms_norm(h, residual, layer["n1"], EPS)
        qkv = gemm(normed, "qkv")
        normed_q, _ = add_rms_norm(None, qkv[:, :q], layer["nq"], EPS)  # attention's stand-in
        o = gemm(normed_q, "o")
        normed, residual = add_rms_norm(o, residual, layer["n2"], EPS)
        if variant.startswith("swiglu"):
            act = gemm(normed, "gate_up_swiglu")
        else:
            gate_up = gemm(normed, "gate_up")
            act = silu_mul(gate_up[:, :inter], gate_up[:, inter:])
        h = gemm(act, "down")
    return h


def run(shape_name: str, rows: int, hbm: float) -> dict:
    shape = SHAPES[shape_name]
    layers = layers_for(shape, "cuda")
    swept = sweep(rows, layers)
    best = {role: s["best"] for role, s in swept.items()}
    residual = torch.randn(rows, shape["hidden"], device="cuda", dtype=torch.bfloat16)
    result = {"shape": shape_name, "rows": rows, "layers": LAYERS, "sweep": swept}
    outputs = {}
    variants = {"cublas": None, "triton": None, "swiglu": None, "swiglu_best": best, "none": None}
    for variant, settings in variants.items():
        version = variant.removesuffix("_best")
        step = lambda v=version, s=settings: chain(layers, residual, shape, v, s)  # noqa: E731
        outputs[variant] = step().float()
        result[f"{variant}_us"] = round(time_cuda(step, iters=5, graph=True) * 1e6 / LAYERS, 2)
    for name in ("cublas", "triton", "swiglu", "swiglu_best"):
        result[f"{name}_gemm_us"] = round(result[f"{name}_us"] - result["none_us"], 2)
    scale = outputs["cublas"].abs().max().item()
    result["max_rel_diff"] = {
        name: round((outputs[name] - outputs["cublas"]).abs().max().item() / scale, 4)
        for name in ("triton", "swiglu", "swiglu_best")
    }
    weight_bytes = sum(layers[0][n].numel() * 2 for n in ("qkv", "o", "gate_up", "down"))
    result["roofline_gemm_us"] = round(weight_bytes / hbm * 1e6, 2)
    return result


def main() -> None:
    gemm_bench_main("decode_gemm_fused", run, "16,32,64", "decode batch sizes (GEMM rows, at most 64)")


if __name__ == "__main__":
    main()
