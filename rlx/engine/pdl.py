"""Programmatic dependent launch (PDL, sm90+) for the engine's Triton kernels.

Each kernel is launched with `launch_pdl` and its first act is `griddepcontrol.wait`: it reads
nothing before the kernel ahead of it has finished and its writes are visible, so results are
those of plain launches (tests/gpu/test_engine.py), while its launch and scheduling overlap the
tail of the kernel ahead, inside the decode graphs too. Mode 2 (the default) also lets the kernel
after it launch at once (`griddepcontrol.launch_dependents` right after the wait); mode 1 waits
only; 0 is off. `RLX_ENGINE_PDL` sets the mode; GPUs before sm90 (and a Triton without
`gdc_wait`) get 0. Measured on 1×H200: the 1.7B decode step -4.4% at batch 64, rollout tokens/s
+1.0-1.6% (docs/benchmarks.md, Decisions).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tlc

from rlx.engine.config import env_switch


@functools.cache
def pdl_mode(device: torch.device) -> int:
    mode = int(env_switch("RLX_ENGINE_PDL"))
    if device.type != "cuda":  # Triton's CPU interpreter (tests/kernels)
        return 0
    if mode and (torch.cuda.get_device_capability(device) < (9, 0) or not hasattr(tlc, "gdc_wait")):
        return 0  # before sm90, or a Triton without the griddepcontrol wrappers
    return mode


def pdl_launch(device: torch.device) -> dict:
    """A kernel launch's keyword arguments for `pdl_mode(device)`: its `PDL` (for `pdl_prologue`)
    and Triton's `launch_pdl` (`**pdl_launch(device)`)."""
    mode = pdl_mode(device)
    return {"PDL": mode, "launch_pdl": mode > 0}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    if PDL > 0:
        tlc.gdc_wait()
    if PDL > 1:
        tlc.gdc_launch_dependents()
