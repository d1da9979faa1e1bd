"""Each test's CPU seconds: a pytest plugin, and the summary of what it wrote.

    RLX_TEST_CPU=/tmp/cpu.jsonl python -m pytest -p bench.pytest_cpu -q -n 2 --dist loadfile --no-loadscope-reorder
    python bench/pytest_cpu.py /tmp/cpu.jsonl          # by file, then the top tests: one JSON line

On a CPU-bound machine (CI's 2 cores) a test's wall time says little: it depends on what the other
pytest worker runs meanwhile. Its CPU does not. The plugin reads, from /proc, the CPU (utime +
stime) of the process that runs the tests and of every process below it (an xdist worker's own Ray,
its trainer ranks and engines, a test's subprocesses and spawned ranks) when each test starts and
ends and twice a second between, and charges each test (setup, call and teardown together) what
those processes spent while it ran; it appends `{"test", "cpu_s", "wall_s"}` to the file
`RLX_TEST_CPU` names. The two xdist workers' trees are disjoint, so each test is charged only its own
work; the test that starts its worker's shared Ray or kept actors (tests/conftest.py) is charged
their start. Missed: a process that lives under half a second (cheap), and what a process spends
after it leaves the tree (reparented to init when its parent dies first). Children's times as their
parents record them (cutime) are not used: a process that outlives a test would be counted twice,
or taken back whole when it ends.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest

ENV = "RLX_TEST_CPU"
TICK = os.sysconf("SC_CLK_TCK")


def tree_cpu(root: int) -> dict[tuple[int, str], int]:
    """(pid, start tick) -> CPU ticks (utime + stime) of process `root` and every process below it."""
    children: dict[int, list[int]] = defaultdict(list)
    spent: dict[int, tuple[str, int]] = {}
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
        spent[pid] = (fields[19], int(fields[11]) + int(fields[12]))
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in spent:
            found[(pid, spent[pid][0])] = spent[pid][1]
        todo += children.get(pid, [])
    return found


class Sampler:
    """The latest CPU ticks of every process seen in this process's tree, read twice a second."""

    def __init__(self, root: int, period_s: float = 0.5):
        self.root, self.seen, self.lock = root, {}, threading.Lock()
        threading.Thread(target=self._loop, args=(period_s,), daemon=True, name="pytest_cpu").start()

    def scan(self) -> dict[tuple[int, str], int]:
        found = tree_cpu(self.root)
        with self.lock:
            self.seen |= found
            return dict(self.seen)

    def _loop(self, period_s: float) -> None:
        while True:  # a daemon thread: it ends with the pytest process
            time.sleep(period_s)
            self.scan()


def spent_s(before: dict, after: dict) -> float:
    """CPU seconds the processes of `after` spent since `before` (all of it for one born since)."""
    return sum(ticks - before.get(key, 0) for key, ticks in after.items()) / TICK


_sampler: Sampler | None = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _sampler
    out = os.environ.get(ENV)
    if not out:
        yield
        return
    _sampler = _sampler or Sampler(os.getpid())
    before, wall = _sampler.scan(), time.monotonic()
    yield
    row = {"test": item.nodeid, "cpu_s": round(spent_s(before, _sampler.scan()), 2)}
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
