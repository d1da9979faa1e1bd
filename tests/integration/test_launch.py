"""`python launch.py` as a user runs it: a short job, clean errors for bad input, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["rollout.batch_size=8", "rollout.n_samples_per_prompt=4", "train.micro_batch_size=16"]
STRAY = ("raylet", "gcs_server", "ray::", "sglang_router", "sglang-router", "rlx.engine.serve")


def launch(tmp_path, *overrides, **kwargs) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "launch.py", f"hydra.run.dir={tmp_path}", *overrides]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, **kwargs)


def test_launch_runs_a_short_job(tmp_path):
    result = launch(tmp_path, "run.num_rollout=2", *SHORT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert "step    0 | reward" in result.stdout + result.stderr
    assert (tmp_path / "config.yaml").exists()


def test_bad_input_fails_fast_with_a_clean_message(tmp_path):
    missing = launch(tmp_path, "data=jsonl", f"data.prompt_path={tmp_path}/nope.jsonl")
    assert missing.returncode != 0
    assert "data.prompt_path" in missing.stderr and "nope.jsonl" in missing.stderr
    assert "Traceback" not in missing.stderr

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1 2 3 =", "label": "1 2 3"}\n{"prompt": "4 5\n')
    toy_file = ("reward.fn=rlx.reward.toy.position_match", "rollout.max_response_len=4")  # the file's task
    malformed = launch(tmp_path, "data=jsonl", f"data.prompt_path={bad}", *toy_file)
    assert malformed.returncode != 0
    assert f"{bad}:2" in malformed.stderr and "Traceback" not in malformed.stderr

    typo = launch(tmp_path, "rollout.batch_szie=4")
    assert typo.returncode != 0 and "batch_szie" in typo.stderr and "Traceback" not in typo.stderr

    equation = launch(tmp_path, "train.global_batch_size=100")
    assert equation.returncode != 0 and "Traceback" not in equation.stderr
    for key in (
        "rollout.batch_size",
        "rollout.n_samples_per_prompt",
        "train.global_batch_size",
        "train.num_steps_per_rollout",
    ):
        assert key in equation.stderr


def _stray_processes(since: float, session: int, pids: set[int]) -> list[str]:
    """The run's processes still alive: those it had (`pids`, the router included, which leaves the
    session), and any started after `since` in the job's session (the launcher runs in a session of
    its own), so work running beside this test on the machine does not count."""
    found = []
    for p in psutil.process_iter(["cmdline", "create_time", "status"]):
        try:
            if p.info["create_time"] < since or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if p.pid not in pids and os.getsid(p.pid) != session:
                continue
            cmdline = " ".join(p.info["cmdline"] or [])
        except (psutil.Error, ProcessLookupError):
            continue
        if p.pid in pids or any(marker in cmdline for marker in STRAY):
            found.append(f"{p.pid}: {cmdline[:120]}")
    return found


@pytest.mark.slow
def test_ctrl_c_twice_stops_everything_with_one_line(tmp_path):
    """Ctrl-C in a terminal (SIGINT to the job's process group), then again 50 ms later, as an
    impatient user does: the run stops at once (or, had its step just ended, after it), ends every
    process, and says so in one line: no traceback, no asyncio complaint about an HTTP session or a
    task left behind (the step's requests used to go on while the run closed its engines, and a
    signal during that closing killed the driver midway); the steps already logged are kept."""
    started = time.time()
    proc = subprocess.Popen(
        [sys.executable, "launch.py", f"hydra.run.dir={tmp_path}", "run.num_rollout=1000", "rollout.num_engines=2", *SHORT],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    output = []
    for line in proc.stdout:  # wait for a real step: trainer, engines and router are all up
        output.append(line)
        if "step    1 |" in line:
            break
    assert proc.poll() is None, "".join(output)[-3000:]
    pids = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
    assert len(pids) >= 5  # Ray's daemons, the trainer, two engines, the router
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
    time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    text = "".join(output) + rest
    assert proc.returncode == 128 + signal.SIGINT, text[-3000:]
    assert "stopped at once by a second SIGINT" in rest or "stopped by SIGINT after step" in rest, text[
        -3000:
    ]
    for noise in ("Traceback", "Unclosed client session", "Task was destroyed", "KeyboardInterrupt"):
        assert noise not in rest, text[-3000:]
    deadline = time.time() + 30
    while _stray_processes(started, proc.pid, pids) and time.time() < deadline:
        time.sleep(0.5)
    assert _stray_processes(started, proc.pid, pids) == []
    # nothing already produced is lost
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) >= 2
