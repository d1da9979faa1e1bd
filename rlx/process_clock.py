"""How long this process has been alive, from the kernel's record of its start (Linux /proc), so
a start-up log can split a new process's seconds into its own start (Python, Ray's worker, the
first imports) and what it did after.
"""

from __future__ import annotations

import os


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
