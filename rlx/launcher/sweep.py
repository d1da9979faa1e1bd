"""A sweep's results in one file: `<sweep dir>/sweep_summary.jsonl`, one line per job.

    {"job": 0, "overrides": ["algo=grpo", "rollout.n_samples_per_prompt=4"], "status": "completed",
     "error": null, "num_steps": 100, "final_reward_mean": 0.91, "best_reward_mean": 0.93,
     "wall_time_s": 74.2, "dir": ".../multirun/DATE/TIME/0", "slurm_job_id": null}

`SweepSummary` is a Hydra callback (conf/config.yaml, `hydra.callbacks`): each job's line is
written where the job ran (a SLURM node too) when it ends, from its outcome (`rlx.launcher.job`)
and its metrics.jsonl; at the end the driver logs the table and exits non-zero if a job failed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from rlx.launcher.job import COMPLETED, FAILED
from rlx.launcher.nodes import node_role

log = logging.getLogger(__name__)

SUMMARY_FILE = "sweep_summary.jsonl"
REWARD_KEY = "rollout/reward_mean"


class SweepSummary(Callback):
    """Writes `sweep_summary.jsonl` at the sweep root; a no-op outside `-m` sweeps."""

    def __init__(self) -> None:
        self._job_start: float | None = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        path = summary_path(config)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")  # a sweep reusing a directory starts a fresh summary

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        self._job_start = time.time()

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        if config.hydra.mode != RunMode.MULTIRUN or not node_role(os.environ).writes_results:
            return
        wall_time_s = time.time() - self._job_start if self._job_start is not None else None
        append(summary_path(config), job_record(config, job_return, wall_time_s))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        path = summary_path(config)
        records = read(path)
        log.info("sweep summary (%s):\n%s", path, format_table(records))
        failed = [r for r in records if r["status"] != COMPLETED]
        if failed:  # the only way a Hydra sweep can end with a non-zero exit status and no traceback
            jobs = "\n".join(f"  #{r['job']}: {(r['error'] or r['status']).splitlines()[0]}" for r in failed)
            raise SystemExit(
                f"error: {len(failed)} of {len(records)} sweep jobs failed (see {path}):\n{jobs}"
            )


def summary_path(config: DictConfig) -> Path:
    return Path(str(config.hydra.sweep.dir)).resolve() / SUMMARY_FILE


def job_record(config: DictConfig, job_return: JobReturn, wall_time_s: float | None) -> dict[str, Any]:
    """The summary line for one job: its overrides, outcome, rewards from its metrics.jsonl, time."""
    try:
        outcome = job_return.return_value  # raises what the job raised, if it raised
    except Exception as e:  # raised past rlx.launcher.job (a task function of someone else's)
        outcome = {"status": FAILED, "error": f"{type(e).__name__}: {e}"}
    if not isinstance(outcome, dict):
        outcome = {"status": COMPLETED}
    run_dir = Path(str(config.run.output_dir or config.hydra.runtime.output_dir))
    rewards = _rewards(run_dir / "metrics.jsonl")
    return {
        "job": int(config.hydra.job.num),
        "overrides": list(OmegaConf.to_container(config.hydra.overrides.task)),
        "status": outcome["status"],
        "error": outcome.get("error"),
        "num_steps": len(rewards),
        "final_reward_mean": rewards[-1] if rewards else None,
        "best_reward_mean": max(rewards) if rewards else None,
        "wall_time_s": round(wall_time_s, 3) if wall_time_s is not None else None,
        "dir": str(run_dir),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }


def _rewards(metrics_path: Path) -> list[float]:
    if not metrics_path.exists():
        return []
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return [
        r[REWARD_KEY]
        for r in rows
        if isinstance(r.get(REWARD_KEY), (int, float)) and math.isfinite(r[REWARD_KEY])
    ]


def append(path: Path, record: dict[str, Any]) -> None:
    """Add one line; jobs running at once on several nodes take turns (an exclusive lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(json.dumps(record) + "\n")
            f.flush()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read(path: Path) -> list[dict[str, Any]]:
    """The summary's records ordered by job number."""
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(records, key=lambda r: r["job"])


def format_table(records: list[dict[str, Any]]) -> str:
    def reward(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = [f"{'job':>4}  {'status':<10} {'final':>6} {'best':>6} {'time_s':>8}  overrides"]
    for r in records:
        time_s = "-" if r["wall_time_s"] is None else f"{r['wall_time_s']:.1f}"
        lines.append(
            f"{r['job']:>4}  {r['status']:<10} {reward(r['final_reward_mean']):>6} "
            f"{reward(r['best_reward_mean']):>6} {time_s:>8}  {' '.join(r['overrides'])}"
        )
    return "\n".join(lines)
