"""The energy of a decode step's parts, on the GPU; prints one JSON line per part, then a summary.

At 256 rows of the Qwen3-1.7B shape an H200 decodes at its 700 W power limit: the driver lowers
the SM clock until the draw fits, so a step's time follows its energy as much as its bytes
(docs/benchmarks.md, "Rollout engine against transformers" under 1×H200). This bench says where
the joules go. Each part runs alone in a CUDA graph, repeated for `--seconds` after `--cool`
seconds idle; the energy of the loop (NVML's counter, bench/gpu_power.py) over its calls gives
the joules a call, beside the time, the mean SM clock and the share of the loop at the cap:

- the layers' four GEMMs at `--rows`, each layer with its own weight (so the L2 holds none):
  torch's `F.linear` (cuBLAS's pick, as the engine runs them past 64 rows) and, with
  `--algos N`, the first N algorithms cuBLASLt's heuristic offers (bench/decode_gemm_lt.py);
- the LM head (the tied embedding, 151,936 words);
- the decode attention over every layer's KV at `--context` (16-token pages, shuffled), at the
  engine's launch rule and at `--attention`'s settings (tile/stages/heads a program);
- the same KV bytes summed without the attention's arithmetic, streamed in order and through the
  block tables (`kv_read`: bench/hbm_read.py's kernels), the joules of the reading alone;
- the engine's whole decode step at about that context (a random model as
  bench/rollout_throughput.py writes it), whose joules the parts' sum should match.

The summary's `power_floor` adds the parts at their cheapest and divides by the power limit: the
shortest step those joules allow, and its fraction of the step's roofline (`best_fraction`).

    source .whl/install.sh && python3 bench/decode_energy.py [--shape qwen3_1.7b] [--algos 8]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_power import PowerLog
from rollout_throughput import SHAPES, bandwidth, decode_bytes, write_model

HEADS, KV_HEADS, HEAD_DIM, VOCAB, PAGE = 16, 8, 128, 151936, 16


def loop_energy(fn, seconds: float, cool: float) -> dict:
    """`fn` called for `seconds` after `cool` seconds idle: ms and mJ a call, with the power log."""
    torch.cuda.synchronize()
    time.sleep(cool)
    calls = 0
    with PowerLog(interval_ms=20) as power:
        start = time.perf_counter()
        while time.perf_counter() - start < seconds:
            for _ in range(5):
                fn()
            calls += 5
            torch.cuda.synchronize()
    log = power.summary()
    return {
        "ms": round(power.seconds / calls * 1e3, 4),
        "mJ": round(log["energy_j"] / calls * 1e3, 2) if log else None,
        "power_w": log.get("power_w_from_energy") or log.get("power_w_mean"),
        "sm_mhz": log.get("sm_mhz_mean"),
        "at_power_cap": log.get("at_power_cap"),
        "power_limit_w": log.get("power_limit_w"),
    }


def graphed(body):
    """`body` captured once in a CUDA graph (after two warm-up calls on a side stream): its replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    return graph.replay


def gemm_parts(shape: dict, rows: int, algos: int, seconds: float, cool: float) -> list[dict]:
    hidden, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    gemms = {"qkv": (hidden, qkv), "o": (HEADS * HEAD_DIM, hidden), "gate_up": (hidden, 2 * inter),
             "down": (inter, hidden)}  # fmt: skip
    lt = handle = None
    if algos:
        from decode_gemm_lt import LtGemm, load_lt

        lt, handle = load_lt(), ctypes.c_void_p()
        LtGemm._ok(lt.cublasLtCreate(ctypes.byref(handle)))
    out = []
    for name, (k, n) in [*gemms.items(), ("lm_head", (hidden, VOCAB))]:
        copies = 1 if name == "lm_head" else layers
        out += one_gemm(name, rows, k, n, copies, (lt, handle, algos), seconds, cool)
        torch.cuda.empty_cache()
    return out


