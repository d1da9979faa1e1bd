"""`python launch.py -m ...`: every job in its own directory, a failed job leaves the others
running, and `sweep_summary.jsonl` at the sweep root says how each one ended."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from rlx.launcher.sweep import append, format_table, job_record, read

ROOT = Path(__file__).resolve().parents[2]


def test_failed_job_does_not_stop_the_sweep(tmp_path):
    # n_samples_per_prompt=1 composes (a valid int) but GRPO refuses it when the job starts
    result = subprocess.run(
        [sys.executable, "launch.py", "-m", f"hydra.sweep.dir={tmp_path}", "run.num_rollout=2",
         "rollout.batch_size=8", "train.micro_batch_size=8", "run.progress=False",
         "rollout.n_samples_per_prompt=1,4"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "1 of 2 sweep jobs failed" in result.stderr and "Traceback" not in result.stderr

    failed, completed = read(tmp_path / "sweep_summary.jsonl")
    assert failed["job"] == 0 and failed["status"] == "failed"
    assert failed["overrides"][-1] == "rollout.n_samples_per_prompt=1"
    assert "ConfigError" in failed["error"] and "rollout.n_samples_per_prompt=1" in failed["error"]
    assert failed["num_steps"] == 0 and failed["final_reward_mean"] is None

    rows = [json.loads(line) for line in (tmp_path / "1" / "metrics.jsonl").read_text().splitlines()]
    rewards = [row["rollout/reward_mean"] for row in rows]
    assert completed["job"] == 1 and completed["status"] == "completed" and completed["error"] is None
    assert completed["overrides"][-1] == "rollout.n_samples_per_prompt=4"
    assert completed["num_steps"] == 2 and completed["dir"] == str(tmp_path / "1")
    assert completed["final_reward_mean"] == rewards[1] and completed["best_reward_mean"] == max(rewards)
    assert completed["wall_time_s"] > 0 and completed["slurm_job_id"] is None
    assert (tmp_path / "1" / "config.yaml").exists() and not (tmp_path / "0" / "metrics.jsonl").exists()


def _job_config(run_dir: Path, num: int) -> OmegaConf:
    return OmegaConf.create(
        {"run": {"output_dir": None},
         "hydra": {"job": {"num": num}, "overrides": {"task": [f"algo.eps_clip={num}"]},
                   "runtime": {"output_dir": str(run_dir)}}}
    )  # fmt: skip


def test_record_reads_final_and_best_reward(tmp_path):
    rewards = [0.25, 0.75, float("nan"), 0.5]  # a NaN step (no finite reward) is skipped
    lines = [
        json.dumps({"step": i, "rollout/reward_mean": r, "train/loss": 1.0}) for i, r in enumerate(rewards)
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    done = JobReturn(status=JobStatus.COMPLETED, _return_value={"status": "completed"})
    record = job_record(_job_config(tmp_path, 3), done, wall_time_s=12.3456)
    assert record == {
        "job": 3, "overrides": ["algo.eps_clip=3"], "status": "completed", "error": None, "num_steps": 3,
        "final_reward_mean": 0.5, "best_reward_mean": 0.75, "wall_time_s": 12.346, "dir": str(tmp_path),
        "slurm_job_id": None,
    }  # fmt: skip

    raised = JobReturn(status=JobStatus.FAILED, _return_value=RuntimeError("engine died"))
    record = job_record(_job_config(tmp_path / "empty", 0), raised, wall_time_s=None)
    assert (record["status"], record["error"], record["num_steps"]) == (
        "failed",
        "RuntimeError: engine died",
        0,
    )
    assert record["final_reward_mean"] is None and record["wall_time_s"] is None


def test_summary_lines_are_read_in_job_order(tmp_path):
    path = tmp_path / "sweep_summary.jsonl"
    base = {"overrides": ["x=1"], "status": "completed", "error": None, "final_reward_mean": 0.5,
            "best_reward_mean": 0.875, "wall_time_s": 2.0}  # fmt: skip
    for job in (2, 0, 1):  # jobs end in any order on a cluster
        append(path, base | {"job": job})
    assert [r["job"] for r in read(path)] == [0, 1, 2]
    table = format_table(read(path)).splitlines()
    assert table[1].split() == ["0", "completed", "0.500", "0.875", "2.0", "x=1"]
