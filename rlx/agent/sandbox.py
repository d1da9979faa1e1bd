"""Run a tool in a subprocess with a time limit, a memory limit and no network.

    sandbox = Sandbox(time_limit_s=5, memory_limit_mb=256)
    result = await sandbox.run(["calculator.py"], stdin="12 + 30")   # ToolResult(ok=True, output="42\n", ...)

A tool is a command line (`argv`). Each call runs in a process of its own, forked by one of the
sandbox's fork servers (`rlx.agent.forkserver`, at most `max_concurrency` per event loop, started
on first use); one whose first word ends in `.py` is run by that fresh process's interpreter
(`python -I -S`: no site packages; its code compiled once by the fork server), any other is
`exec`ed. Each call gets a fresh empty working directory (removed afterwards), stdin as given, and
an environment of only PATH, LANG and HOME (the working directory).

What is guaranteed, by layer (`Sandbox.network` says which one a sandbox has):

- time: the call's whole process group is killed (SIGKILL) `time_limit_s` after it started;
  RLIMIT_CPU (the time limit, rounded up, plus 1 s) is a backstop.
- memory: RLIMIT_AS (address space) of `memory_limit_mb`, inherited by the tool's children; a
  Python tool then gets MemoryError, a C tool a failed malloc. Counted per process, not per tree.
- network, `namespace`: the fork servers run in a new, empty network namespace (`unshare -n`, or
  `unshare -rn` where only unprivileged user namespaces are allowed), and so does every tool: no
  interface but a loopback that is down, nothing can be reached, not even this machine, whatever
  the tool's language.
- network, `python`: where no namespace can be made, a Python tool's `import socket` fails; a
  tool that is not Python, or that uses ctypes, is NOT kept off the network. `network="namespace"`
  refuses to start instead of falling back.

- a call given up (its task cancelled) or a sandbox closed mid-call (`close_sandboxes`, which the
  rollout pool awaits before its loop closes): the fork server is stopped (SIGTERM, SIGKILL after
  STOP_GRACE_S) and kills the running tool's process group first; no tool outlives it.

Nothing else is isolated: the tool sees the filesystem with the parent's user's rights.
Measured here (2026-11-26, root in a 2-core VM, `bench/sandbox_calls.py`): `unshare -n` works; a
calculator call takes 3.3 ms through a warm fork server, 12-17 ms when each child ran the file
with runpy (importing and compiling after the fork), 25 ms when each call started an interpreter.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

from rlx.errors import ConfigError

NETWORK_MODES = ("auto", "namespace", "python")  # Sandbox(network=...)

FORK_SERVER = str(Path(__file__).with_name("forkserver.py"))
SERVER_GRACE_S = 10.0  # how much longer than a call's limit its fork server may take to answer
STOP_GRACE_S = 2.0  # how long a fork server told to stop (EOF, then SIGTERM) may take before SIGKILL
_SANDBOXES: weakref.WeakSet = weakref.WeakSet()  # every Sandbox of this process (`close_sandboxes`)


@dataclass(frozen=True, slots=True)
class ToolResult:
    """What one tool call produced. `ok`: it exited 0 within its limits; otherwise `reason` says
    why not in one line (timed out, out of memory, killed by a signal, exit code and the last line
    of stderr, output too long)."""

    ok: bool
    output: str  # stdout (decoded as UTF-8, undecodable bytes replaced)
    reason: str = ""
    returncode: int | None = None  # None when it was killed for its time or output
    seconds: float = 0.0


@functools.cache
def namespace_prefix() -> tuple[str, ...] | None:
    """The command prefix that puts a process into a new network namespace here, or None.

    Probed once per process: `unshare -n` (root or CAP_SYS_ADMIN), then `unshare -rn` (an
    unprivileged user namespace); None where neither works (no util-linux, seccomp, policy)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    for prefix in ((unshare, "-n"), (unshare, "-r", "-n")):
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return prefix
    return None


