"""The GPU tests leave the GPUs as they found them, so the whole directory passes in one process
(`python -m pytest tests/gpu`, docs/gpu.md); the runs of the directory share one Ray (`gpu_ray`).

After each test (`_leaves_the_gpus_as_found`), within GRACE_S of its end:
- no process it started is alive (trainer ranks, engines, spawned ranks), apart from the helpers
  that live as long as this process whoever started them (LONG_LIVED, with every process under
  them: torch.compile's worker pool forks its workers) and the shared Ray's idle workers;
- no process that appeared during the test holds a GPU device open (this also finds one that
  outlived its parent and left this process's tree);
- this process has no torch.distributed group and no Ray of the test's left up, and the shared Ray
  has all its GPUs and CPUs free again (no actor or placement group of a run left in it).
After each module (`_gives_back_its_gpu_memory`), its fixtures gone: no process group is left, and
this process holds no more cached GPU memory than the module found (torch's cuBLAS workspaces,
kept per stream for the life of the process, are let go first, as torch's own leak check does).
A test that leaves something behind fails, naming it; what it left in this process's tree is ended
here, so that the next test starts clean.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import signal
import time
from collections import Counter, defaultdict

import pytest
import torch

GRACE_S = 30.0  # a run's processes end within this after it returns
# process-wide helpers, started by whichever test needs them first and kept: torch.compile's
# worker pool, multiprocessing's resource tracker and fork server
LONG_LIVED = (
    "compile_worker",
    "torch._inductor",
    "multiprocessing.resource_tracker",
    "multiprocessing.forkserver",
)
# the shared Ray's pooled worker processes, which hold no actor: idle, or starting (no title yet)
RAY_POOL = ("ray::IDLE", "ray/_private/workers/default_worker.py")
GPU_DEVICE = re.compile(r"/dev/nvidia(\d+|-uvm)$")


def _process_table() -> dict[int, tuple[int, str]]:
    """Every live process -> (its parent, its command line), read from /proc (the GPU machine has
    no psutil)."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            if stat[0] == "Z":
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            table[int(entry)] = (int(stat[1]), cmdline)
        except (OSError, IndexError, ValueError):
            continue
    return table


def _tree(table: dict[int, tuple[int, str]]) -> tuple[dict[int, str], set[int]]:
    """(this process's descendants -> their command lines, the LONG_LIVED processes and every
    process under them, anywhere)."""
    children = defaultdict(list)
    for pid, (ppid, _) in table.items():
        children[ppid].append(pid)

    def below(roots: list[int]) -> set[int]:
        found, todo = set(roots), list(roots)
        while todo:
            for child in children[todo.pop()]:
                if child not in found:
                    found.add(child)
                    todo.append(child)
        return found

    kept = below([pid for pid, (_, cmd) in table.items() if any(m in cmd for m in LONG_LIVED)])
    mine = below([os.getpid()]) - {os.getpid()} - kept
    return {pid: table[pid][1] for pid in mine}, kept


def _gpu_holders(table: dict[int, tuple[int, str]], kept: set[int]) -> set[int]:
    """Processes with a GPU device open (their /proc/PID/fd), this one and `kept` left out."""
    holders = set()
    for pid in set(table) - kept - {os.getpid()}:
        with contextlib.suppress(OSError):
            if any(
                GPU_DEVICE.match(os.readlink(f"/proc/{pid}/fd/{fd}")) for fd in os.listdir(f"/proc/{pid}/fd")
            ):
                holders.add(pid)
    return holders


def _ray_in_use() -> dict[str, float]:
    """The shared Ray's GPUs and CPUs not free (held by an actor or a placement group)."""
    import ray

    total, free = ray.cluster_resources(), ray.available_resources()
    return {
        k: total[k] - free.get(k, 0.0) for k in ("GPU", "CPU") if total.get(k, 0.0) - free.get(k, 0.0) > 1e-6
    }


