"""Where a command's CPU goes, process by process: the test suite's, by default.

    python bench/suite_cpu.py                                  # the suite as scripts/test.sh runs it
    python bench/suite_cpu.py -- python -m pytest -q tests/integration/test_e2e.py

The command runs while every process on the machine is read from /proc twice a second: its CPU
time (user + system) and what it is (a trainer rank, an engine, a pytest worker, a `launch.py`
run, one of Ray's daemons, ...; Ray's workers are named by the actor they became). A process
alive before the command starts counts only what it spent after. A process that lives under half
a second may be missed (they are cheap). On a CPU-bound machine (CI's 2 cores) the command's wall
time comes down only with less CPU, so this says which kind of work to cut. Prints one JSON line:
`wall_s`, then `cpu_s` and `processes` by kind, then the `top` processes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

SUITE = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "--no-loadscope-reorder"]
TICK = os.sysconf("SC_CLK_TCK")
KINDS = [  # (kind, pattern in the command line), first match wins
    ("launch.py", r"\blaunch\.py\b"),  # before pytest: its arguments name pytest's tmp dirs
    # xdist's workers, started by execnet, retitle themselves "[pytest-xdist running] <test>"
    ("pytest worker", r"^\[pytest-xdist|-c import sys;exec\(eval\(sys\.stdin\.readline\(\)\)\)"),
    ("pytest", r"-m pytest\b|bin/pytest\b"),
    ("submitit job", r"submitit"),
    ("Ray daemons", r"gcs_server|raylet|log_monitor|dashboard|runtime_env|_private/agent|monitor\.py"),
    ("Ray idle worker", r"default_worker\.py|ray::IDLE"),
    ("engine server process", r"rlx\.engine\.serve"),
    ("router", r"sglang_router|router"),
    ("spawned ranks (forkserver)", r"multiprocessing|forkserver"),
]


def kind_of(cmdline: str) -> str:
    if cmdline.startswith("ray::"):
        name = cmdline.split()[0].split(".")[0]  # ray::TrainerRank.call -> ray::TrainerRank
        if name == "ray::IDLE":
            return "Ray idle worker"
        return "Ray daemons" if name.endswith("Agent") else name
    return next((k for k, pattern in KINDS if re.search(pattern, cmdline)), "other")


def _read(pid: str) -> tuple[str, float, str] | None:
    """(start tick, CPU seconds, command line) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, IndexError):
        return None
    return fields[19], (int(fields[11]) + int(fields[12])) / TICK, cmdline


def scan(seen: dict) -> None:
    """Read every live process once into `seen`: (pid, start tick) -> (CPU seconds, the most
    telling command line: a Ray worker retitles itself after the actor it becomes)."""
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        read = _read(pid)
        if read is None:
            continue
        start, cpu, cmdline = read
        before = seen.get((pid, start))
        titled = before is not None and before[1].startswith("ray::") and "IDLE" not in before[1]
        seen[(pid, start)] = (cpu, before[1] if titled else cmdline or (before[1] if before else ""))


def sample(seen: dict, stop: threading.Event, period_s: float = 0.5) -> None:
    while not stop.is_set():
        scan(seen)
        stop.wait(period_s)


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--top", type=int, default=15, help="processes listed by their own CPU")
    parser.add_argument("command", nargs="*", help="after --: the command (default: the CPU suite)")
    args = parser.parse_args(argv)
    command = args.command or SUITE
    before: dict = {}
    scan(before)  # the processes alive before the command, and their CPU so far
    seen, stop = dict(before), threading.Event()
    began = time.monotonic()
    sampler = threading.Thread(target=sample, args=(seen, stop), daemon=True)
    sampler.start()
    rc = subprocess.call(command)
    stop.set()
    sampler.join()
    wall = time.monotonic() - began
    cpu: dict[str, float] = {}
    count: dict[str, int] = {}
    rows = []
    me = str(os.getpid())
    for key, (total, cmdline) in seen.items():
        spent = total - before.get(key, (0.0, ""))[0]
        if key[0] == me or spent <= 0:
            continue
        kind = kind_of(cmdline)
        cpu[kind] = cpu.get(kind, 0.0) + spent
        count[kind] = count.get(kind, 0) + 1
        rows.append((spent, kind, cmdline[:120]))
    rows.sort(reverse=True)
    order = sorted(cpu, key=cpu.get, reverse=True)
    return {
        "bench": "suite_cpu", "command": " ".join(command), "rc": rc, "wall_s": round(wall, 1),
        "cpus": os.cpu_count(), "cpu_s_total": round(sum(cpu.values()), 1),
        "cpu_s": {k: round(cpu[k], 1) for k in order}, "processes": {k: count[k] for k in order},
        "top": [{"cpu_s": round(s, 1), "kind": k, "cmdline": c} for s, k, c in rows[: args.top]],
    }  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
