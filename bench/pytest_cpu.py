"""Each test's CPU seconds: a pytest plugin, and the summary of what it wrote.

    RLX_TEST_CPU=/tmp/cpu.jsonl python -m pytest -p bench.pytest_cpu -q -n 2 --dist loadfile --no-loadscope-reorder
    python bench/pytest_cpu.py /tmp/cpu.jsonl          # by file, then the top tests: one JSON line

On a CPU-bound machine (CI's 2 cores) a test's wall time says little: it depends on what the other
pytest worker runs meanwhile. Its CPU does not. For each test (setup, call and teardown together)
the plugin adds up the CPU of the process that runs it and of every process below it (a pytest-xdist
worker's own Ray, its trainer ranks and engines, the subprocesses and spawned ranks of the test),
those still alive and those they have reaped (utime + stime + cutime + cstime of /proc/PID/stat),
before and after, and appends `{"test", "cpu_s", "wall_s"}` to the file `RLX_TEST_CPU` names. The
two xdist workers' trees are disjoint, so each test is charged only its own work; the test that
starts its worker's shared Ray or kept actors (tests/conftest.py) is charged their start. Missed: a
process reparented away from the tree (a daemon that double-forks) after its parent died.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

ENV = "RLX_TEST_CPU"
TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root: int) -> float:
    """CPU seconds of process `root` and every process below it, with those they have reaped."""
    children: dict[int, list[int]] = defaultdict(list)
    spent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited meanwhile
        pid = int(name)
        children[int(fields[1])].append(pid)
        spent[pid] = sum(int(x) for x in fields[11:15])  # utime, stime, cutime, cstime
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += spent.get(pid, 0)
        todo += children.get(pid, [])
    return total / TICK


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    out = os.environ.get(ENV)
    if not out:
        yield
        return
    cpu, wall = tree_cpu_s(os.getpid()), time.monotonic()
    yield
    row = {"test": item.nodeid, "cpu_s": round(tree_cpu_s(os.getpid()) - cpu, 2)}
    row["wall_s"] = round(time.monotonic() - wall, 2)
    with open(out, "a") as f:  # one short line an append: the workers' lines do not interleave
        f.write(json.dumps(row) + "\n")


def summarize(path: Path, top: int = 30) -> dict:
    """The file's tests by file (CPU seconds, tests, wall seconds) and its `top` tests by CPU."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0.0])
    for row in rows:
        entry = files[row["test"].split("::")[0]]
        entry[0] += row["cpu_s"]
        entry[1] += 1
        entry[2] += row["wall_s"]
    order = sorted(files, key=lambda f: -files[f][0])
    return {
        "bench": "pytest_cpu", "tests": len(rows), "cpu_s_total": round(sum(r["cpu_s"] for r in rows), 1),
        "files": [{"file": f, "cpu_s": round(files[f][0], 1), "tests": files[f][1], "wall_s": round(files[f][2], 1)}
                  for f in order],
        "top": sorted(rows, key=lambda r: -r["cpu_s"])[:top],
    }  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(summarize(Path(sys.argv[1]))))
