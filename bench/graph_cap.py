"""What the largest decode graph (`cuda_graph_max_bs`) and the running cap cost and give: one JSON
line per (shape, cap), on the GPU.

An engine runs up to `max_running_requests` sequences at once; a decode step of more rows than
its largest CUDA graph runs eagerly (hundreds of kernel launches, no step queued behind it).
`LocalLauncher.engine_args_for_batch` sizes both to an engine's share of a step's samples. Per
random bf16 Qwen3 shape (`rollout_throughput.write_model`) and cap, a fresh engine at 1,024
running requests (`--running`; one value a cap, or one for all) and a rollout of `--requests`:

- `capture_s`, `graphs`: the whole ladder captured (`DecodeGraphs.capture`), largest first;
- `pool_gb`: memory allocated by that capture (the graphs' pool), `logits_gb`: the logits buffer
  every graph writes (allocated with the graphs, before any capture);
- `fixed`: the requests' prompts of 256 tokens, `--new` new tokens each (wall seconds, decode
  tokens/s: from the step where every request has its first token, so queued requests count);
- `varied`: the same number of prompts, 16 to `--new` new tokens each (wall seconds, tokens/s), as a rollout's
  batch shrinks while its answers finish.

Caps alternate in the order given (`--caps 512,1024,512,1024`), each in a new engine, one process.

    source .whl/install.sh && python3 bench/graph_cap.py [--shapes qwen3_0.6b,qwen3_1.7b] [--caps 512,1024]
    python3 bench/graph_cap.py --requests 2048 --caps 1024,2048 --running 1024,2048   # a larger running cap
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from rollout_throughput import PROMPT, make_engine, run_engine, write_model


def measure(path: Path, cap: int, new: int, running: int, requests: int) -> dict:
    engine = make_engine(
        path, context_length=PROMPT + new + 16, max_running_requests=running, cuda_graph_max_bs=cap
    )
    graphs = engine.runner.graphs
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    graphs.capture()
    torch.cuda.synchronize()
    out = {
        "cap": cap,
        "running": running,
        "requests": requests,
        "capture_s": round(time.perf_counter() - start, 2),
        "graphs": len(graphs.graphs),
        "pool_gb": round((torch.cuda.memory_allocated() - before) / 1e9, 3),
        "logits_gb": round(graphs.logits.nbytes / 1e9, 3),
    }
    run_engine(engine, requests, new=4, seed=999)  # the prefill's kernels compiled
    fixed = run_engine(engine, requests, new=new, seed=1)
    lengths = torch.randint(16, new + 1, (requests,), generator=torch.Generator().manual_seed(7)).tolist()
    varied = run_engine(engine, requests, new=lengths, seed=2)
    out["fixed"] = {
        "wall_s": round(fixed["wall_s"], 3),
        "decode_tokens_per_s": round(fixed["decode_tokens_per_s"]),
    }
    out["varied"] = {"wall_s": round(varied["wall_s"], 3), "tokens_per_s": round(varied["tokens_per_s"])}
    engine.release_memory()
    del engine, graphs
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="qwen3_0.6b,qwen3_1.7b")
    parser.add_argument("--caps", default="512,1024,512,1024", help="cuda_graph_max_bs values, in turn")
    parser.add_argument("--new", type=int, default=256, help="new tokens a request (the varied: 16 to this)")
    parser.add_argument("--running", default="1024", help="max_running_requests, one a cap or one for all")
    parser.add_argument("--requests", type=int, default=1024, help="requests a rollout")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    device = torch.cuda.get_device_name()
    for name in args.shapes.split(","):
        path = write_model(name, root)
        caps = [int(c) for c in args.caps.split(",")]
        running = [int(r) for r in args.running.split(",")]
        for cap, run in zip(caps, running * len(caps) if len(running) == 1 else running, strict=True):
            row = measure(path, cap, args.new, run, args.requests)
            print(json.dumps({"device": device, "shape": name, **row}), flush=True)


if __name__ == "__main__":
    main()
