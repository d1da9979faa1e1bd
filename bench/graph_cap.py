"""What the largest decode graph (`cuda_graph_max_bs`) costs and gives at a running cap of 1,024:
one JSON line per (shape, cap), on the GPU.

An engine runs up to `max_running_requests` sequences at once; a decode step of more rows than
its largest CUDA graph runs eagerly (hundreds of kernel launches, no step queued behind it).
`LocalLauncher.engine_args_for_batch` sizes both to an engine's share of a step's samples. Per
random bf16 Qwen3 shape (`rollout_throughput.write_model`) and cap, a fresh engine at 1,024
running requests:

- `capture_s`, `graphs`: the whole ladder captured (`DecodeGraphs.capture`), largest first;
- `pool_gb`: memory allocated by that capture (the graphs' pool), `logits_gb`: the logits buffer
  every graph writes (allocated with the graphs, before any capture);
- `fixed`: 1,024 prompts of 256 tokens, `--new` new tokens each (wall seconds, decode tokens/s);
- `varied`: 1,024 prompts, 16 to `--new` new tokens each (wall seconds, tokens/s), as a rollout's
  batch shrinks while its answers finish.

Caps alternate in the order given (`--caps 512,1024,512,1024`), each in a new engine, one process.

    source .whl/install.sh && python3 bench/graph_cap.py [--shapes qwen3_0.6b,qwen3_1.7b] [--caps 512,1024]
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
import time
from pathlib import Path

import torch
from rollout_throughput import PROMPT, run_engine, write_model

RUNNING = 1024


def measure(path: Path, cap: int, new: int) -> dict:
    from rlx.engine import Engine, EngineArgs

    engine = Engine(EngineArgs(
        model_path=str(path), dtype="bfloat16", context_length=PROMPT + new + 16,
        max_running_requests=RUNNING, cuda_graph_max_bs=cap, mem_fraction_static=0.8,
    ))  # fmt: skip
    graphs = engine.runner.graphs
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    graphs.capture()
    torch.cuda.synchronize()
    out = {
        "cap": cap,
        "capture_s": round(time.perf_counter() - start, 2),
        "graphs": len(graphs.graphs),
        "pool_gb": round((torch.cuda.memory_allocated() - before) / 1e9, 3),
        "logits_gb": round(graphs.logits.nbytes / 1e9, 3),
    }
    run_engine(engine, RUNNING, new=4, seed=999)  # the prefill's kernels compiled
    fixed = run_engine(engine, RUNNING, new=new, seed=1)
    lengths = torch.randint(16, new + 1, (RUNNING,), generator=torch.Generator().manual_seed(7)).tolist()
    varied = run_engine(engine, RUNNING, new=lengths, seed=2)
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
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    device = torch.cuda.get_device_name()
    for name in args.shapes.split(","):
        path = write_model(name, root)
        for cap in (int(c) for c in args.caps.split(",")):
            print(json.dumps({"device": device, "shape": name, **measure(path, cap, args.new)}), flush=True)


if __name__ == "__main__":
    main()
