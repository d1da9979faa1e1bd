"""Time the embedded default job (tiny Qwen3, GRPO, copy task) phase by phase.

    python bench/default_job.py                      # CPU, the default config
    python bench/default_job.py cluster=1gpu run.num_rollout=50

Prints wall time, median per-phase seconds, throughput, and the reward curve; record the
figures with machine and date in docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time

from rlx.config.compose import compose
from rlx.runtime import run


def main(overrides: list[str]) -> None:
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        history = run(compose([f"run.output_dir={out}", "run.progress=false", *overrides]))
        wall = time.perf_counter() - start
    median = lambda key: statistics.median(h[key] for h in history[1:])  # noqa: E731  (step 0 warms up)
    rewards = [h["rollout/reward_mean"] for h in history]
    print(f"steps {len(history)}  wall {wall:.1f} s (includes start-up)")
    for key in ("time/step_s", "time/rollout_s", "time/train_s", "time/weight_sync_s", "perf/tokens_per_s"):
        print(f"  median {key:<22} {median(key):.3f}")
    print(
        "  reward every 10 steps:", " ".join(f"{r:.2f}" for r in rewards[::10]), f"| last {rewards[-1]:.2f}"
    )
    first_08 = next((h["step"] for h in history if h["rollout/reward_mean"] >= 0.8), None)
    print(f"  first step with reward >= 0.8: {first_08}")


if __name__ == "__main__":
    main(sys.argv[1:])