def one_gemm(name: str, rows: int, k: int, n: int, copies: int, lt_algos, seconds, cool) -> list[dict]:
    """`copies` calls of X[rows, k] @ W[n, k]^T, a weight each: torch's and cuBLASLt's algorithms."""
    lt, handle, algos = lt_algos
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    flops = 2 * rows * n * k * copies
    runs = [("torch", lambda: [F.linear(x, w) for w in weights])]
    if lt is not None:
        from decode_gemm_lt import LtGemm

        gemm = LtGemm(lt, handle, rows, n, k)
        y = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
        reference = F.linear(x, weights[0]).float()
        for rank, h in enumerate(gemm.heuristics(algos)):
            gemm(x, weights[0], y, h.algo)
            if torch.allclose(y.float(), reference, atol=2e-2, rtol=2e-2):
                runs.append((f"lt{rank}", lambda a=h.algo: [gemm(x, w, y, a) for w in weights]))
    out = []
    for label, body in runs:
        row = {"part": f"gemm_{name}", "calls": copies, "algo": label}
        row |= loop_energy(graphed(body), seconds, cool)
        if row["mJ"] is not None:
            row["pJ_per_flop"] = round(row["mJ"] * 1e9 / flops, 3)
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def attention_parts(shape: dict, rows: int, context: int, specs: list[str], seconds: float, cool: float):
    from rlx.engine.triton_decode import paged_decode

    layers, per_seq = shape["num_hidden_layers"], -(-context // PAGE)
    blocks = rows * per_seq + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    caches = []
    for _ in range(layers):
        k = torch.randn(blocks, KV_HEADS, PAGE, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
        tables = torch.randperm(blocks - 1, device="cuda", generator=g)[: rows * per_seq] + 1
        caches.append((k, torch.randn_like(k), tables.view(rows, per_seq).to(torch.int32)))
    lens = torch.full((rows,), context, device="cuda", dtype=torch.int32)
    q = torch.randn(rows, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    kv_bytes = layers * 2 * rows * context * KV_HEADS * HEAD_DIM * 2
    out = []
    for spec in ["rule", *specs]:
        names = ("block_n", "num_stages", "heads_per_program")
        launch = {} if spec == "rule" else dict(zip(names, (int(v) for v in spec.split("/")), strict=True))

        def body(launch=launch):
            return [paged_decode(q, k, v, t, lens, HEAD_DIM**-0.5, **launch) for k, v, t in caches]

        row = {"part": "attention", "calls": layers, "launch": spec, "context": context}
        row |= loop_energy(graphed(body), seconds, cool)
        row["TB_s"] = round(kv_bytes / row["ms"] / 1e9, 3)
        print(json.dumps(row), flush=True)
        out.append(row)
    for how, body in kv_reads(caches, per_seq).items():
        row = {"part": "kv_read", "calls": layers, "how": how, "context": context}
        row |= loop_energy(graphed(body), seconds, cool)
        row["TB_s"] = round(kv_bytes / row["ms"] / 1e9, 3)
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def kv_reads(caches: list, per_seq: int) -> dict:
    """The same bytes as the attention's, summed without its arithmetic (bench/hbm_read.py's
    kernels): `streamed`, each layer's K and V in order (the floor any kernel reading them pays),
    and `paged`, through the block tables four heads a program as the rule reads them."""
    from hbm_read import STREAM_TILES, _paged_sum, _stream_sum

    block, iters, warps, stages = STREAM_TILES[0]
    used = [(k[1:], v[1:]) for k, v, _ in caches]  # block 0 is no row's page
    programs = used[0][0].numel() // (block * iters)
    partial = torch.empty(programs, device="cuda")
    rows = caches[0][2].shape[0]
    sums = torch.empty(rows, KV_HEADS // 4, device="cuda")

    def streamed():
        for k, v in used:
            for x in (k, v):
                _stream_sum[(programs,)](
                    x, partial, BLOCK=block, ITERS=iters, num_warps=warps, num_stages=stages
                )

    def paged():
        for k, v, tables in caches:
            _paged_sum[(rows, KV_HEADS // 4)](
                k, v, tables, sums, per_seq, tables.stride(0), k.stride(0),
                HEADS=4, PAGE=PAGE, D=HEAD_DIM, UNROLL=1, num_warps=4, num_stages=2,
            )  # fmt: skip

    return {"streamed": streamed, "paged": paged}


def engine_step(name: str, rows: int, context: int, seconds: float, cool: float) -> dict:
    from engine_step_profile import prefill_all

    from rlx.engine import Engine, EngineArgs

    path = write_model(name, Path(tempfile.mkdtemp()))
    engine = Engine(EngineArgs(
        model_path=str(path), dtype="bfloat16", context_length=4096, max_running_requests=rows,
        cuda_graph_max_bs=rows, mem_fraction_static=0.8,
    ))  # fmt: skip
    seqs = prefill_all(engine, rows)
    ahead = int(seconds * 100)  # about the steps the loop takes (under 10 ms each)
    while engine.scheduler.running[0].num_tokens < context - ahead:
        engine.step()
    first = engine.scheduler.running[0].num_tokens
    row = {"part": "engine_step"} | loop_energy(engine.step, seconds, cool)
    row["context"] = (first + engine.scheduler.running[0].num_tokens) // 2
    weights, kv_per_token = decode_bytes(engine)
    row["roofline_ms"] = round((weights + rows * row["context"] * kv_per_token) / bandwidth(
        torch.cuda.get_device_name()) * 1e3, 4)  # fmt: skip
    for seq in seqs:
        engine.abort(seq)
    engine.release_memory()
    print(json.dumps(row), flush=True)
    return row


def power_floor(rows: list[dict], step: dict) -> dict | None:
    """The step's joules with each part at its cheapest measured way, and what they allow at the
    power limit: each GEMM by its fewest-joule algorithm, the attention by the fewest of its
    launch settings' and of its KV bytes read without arithmetic (`kv_read`), the LM head; the
    norms, q/k, SwiGLU and the sampler count nothing (so the floor is low). The attention's
    joules are scaled from its context to the step's (its bytes grow with it). The floor's
    time is its joules at the limit's watts (mJ / W = ms); `best_fraction` is the step's roofline
    time over it, the most of the roofline a step can reach at those joules, beside the engine's."""
    floors: dict[str, float] = {}
    for r in rows:
        if r.get("mJ") is None:
            continue
        key, mj = r["part"], r["mJ"]
        if key in ("attention", "kv_read"):  # its bytes scaled to the step's context
            key, mj = "attention", mj * step["context"] / r["context"]
        floors[key] = min(floors.get(key, mj), mj)
    limit = max((r["power_limit_w"] for r in [*rows, step] if r.get("power_limit_w")), default=None)
    if "attention" not in floors or not limit or not step.get("roofline_ms") or not step.get("ms"):
        return None
    mj = sum(floors.values())
    return {
        "floor_mJ_by_part": floors, "floor_mJ": round(mj, 1), "power_limit_w": limit,
        "floor_ms": round(mj / limit, 4), "roofline_ms": step["roofline_ms"],
        "best_fraction": round(step["roofline_ms"] * limit / mj, 4),
        "engine_fraction": round(step["roofline_ms"] / step["ms"], 4),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3_1.7b", choices=list(SHAPES))
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--context", type=int, default=512, help="the attention's and the step's context")
    parser.add_argument("--algos", type=int, default=0, help="cuBLASLt heuristic algorithms a GEMM")
    parser.add_argument("--attention", default="64/4/1,32/2/4", help="launch settings beside the rule")
    parser.add_argument("--seconds", type=float, default=1.5)
    parser.add_argument("--cool", type=float, default=1.5, help="idle seconds before each loop")
    args = parser.parse_args()
    shape = SHAPES[args.shape]
    specs = [s for s in args.attention.split(",") if s]
    gemms = gemm_parts(shape, args.rows, args.algos, args.seconds, args.cool)
    attention = attention_parts(shape, args.rows, args.context, specs, args.seconds, args.cool)
    torch.cuda.empty_cache()
    step = engine_step(args.shape, args.rows, args.context, args.seconds, args.cool)
    torch_gemms = [r for r in gemms if r["algo"] == "torch"]
    parts = {r["part"]: r["mJ"] for r in torch_gemms} | {"attention": attention[0]["mJ"]}  # the rule
    summary = {
        "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "shape": args.shape,
        "rows": args.rows, "context": args.context, "step_mJ_by_part": parts,
        "parts_mJ": None if None in parts.values() else round(sum(parts.values()), 1),
        "engine_step_mJ": step["mJ"],
        "engine_step_context": step["context"],
        "kv_read_mJ": {r["how"]: r["mJ"] for r in attention if r["part"] == "kv_read"},
        "power_floor": power_floor(gemms + attention, step),
    }  # fmt: skip
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
