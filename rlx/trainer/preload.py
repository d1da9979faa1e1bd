"""A trainer rank's imports, for Ray to load into its idle worker processes ahead of any run.

Ray imports the modules its system config names in `preload_python_modules` into every worker it
starts, before the worker takes work: a Ray that serves several runs in a row (a test session's,
a notebook's) started with `ray_start.start_local(preload=True)` hands each run's trainer ranks
processes that have Megatron, rlx's trainer and liger's kernels loaded already (13-14 s of a
rank's start on 1×H100: torch 4 s, Megatron and the kernels 9 s), where a new process would spend
them in the run's start. Idle workers a run's actors take are not replaced until a run asks for
more processes than are idle (Ray starts one worker a CPU when it starts).

Nothing here may touch CUDA: Ray sets a GPU actor's CUDA_VISIBLE_DEVICES in the worker only when
the actor takes it, and a process that has initialised CUDA before would keep seeing every GPU.
So the kernel set is not resolved (`rlx.models.kernels.resolve` asks CUDA whether it is there):
liger's modules are loaded wherever liger is installed, as `model.kernels=auto` would load them.
"""

from __future__ import annotations

import importlib.util

import rlx.trainer.megatron  # noqa: F401  (torch, Megatron, rlx's trainer)
import rlx.trainer.rank  # noqa: F401
from rlx.compat import liger
from rlx.models.kernels import KERNEL_SETS

if importlib.util.find_spec("liger_kernel") is not None:
    for name in KERNEL_SETS["liger"].modules:
        liger.module(name)