@pytest.fixture(scope="session")
def gpu_ray():
    """One Ray for the runs of this directory (modules ask with `usefixtures("gpu_ray")`), started
    as a run starts its own (`rlx.launcher.ray_start`) and shut down when the session ends: a run
    that finds Ray up uses it and leaves it up, so Ray's start and stop are paid once, not per run.
    Its idle workers preload a trainer rank's imports (`rlx.trainer.preload`: torch, Megatron and
    rlx's trainer), which each run's ranks would otherwise spend in its start;
    `_leaves_the_gpus_as_found` would see an idle worker that opened a GPU."""
    import ray

    from rlx.launcher import ray_start

    started = not ray.is_initialized()
    if started:
        ray_start.start_local(preload=True)
    yield
    if started:
        ray.shutdown()


@pytest.fixture(autouse=True)
def _leaves_the_gpus_as_found():
    if not torch.cuda.is_available():
        yield
        return
    import ray

    table = _process_table()
    mine, kept = _tree(table)
    before, holders_before = set(mine), _gpu_holders(table, kept)
    group_before, ray_before = torch.distributed.is_initialized(), ray.is_initialized()
    yield
    deadline = time.monotonic() + GRACE_S
    while True:
        table = _process_table()
        mine, kept = _tree(table)
        left = {
            pid: cmd for pid, cmd in mine.items() if pid not in before and not any(m in cmd for m in RAY_POOL)
        }
        holders = _gpu_holders(table, kept) - holders_before - set(left)
        in_use = _ray_in_use() if ray_before and ray.is_initialized() else {}
        if not (left or holders or in_use) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    problems = [f"process {pid} still alive: {cmd[:160]}" for pid, cmd in left.items()]
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    problems += [f"process {pid}, not this one's, holds a GPU open: {table[pid][1][:160]}" for pid in holders]
    if in_use:
        problems.append(
            f"the shared Ray still has {in_use} in use: an actor or placement group of a run left"
        )
    if torch.distributed.is_initialized() and not group_before:
        problems.append("a torch.distributed group is still initialised in the test process")
        torch.distributed.destroy_process_group()
    if ray.is_initialized() and not ray_before:
        problems.append("the test left a Ray of its own up in the test process")
        ray.shutdown()
    assert not problems, problems


def _reserved() -> list[int]:
    if not torch.cuda.is_initialized():
        return []
    gc.collect()
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()  # one per (handle, stream), kept until cleared
    torch.cuda.empty_cache()
    return [torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count())]


def _live_cuda_tensors(top: int = 5) -> str:
    """The largest groups of CUDA tensors still referenced somewhere in this process, for the message."""
    sizes: Counter = Counter()
    for obj in gc.get_objects():
        with contextlib.suppress(Exception):
            if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.is_cuda:  # not torch.compile's fakes
                sizes[(tuple(obj.shape), str(obj.dtype))] += obj.untyped_storage().nbytes()
    return ", ".join(f"{shape} {dtype}: {n / 2**20:.1f} MiB" for (shape, dtype), n in sizes.most_common(top))


@pytest.fixture(scope="module", autouse=True)
def _gives_back_its_gpu_memory():
    if not torch.cuda.is_available():
        yield
        return
    before = _reserved()
    yield
    problems = []
    if torch.distributed.is_initialized():
        problems.append("the module left a torch.distributed group initialised")
        torch.distributed.destroy_process_group()
    after = _reserved()
    before = before or [0] * len(after)  # CUDA first used in this module: it started with nothing
    grown = [
        (i, round((a - b) / 2**20, 1)) for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b
    ]
    if grown:
        allocated = [round(torch.cuda.memory_allocated(i) / 2**20, 1) for i in range(len(after))]
        problems.append(
            f"the module left GPU memory cached in the test process (device, MiB): {grown}; allocated "
            f"(MiB): {allocated}; live CUDA tensors: {_live_cuda_tensors() or 'none'}"
        )
    assert not problems, problems
