"""The same seeded run in rollout.mode=sync and rollout.mode=async: step time and reward.

    python bench/async_vs_sync.py                                  # CPU, the default job, 60 steps
    python bench/async_vs_sync.py --steps 100 rollout.max_staleness=2
    python bench/async_vs_sync.py cluster.gpus_per_node=2 cluster.num_rollout_gpus=1 ...   # split GPUs

Both runs use the decoupled objective (algo.use_tis=true), so they differ only in the mode.
Prints one JSON line: per mode the median step time (step 0, start-up, left out), the total
wall time of the steps, the mean reward of the last 5 steps, the trainer's and the engines' idle
fractions (async); and the ratio async / sync of the median step time. Record the figures with
machine, date and command in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from rlx.config.compose import compose
from rlx.runtime import run


def _one(mode: str, steps: int, overrides: list[str], history_dir: Path | None = None) -> dict:
    with tempfile.TemporaryDirectory() as out:
        history = run(
            compose([f"run.output_dir={out}", f"run.num_rollout={steps}", "run.progress=false",
                     "run.loggers=[jsonl]", "run.dump_rollouts=false", "algo.use_tis=true",
                     f"rollout.mode={mode}", *overrides])
        )  # fmt: skip
    if history_dir is not None:  # every step's metrics, for what the medians hide
        history_dir.mkdir(parents=True, exist_ok=True)
        (history_dir / f"{mode}.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))

    def median(key: str) -> float | None:  # None where the run never logged `key`
        values = [h[key] for h in history[1:] if key in h]
        return statistics.median(values) if values else None

    result = {
        "median_step_s": median("time/step_s"),
        "steps_wall_s": sum(h["time/step_s"] for h in history),
        "median_train_s": median("time/train_s"),
        "median_weight_sync_s": median("time/weight_sync_s"),
        "reward_first5": statistics.mean(h["rollout/reward_mean"] for h in history[:5]),
        "reward_last5": statistics.mean(h["rollout/reward_mean"] for h in history[-5:]),
    }
    if mode == "async":
        keys = ("async/trainer_idle_frac", "async/rollout_idle_frac", "async/overlap_frac", "time/rollout_s",
                "time/weight_load_overlapped_s")  # fmt: skip
        for key in keys:  # time/weight_load_overlapped_s: only with a disk sync that overlaps
            if (value := median(key)) is not None:
                result["median_" + key.replace("/", "_")] = value
    else:
        result["median_rollout_s"] = median("time/rollout_s")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--history-dir", type=Path, help="write each mode's per-step metrics here (MODE.jsonl)"
    )
    parser.add_argument("overrides", nargs="*", help="config overrides for both runs")
    args = parser.parse_args()
    sync = _one("sync", args.steps, args.overrides, args.history_dir)
    print(json.dumps({"sync": sync}), file=sys.stderr, flush=True)  # kept if the async run fails
    asynchronous = _one("async", args.steps, args.overrides, args.history_dir)
    print(
        json.dumps(
            {
                "steps": args.steps,
                "overrides": args.overrides,
                "sync": sync,
                "async": asynchronous,
                "step_time_ratio": asynchronous["median_step_s"] / sync["median_step_s"],
                "wall_ratio": asynchronous["steps_wall_s"] / sync["steps_wall_s"],
            }
        )
    )


if __name__ == "__main__":
    main()