class Sandbox:
    """Runs tool commands (see the module docstring for the guarantees), at most
    `max_concurrency` at a time per event loop."""

    def __init__(
        self,
        time_limit_s: float = 5.0,
        memory_limit_mb: int = 256,
        *,
        network: str = "auto",
        max_output_bytes: int = 65536,
        max_concurrency: int | None = None,
    ):
        """`network`: `namespace` (refuse to run without one), `python` (only the Python-level
        guard) or `auto` (a namespace where one can be made, else `python`)."""
        if time_limit_s <= 0 or memory_limit_mb < 32 or max_output_bytes < 1:
            raise ConfigError(
                f"Sandbox(time_limit_s={time_limit_s}, memory_limit_mb={memory_limit_mb}, "
                f"max_output_bytes={max_output_bytes}): the time limit must be > 0, the memory limit "
                ">= 32 MB (the interpreter itself maps about 20) and the output limit >= 1 byte"
            )
        if network not in NETWORK_MODES:
            raise ConfigError(f"Sandbox(network={network!r}) is not one of {list(NETWORK_MODES)}")
        prefix = namespace_prefix() if network in ("auto", "namespace") else None
        if network == "namespace" and prefix is None:
            raise ConfigError(
                "Sandbox(network='namespace'): no network namespace can be made on this machine "
                "(`unshare -n` and `unshare -rn` both fail: no util-linux, or user namespaces are "
                "disabled); enable unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), "
                "or accept the weaker Python-level guard with network='python'"
            )
        self.time_limit_s = float(time_limit_s)
        self.memory_limit_mb = int(memory_limit_mb)
        self.max_output_bytes = int(max_output_bytes)
        self.network = "namespace" if prefix else "python"
        self.max_concurrency = max_concurrency or 2 * (os.cpu_count() or 1)
        block = "1" if self.network == "python" else "0"
        self.server_command = [*(prefix or ()), sys.executable, "-I", "-S", FORK_SERVER, block]
        self._pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # loop -> _ServerPool
        _SANDBOXES.add(self)

    async def run(self, argv: list[str], stdin: str = "") -> ToolResult:
        """Run one tool call; never raises for what the tool does (see `ToolResult`)."""
        if not argv:
            raise ValueError("a tool command needs at least one word")
        request = {
            "argv": [str(a) for a in argv],
            "stdin": stdin,
            "env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8", "HOME": "."},
            "memory_bytes": self.memory_limit_mb << 20,
            "cpu_s": math.ceil(self.time_limit_s) + 1,
            "time_limit_s": self.time_limit_s,
            "max_output_bytes": self.max_output_bytes,
        }
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is None:
            pool = self._pools[loop] = _ServerPool(self.server_command, self.max_concurrency)
        reply = await pool.call(request, self.time_limit_s + SERVER_GRACE_S)
        return self._result(reply)

    async def aclose(self) -> None:
        """Stop this event loop's fork servers (they also stop when this process exits)."""
        pool = self._pools.pop(asyncio.get_running_loop(), None)
        if pool is not None:
            await pool.close()

    def _result(self, reply: dict) -> ToolResult:
        rc, output, seconds = reply["rc"], reply["out"], reply["seconds"]
        if reply["timed_out"]:
            return ToolResult(
                False, output, f"timed out after {self.time_limit_s:g} s (killed)", None, seconds
            )
        if reply["too_long"]:
            reason = f"wrote more than {self.max_output_bytes} bytes to stdout (killed)"
            return ToolResult(False, output, reason, None, seconds)
        if rc == 0:
            return ToolResult(True, output, "", 0, seconds)
        return ToolResult(False, output, self._failure(rc, reply["err"]), rc, seconds)

    def _failure(self, rc: int, stderr: str) -> str:
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        last = lines[-1].strip() if lines else ""
        limit = f"memory limit {self.memory_limit_mb} MB"
        if "MemoryError" in stderr:
            return f"ran out of memory ({limit}): {last}"
        if rc < 0:
            name = signal.Signals(-rc).name if -rc in signal.valid_signals() else str(-rc)
            hint = {"SIGXCPU": "CPU time limit", "SIGSEGV": limit, "SIGABRT": limit}.get(name)
            return (
                f"killed by {name}" + (f" (at the {hint}?)" if hint else "") + (f": {last}" if last else "")
            )
        return f"exited with code {rc}" + (f": {last}" if last else "")


async def close_sandboxes() -> None:
    """Stop the running event loop's fork servers of every Sandbox. Whoever owns a loop that ran
    tool calls awaits it before closing the loop (the rollout pool at shutdown, `hf_eval`'s
    scoring): a server still open when its loop closes is closed by the garbage collector later,
    which Python 3.12 reports at exit as "Event loop is closed", once a server."""
    for sandbox in list(_SANDBOXES):
        await sandbox.aclose()


class _ServerPool:
    """Fork servers of one event loop: at most `size` calls at once, each on an idle server or,
    when none is idle, on a newly started one."""

    def __init__(self, command: list[str], size: int):
        self.command = command
        self.slots = asyncio.Semaphore(size)
        self.idle: list = []
        self.servers: set = set()

    async def call(self, request: dict, timeout_s: float) -> dict:
        async with self.slots:
            server = self.idle.pop() if self.idle else await self._start()
            try:
                server.stdin.write(json.dumps(request).encode() + b"\n")
                await server.stdin.drain()
                line = await asyncio.wait_for(server.stdout.readline(), timeout_s)
                if not line:
                    raise ConnectionError(f"it exited with code {await server.wait()}")
                reply = json.loads(line)
            except BaseException as e:  # a broken server is replaced, never reused
                await self._discard(server)
                if isinstance(e, Exception):
                    raise RuntimeError(f"the sandbox's fork server failed ({type(e).__name__}: {e})") from e
                raise
            self.idle.append(server)
            return reply

    async def _start(self):
        server = await asyncio.create_subprocess_exec(
            *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
        )
        self.servers.add(server)
        return server

    async def _discard(self, server) -> None:
        self.servers.discard(server)
        await _stop(server)

    async def close(self) -> None:
        """Within about 2 x STOP_GRACE_S: an idle server exits at the end of its stdin, one mid-call
        is stopped (`_stop`: its tool killed with it)."""
        servers = list(self.servers)
        for server in servers:
            server.stdin.close()
        await asyncio.gather(*(_finish(server) for server in servers))
        self.servers.clear()
        self.idle.clear()


async def _finish(server) -> None:
    """A server whose stdin is closed: its exit, or `_stop` after STOP_GRACE_S."""
    try:
        await asyncio.wait_for(server.wait(), STOP_GRACE_S)
    except TimeoutError:
        await _stop(server)


async def _stop(server) -> None:
    """SIGTERM (the fork server kills its running tool's group, then exits), SIGKILL after
    STOP_GRACE_S; its stdin closed, so that nothing of it is left for the garbage collector."""
    server.stdin.close()
    if server.returncode is None:
        server.terminate()
        try:
            await asyncio.wait_for(server.wait(), STOP_GRACE_S)
        except TimeoutError:
            server.kill()
            await server.wait()
