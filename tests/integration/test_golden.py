"""The golden curve: a seeded 10-step CPU run of the default job reproduces its recorded per-step
`train/loss`, `train/grad_norm` and `rollout/reward_mean`, so a refactor proves it changed nothing.

Every sample is drawn with its own seed (from run seed, step, group, index), so the run does not
depend on how the engine batched requests. Tolerance: relative 1e-4 on loss and grad norm (float
summation order may differ across CPUs and thread counts), exact to 1e-9 on rewards (a reward
moves only if a sampled token does, which is the change this test exists to catch).

A change that is meant to alter the run (a new sampler, another default) re-records the file:
    RLX_CACHE=$(mktemp -d) python tests/integration/test_golden.py --record
and says so in its commit.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "default_job_10_steps.json"
KEYS = ("train/loss", "train/grad_norm", "rollout/reward_mean")
OVERRIDES = ["run.num_rollout=10", "run.seed=1", "run.progress=false", "run.loggers=[jsonl]"]


def _curve(out_dir: Path) -> dict[str, list[float]]:
    from rlx.config.compose import compose
    from rlx.runtime import run

    history = run(compose([*OVERRIDES, f"run.output_dir={out_dir}"]))
    return {key: [h[key] for h in history] for key in KEYS}


def test_default_job_reproduces_the_golden_curve(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    assert golden["overrides"] == OVERRIDES
    curve = _curve(tmp_path)
    assert curve["train/loss"] == pytest.approx(golden["train/loss"], rel=1e-4, abs=1e-7)
    assert curve["train/grad_norm"] == pytest.approx(golden["train/grad_norm"], rel=1e-4)
    assert curve["rollout/reward_mean"] == pytest.approx(golden["rollout/reward_mean"], abs=1e-9)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    with tempfile.TemporaryDirectory() as out:
        GOLDEN.write_text(json.dumps({"overrides": OVERRIDES, **_curve(Path(out))}, indent=1) + "\n")
    print(f"recorded {GOLDEN}")
