"""Two halves of a decode batch on two streams: does one half's attention overlap the other's
GEMMs? One JSON line per (shape, batch, context), on the GPU.

At batch 64 a decode step's GEMMs are latency-bound (a layer's four take 2-3× their weights'
memory time: bench/decode_gemm.py) while the paged attention streams the KV at 67-78% of the
bandwidth (docs/benchmarks.md). The halves of a batch are independent sequences, so two streams
can run a whole step each, the GPU interleaving their kernels (two-batch overlap, as in SGLang's
and NanoFlow's schedulers), at the price of reading every weight twice (the L2 may catch some:
both halves walk the layers together). Here the engine's decode layer (its Triton kernels:
add_rms_norm, qk_norm_rope_store, paged_decode, silu_mul; cuBLAS's GEMMs) over `LAYERS` layers,
LM head and sampler left out, in one CUDA graph:

- `serial`: the whole batch on one stream, as the engine runs it;
- `halves_serial`: its two halves one after the other on one stream (what splitting costs);
- `halves_overlap`: the two halves on two streams, forked and joined inside the graph;
- `halves_green_N` (`--green N`): the same, each stream of a green context of its own SMs (N and
  the rest; torch.cuda.green_contexts), so that neither half's kernels crowd out the other's.

`roofline_ms`: every weight once and every sequence's KV once at the device's bandwidth.

    source .whl/install.sh && python3 bench/decode_overlap.py [--batches 64,256] [--context 512]
"""

from __future__ import annotations

import argparse
import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from decode_gemm_pdl import LAYERS, SHAPES, layers_for, print_runs
from engine_step_profile import paged_kv, time_cuda
from torch.cuda.green_contexts import GreenContext

from rlx.engine.triton_decode import paged_decode
from rlx.engine.triton_layers import add_rms_norm, qk_norm_rope_store, silu_mul

HEAD_DIM, KV_HEADS, PAGE, EPS = 128, 8, 16, 1e-6


def make_rows(batch: int, context: int, shape: dict) -> dict:
    """The batch's inputs and one layer-shared KV cache (each layer reads it all: the cache is far
    larger than the L2, so sharing it changes no traffic)."""
    k_cache, v_cache, tables, lens = paged_kv(batch, context, KV_HEADS, HEAD_DIM, PAGE, "bhsd")
    positions = (lens - 1).long()
    last = tables.gather(1, (positions // PAGE)[:, None])[:, 0]  # this step's token's slot
    angles = torch.rand(context + 1, HEAD_DIM // 2, device="cuda") * 6
    return dict(
        residual=torch.randn(batch, shape["hidden"], device="cuda", dtype=torch.bfloat16),
        kv=(k_cache, v_cache), tables=tables, lens=lens, positions=positions,
        meta=SimpleNamespace(slot_block=last.long(), slot_offset=positions % PAGE),
        cos=torch.cat([angles.cos()] * 2, -1), sin=torch.cat([angles.sin()] * 2, -1),
    )  # fmt: skip


def half(rows: dict, part: slice) -> dict:
    out = {k: v[part] for k, v in rows.items() if isinstance(v, torch.Tensor) and k not in ("cos", "sin")}
    meta = rows["meta"]
    return (
        rows
        | out
        | {"meta": SimpleNamespace(slot_block=meta.slot_block[part], slot_offset=meta.slot_offset[part])}
    )


def step(layers: list[dict], rows: dict, shape: dict, qk_norms) -> torch.Tensor:
    """The engine's decode layers (rlx/engine/models/dense.py, forward_fused) over `rows`."""
    q_size, inter = shape["q"], shape["inter"]
    heads = q_size // HEAD_DIM
    batch = rows["residual"].shape[0]
    residual, h = rows["residual"], None
    for layer in layers:
        normed, residual = add_rms_norm(h, residual, layer["n1"], EPS)
        qkv = F.linear(normed, layer["qkv"])
        q, k, v = qkv.split([q_size, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
        q, k, v = (t.view(batch, -1, HEAD_DIM) for t in (q, k, v))
        qk_norm_rope_store(
            q, k, v, qk_norms, EPS, rows["cos"], rows["sin"], rows["positions"], rows["kv"], rows["meta"]
        )
        out = paged_decode(q, *rows["kv"], rows["tables"], rows["lens"], HEAD_DIM**-0.5)
        o = F.linear(out.view(batch, heads * HEAD_DIM), layer["o"])
        normed, residual = add_rms_norm(o, residual, layer["n2"], EPS)
        gate_up = F.linear(normed, layer["gate_up"])
        h = F.linear(silu_mul(gate_up[:, :inter], gate_up[:, inter:]), layer["down"])
    return h


def run(shape_name: str, batch: int, hbm: float, context: int, green: list[int]) -> dict:
    shape = SHAPES[shape_name]
    layers = layers_for(shape, "cuda")
    qk_norms = tuple(1 + 0.1 * torch.randn(HEAD_DIM, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    rows = make_rows(batch, context, shape)
    halves = half(rows, slice(0, batch // 2)), half(rows, slice(batch // 2, batch))
    streams = torch.cuda.Stream(), torch.cuda.Stream()

    def overlap(streams=streams):
        main = torch.cuda.current_stream()
        outs = []
        for stream, rows_half in zip(streams, halves, strict=True):
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                outs.append(step(layers, rows_half, shape, qk_norms))
        for stream in streams:
            main.wait_stream(stream)
        return outs

    variants = {
        "serial": lambda: step(layers, rows, shape, qk_norms),
        "halves_serial": lambda: [step(layers, r, shape, qk_norms) for r in halves],
        "halves_overlap": overlap,
    }
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n in green:
        parts = [GreenContext.create(num_sms=n), GreenContext.create(num_sms=sms - n)]
        variants[f"halves_green_{n}"] = functools.partial(overlap, [part.Stream() for part in parts])
    result = {"shape": shape_name, "batch": batch, "context": context, "layers": LAYERS}
    for name, fn in variants.items():
        result[f"{name}_ms"] = round(time_cuda(fn, iters=5, graph=True) * 1e3, 3)
    weights = sum(t.numel() * t.element_size() for t in layers[0].values()) * LAYERS
    kv = 2 * batch * context * KV_HEADS * HEAD_DIM * 2 * LAYERS
    result["roofline_ms"] = round((weights + kv) / hbm * 1e3, 3)
    for name in variants:
        result[f"{name}_of_roofline"] = round(result["roofline_ms"] / result[f"{name}_ms"], 3)
    serial = torch.cat(variants["halves_serial"]()).float()
    for name in (n for n in variants if n.startswith("halves_") and n != "halves_serial"):
        together = torch.cat(variants[name]()).float()
        torch.cuda.synchronize()
        result[f"{name[len('halves_') :]}_equals_halves"] = bool(torch.equal(serial, together))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="64,256")
    parser.add_argument("--context", type=int, default=512, help="tokens of KV a sequence (prompt + output)")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--green", default="", help="SMs of the first half's green context (comma list)")
    args = parser.parse_args()
    green = [int(n) for n in args.green.split(",") if n]
    print_runs(
        "decode_overlap", args.shapes, args.batches, functools.partial(run, context=args.context, green=green)
    )


if __name__ == "__main__":
    main()
