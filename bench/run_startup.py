"""Where a short run's wall time goes outside its steps: start-up phase by phase, the steps, the close.

    python bench/run_startup.py run.num_rollout=3                          # CPU, the default job
    python bench/run_startup.py --runs 2 cluster=1gpu run.num_rollout=3    # 1 GPU, colocated; twice
    python bench/run_startup.py --runs 2 --shared-ray cluster=1gpu run.num_rollout=3   # Ray up before

Each run is timed by wrapping the loop's parts (`rlx.runtime`'s preparation, Ray, the trainer's
set-up, the engines' start, the colocated hand-over before it, the weight publisher, the close
and the parts of the close); the steps are the run's own `time/*` metrics. `--runs N` repeats the
run in this process: the first pays for cold caches (Triton's, torch.compile's), the later ones
show what the next run of a test session pays. `--shared-ray`: Ray is started once before the runs
(as a test session's is) and each run finds it up. Prints a table per run and one JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
import tempfile
import time

PARTS = [  # (owner, attribute, label); nested calls are indented by depth
    ("rlx.runtime", "_prepare", "prepare (config, checkpoint, data)"),
    ("rlx.launcher.ray_start", "connect", "Ray"),
    ("rlx.runtime", "_start", "start"),
    ("rlx.trainer.group.TrainerGroup", "start", "trainer ranks set up"),
    ("rlx.colocation.GpuTurns", "before_engines_start", "colocated: trainer leaves the GPU"),
    ("rlx.rollout.pool.RolloutPool", "__init__", "engines start"),
    ("rlx.weight_sync.publisher.WeightPublisher", "__init__", "weight publisher"),
    ("rlx.runtime", "_finish", "finish"),
    ("rlx.runtime._Parts", "close", "close"),
    ("rlx.rollout.pool.RolloutPool", "shutdown", "engines stop"),
    ("rlx.trainer.group.TrainerGroup", "shutdown", "trainer ranks stop"),
    ("ray", "shutdown", "Ray shutdown"),
]
STEP_KEYS = ("time/step_s", "time/rollout_s", "time/logprobs_s", "time/train_s", "time/weight_sync_s")


def _owner(path: str):
    import importlib

    module, _, attr = path.rpartition(".")
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        return getattr(importlib.import_module(module), attr)


def instrument(events: list) -> None:
    """Record (depth, label, start, seconds) for each call of PARTS, in `events`."""
    depth = [0]

    def wrap(fn, label):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                events.append((depth[0], label, start, time.perf_counter() - start))

        return timed

    for owner, attr, label in PARTS:
        target = _owner(owner)
        setattr(target, attr, wrap(getattr(target, attr), label))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--shared-ray", action="store_true", help="start Ray once, before the runs")
    args, overrides = parser.parse_known_args()

    import ray

    from rlx.config.compose import compose
    from rlx.launcher import ray_start
    from rlx.runtime import run

    events: list = []
    instrument(events)
    # the trainer group's own split of its set-up (processes and imports; models and optimizers)
    group_log = logging.getLogger("rlx.trainer.group")
    group_log.setLevel(logging.INFO)
    group_log.addHandler(logging.StreamHandler(sys.stdout))
    if args.shared_ray:
        start = time.perf_counter()
        ray_start.start_local()
        print(f"Ray started once: {time.perf_counter() - start:.2f} s")
    results = []
    for k in range(args.runs):
        events.clear()
        with tempfile.TemporaryDirectory() as out:
            start = time.perf_counter()
            history = run(compose([f"run.output_dir={out}", "run.progress=false", *overrides]))
            wall = time.perf_counter() - start
        steps = sum(h.get("time/step_s", 0.0) for h in history)
        print(f"\nrun {k}: {wall:.2f} s, of which {len(history)} steps {steps:.2f} s")
        for depth, label, at, seconds in sorted(events, key=lambda e: e[2]):
            print(f"  {at - start:7.2f}  {'  ' * depth}{label:<40} {seconds:7.2f} s")
        first = {key: round(history[0][key], 3) for key in STEP_KEYS if key in history[0]}
        later = {key: round(history[-1][key], 3) for key in STEP_KEYS if key in history[-1]}
        print(f"  step 0: {first}\n  last step: {later}")
        parts = {label: round(seconds, 3) for _, label, _, seconds in events}
        results.append({"wall_s": round(wall, 3), "steps_s": round(steps, 3), "parts_s": parts,
                        "step0": first, "last_step": later})  # fmt: skip
    if args.shared_ray:
        ray.shutdown()
    print(json.dumps({"overrides": overrides, "shared_ray": args.shared_ray, "runs": results}))


if __name__ == "__main__":
    sys.exit(main())
