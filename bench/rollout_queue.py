"""A rollout queued past the engine's running cap, as an RL step submits it; prints JSON lines.

512 requests (prompts of 256 tokens, 64-512 new tokens drawn uniformly, ignore_eos: as EOS ends
an RL rollout's answers at different lengths) into one engine with max_running_requests 256, on
the Qwen3-0.6B and 1.7B shapes of `rollout_throughput.py` (random weights, bf16). As sequences
finish, waiting requests join. A step that admits one runs eagerly (its decodes out of their
CUDA graph); the scheduler lets them join in groups (`EngineArgs.admission_group`; default
max_running_requests // 8 with decode graphs). Each run here, in turn on one engine with the
same requests: groups of 1 (each request as its slot frees: the rule before) against the given
sizes. Per run: output tokens/s, its steps launched eagerly and as decode graphs, the decode
rows the eager steps carried, preemptions, and the fraction of a memory roofline: every decode token's K/V
context read once, plus every weight read once per step at the fewest steps (the output tokens
over the running cap), at the device's HBM bandwidth. Medians of `--turns` turns.
`--max-total-tokens N` caps the KV cache at N tokens, so that blocks, not the running cap, hold
requests back (and growing sequences preempt the newest). `--running 256,512` runs engines of
those running caps (decode graphs up to the cap, groups of 1/8 of it; `--groups` is then ignored).

    source .whl/install.sh && python3 bench/rollout_queue.py [--shapes qwen3_0.6b] [--groups 1,16,32,64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from rollout_throughput import (
    PROMPT,
    SHAPES,
    bandwidth,
    decode_bytes,
    make_engine,
    run_engine,
    warm_up,
    write_model,
)

REQUESTS, RUNNING, SEED = 512, 256, 90_000


def count_steps(runner, counts: dict) -> None:
    """Count the runner's launches into `counts`: eager steps, their decode rows, decode graphs."""
    launch_eager, launch = runner.launch_eager, runner.launch

    def eager(batch):
        counts["eager_steps"] += 1
        counts["eager_decode_rows"] += batch.num_decode
        return launch_eager(batch)

    def graph(seqs, sources):
        counts["graph_steps"] += 1
        return launch(seqs, sources)

    runner.launch_eager, runner.launch = eager, graph


def roofline_s(engine, lengths: list[int], running: int = RUNNING) -> float:
    weights, kv_per_token = decode_bytes(engine)
    context = sum(n * PROMPT + n * (n + 1) // 2 for n in lengths)  # tokens of K/V read in all
    steps = -(-sum(lengths) // running)
    return (steps * weights + context * kv_per_token) / bandwidth(torch.cuda.get_device_name())


def run_shape(root: Path, shape: str, running: int, groups: list[int], args, results: dict) -> None:
    cache = {"max_total_tokens": args.max_total_tokens} if args.max_total_tokens else {}
    caps = dict(max_running_requests=running, cuda_graph_max_bs=running)
    engine = make_engine(write_model(shape, root), **cache, **caps)
    warm_up(engine, sorted({64, 256, running}))
    counts = dict.fromkeys(("eager_steps", "eager_decode_rows", "graph_steps"), 0)
    count_steps(engine.runner, counts)
    runs = {g: [] for g in groups}
    for turn in range(args.turns):
        lengths = torch.randint(64, 513, (REQUESTS,), generator=torch.Generator().manual_seed(SEED + turn))
        lengths = lengths.tolist()
        for group in groups:
            engine.scheduler.admission_group = group
            counts.update(dict.fromkeys(counts, 0))
            preempted = engine.scheduler.num_preempted
            out = run_engine(engine, REQUESTS, new=lengths, seed=SEED + 100 * turn + group)
            runs[group].append(counts | {
                "preemptions": engine.scheduler.num_preempted - preempted,
                "tokens_per_s": out["tokens_per_s"],
                "roofline_fraction": roofline_s(engine, lengths, running) / out["wall_s"],
            })  # fmt: skip
    for group, turns in runs.items():
        entry = {"model": shape, "requests": REQUESTS, "max_running_requests": running} | cache
        entry |= {"admission_group": group, "turns": len(turns)}
        entry |= {k: round(statistics.median(t[k] for t in turns), 3) for k in turns[0]}
        results["runs"].append(entry)
        print(json.dumps(entry), flush=True)
    del engine
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--groups", default="1,32", help="admission groups run in turn (1: the rule before)")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--running", default=str(RUNNING), help="running caps, one engine each")
    parser.add_argument(
        "--max-total-tokens", type=int, help="the KV cache in tokens (default: the memory fraction's)"
    )
    args = parser.parse_args()
    groups = [int(g) for g in args.groups.split(",")]
    root = Path(tempfile.mkdtemp())
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "runs": []}
    for shape in args.shapes.split(","):
        for running in [int(r) for r in args.running.split(",")]:
            run_shape(
                root,
                shape,
                running,
                groups if args.running == str(RUNNING) else [running // 8],
                args,
                results,
            )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
