"""How long this process has been alive, from the kernel's record of its start (Linux /proc), so
a start-up log can split a new process's seconds into its own start (Python, Ray's worker, the
first imports) and what it did after.
"""

from __future__ import annotations

import os
import time


def age() -> float | None:
    """Seconds since this process started (to the kernel's clock tick, 10 ms), or None where /proc
    cannot say (not Linux)."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def started_at() -> float | None:
    """When this process started, in seconds since the epoch (`time.time()`'s clock), or None."""
    seconds = age()
    return None if seconds is None else time.time() - seconds


def origin(started: float | None, loaded: float, asked: float) -> str:
    """How a Ray actor's process came to serve a request made at `asked` (seconds since the epoch),
    from when the process `started` (`started_at`, None: unknown) and when it `loaded` its actor's
    module: "kept" (its code was loaded before: a process an earlier run handed back, or one
    started ahead and warmed up), "pooled" (one of Ray's idle workers, started before) or "new"."""
    if loaded < asked:
        return "kept"
    return "pooled" if started is not None and started < asked else "new"
