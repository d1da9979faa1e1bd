"""The memory of this machine's GPUs, read without CUDA: the driver process (which composes and
checks the config) must not create a CUDA context, which would take memory on a GPU that a trainer
rank or an engine is about to fill."""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import cache


@cache
def visible_gpu_bytes() -> int | None:
    """The smallest total memory of the GPUs this process may use (`CUDA_VISIBLE_DEVICES` when it
    lists indices), from `nvidia-smi`, in bytes; None without nvidia-smi or without a GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    command = [smi, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    totals = {}
    for line in out.strip().splitlines():
        index, _, mib = line.partition(",")
        if index.strip().isdigit() and mib.strip().isdigit():
            totals[index.strip()] = int(mib.strip()) * 2**20
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and all(v.strip().isdigit() for v in visible.split(",") if v.strip()):
        totals = {i: b for i, b in totals.items() if i in {v.strip() for v in visible.split(",")}}
    return min(totals.values()) if totals else None
