"""A learning recipe on several seeds side by side: `launch.py +experiment=NAME run.seed=S` for each
seed at once, one GPU each (round-robin over the visible GPUs; `--per-gpu 2` puts two runs on a
GPU, each engine given `--mem-fraction` of it and each run's memory plan its share of the GPU's
memory), then one JSON line per seed and a summary: the
reward's last-10 mean, best step, first step at or above `--threshold`, and the reward at steps
100 and 200.

    python3 bench/recipe_seeds.py --experiment reverse8_1gpu --seeds 1,2,3 --per-gpu 2

A seed that does not reach the threshold is a recipe to fix (issue 29: find why, change the
recipe, not the threshold); the summary's `all_reached` says whether every seed did.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shared_overrides(
    per_gpu: int, mem_fraction: float, gpu_gib: float | None, overrides: list[str]
) -> list[str]:
    """What each of `per_gpu` runs sharing one GPU is told: its engine's share of the GPU and, unless
    the overrides say it, `cluster.gpu_memory_gib` of its share, so that its memory plan (and what
    `cluster.offload_trainer=auto` decides by it) counts the part of the GPU it has, not the whole."""
    if per_gpu <= 1:
        return []
    shared = [f"+rollout.engine_args.mem_fraction_static={mem_fraction}"]
    if gpu_gib is not None and not any(o.startswith("cluster.gpu_memory_gib=") for o in overrides):
        shared.append(f"cluster.gpu_memory_gib={gpu_gib / per_gpu:.1f}")
    return shared


def summary(seed: int, metrics: Path, threshold: float) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    reward = [row["rollout/reward_mean"] for row in rows]
    if not reward:
        return {"seed": seed, "steps": 0}
    return {
        "seed": seed,
        "steps": len(reward),
        "last10_mean": round(sum(reward[-10:]) / len(reward[-10:]), 4),
        "best": round(max(reward), 4),
        "first_step_at_threshold": next((i for i, r in enumerate(reward) if r >= threshold), None),
        "reward_at": {step: round(reward[step], 4) for step in (100, 200) if step < len(reward)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experiment", default="reverse8_1gpu")
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--per-gpu", type=int, default=1, help="runs sharing one GPU")
    parser.add_argument(
        "--mem-fraction", type=float, default=0.4, help="each engine's share when runs share a GPU"
    )
    parser.add_argument("--out", default="/tmp/recipe_seeds")
    parser.add_argument("overrides", nargs="*", help="more launch.py overrides, for every seed")
    args = parser.parse_args()

    import torch

    gpus = max(1, torch.cuda.device_count())
    seeds = [int(s) for s in args.seeds.split(",")]
    if len(seeds) > gpus * args.per_gpu:
        sys.exit(f"{len(seeds)} seeds need {len(seeds)} GPUs, or --per-gpu {-(-len(seeds) // gpus)}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(gpus)))).split(",")
    gpu_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else None
    shared = shared_overrides(args.per_gpu, args.mem_fraction, gpu_gib, args.overrides)
    start, runs = time.time(), []
    for i, seed in enumerate(seeds):
        out = Path(args.out) / f"seed{seed}"
        recipe = [f"+experiment={args.experiment}"] if args.experiment else []  # "": the default job
        cmd = [sys.executable, "launch.py", *recipe, f"run.seed={seed}", f"hydra.run.dir={out}",
               "run.progress=false", *shared, *args.overrides]  # fmt: skip
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible[i // args.per_gpu]}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        log = open(Path(args.out) / f"seed{seed}.log", "w")  # noqa: SIM115 (open while the run lives)
        runs.append(
            (seed, out, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        )
    results = []
    for seed, out, proc in runs:
        rc = proc.wait()
        results.append(summary(seed, out / "metrics.jsonl", args.threshold) | {"rc": rc})
        print(json.dumps(results[-1]), flush=True)
    reached = [r.get("first_step_at_threshold") is not None for r in results]
    print(json.dumps({
        "experiment": args.experiment, "threshold": args.threshold, "all_reached": all(reached),
        "reached": f"{sum(reached)}/{len(reached)}", "wall_s": round(time.time() - start, 1),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "per_gpu": args.per_gpu,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
