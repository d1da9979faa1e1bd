"""bench/pytest_cpu.py charges each test the CPU of its process tree: a child it ran and reaped, a
child still alive when it ends, and nothing for a test that only waits. Each child sleeps after its
busy part, longer than the plugin's half-second period, so a reading sees all of its CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TESTS = """
import subprocess, sys
import pytest

BUSY = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < {s}: pass\\n{then}"

def test_a_reaped_child():
    subprocess.run([sys.executable, "-c", BUSY.format(s=0.6, then="import time; time.sleep(0.7)")], check=True)

@pytest.fixture
def live_child():
    child = subprocess.Popen([sys.executable, "-c", BUSY.format(s=0.6, then="time.sleep(60)")])
    yield child
    child.kill()
    child.wait()

def test_a_child_alive_until_teardown(live_child):
    import time
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until the child has burnt its 0.6 s (utime + stime)
        fields = open(f"/proc/{live_child.pid}/stat").read().rsplit(")", 1)[1].split()
        if (int(fields[11]) + int(fields[12])) >= 0.6 * {tick}:
            break
        time.sleep(0.05)
    time.sleep(0.7)  # a reading of the child's whole CPU before teardown kills it

def test_waiting():
    import time
    time.sleep(0.6)
"""


def test_each_test_is_charged_the_cpu_of_its_process_tree(tmp_path):
    sys.path.insert(0, str(ROOT))
    try:
        from bench.pytest_cpu import TICK, summarize
    finally:
        sys.path.remove(str(ROOT))
    (tmp_path / "test_load.py").write_text(TESTS.replace("{tick}", str(TICK)))
    out = tmp_path / "cpu.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RLX_TEST_CPU": str(out)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "bench.pytest_cpu", "-p", "no:cacheprovider", "test_load.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["test"].split("::")[1]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"test_a_reaped_child", "test_a_child_alive_until_teardown", "test_waiting"}
    # the child's 0.6 s plus its interpreter's start (and this process's own share), well under a second
    assert 0.6 <= rows["test_a_reaped_child"]["cpu_s"] < 1.5, rows
    assert 0.6 <= rows["test_a_child_alive_until_teardown"]["cpu_s"] < 1.5, rows
    assert rows["test_waiting"]["cpu_s"] < 0.2 and rows["test_waiting"]["wall_s"] >= 0.6, rows
    summary = summarize(out)
    assert summary["tests"] == 3 and summary["files"][0]["file"] == "test_load.py"
    assert summary["files"][0]["tests"] == 3
    assert summary["cpu_s_total"] == round(sum(r["cpu_s"] for r in rows.values()), 1)
    assert summary["top"][-1]["test"].endswith("test_waiting")
