"""A trainer rank's imports, for Ray to load into its idle worker processes ahead of any run.

Ray imports the modules its system config names in `preload_python_modules` into every worker it
starts, before the worker takes work: a Ray that serves several runs in a row (a test session's,
a notebook's) started with `ray_start.start_local(preload=True)` hands each run's trainer ranks
processes that have torch, Megatron and rlx's trainer loaded already (torch 4 s and Megatron 9 s
of a rank's start on 1×H100), where a new process would spend them in the run's start. Idle
workers a run's actors take are not replaced until a run asks for more processes than are idle
(Ray starts one worker a CPU when it starts).

Nothing here may initialise CUDA: Ray sets a GPU actor's CUDA_VISIBLE_DEVICES in the worker only
when the actor takes it, and a process that initialised CUDA before keeps seeing every GPU (two
ranks then share one: NCCL's "invalid usage"). torch's inductor, which Megatron's compiled helpers
load, asks `torch.cuda.is_available()` as it loads: here it is answered through NVML
(PYTORCH_NVML_BASED_CUDA_CHECK, which leaves CUDA alone), and NVML is shut down after, so the idle
worker holds no GPU device open. liger-kernel's modules stay in the rank's own warm-up
(`TrainerRank.warm_up`), after Ray has set the GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _shut_nvml() -> None:
    """End every NVML session torch's checks began (each `nvmlInit` counts once)."""
    with contextlib.suppress(OSError, AttributeError):
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        for _ in range(256):
            if nvml.nvmlShutdown() != 0:  # NVML_ERROR_UNINITIALIZED: all ended
                break


_before = os.environ.get(NVML_CHECK)
os.environ[NVML_CHECK] = "1"
try:
    import rlx.trainer.megatron  # noqa: F401  (torch, Megatron, rlx's trainer)
    import rlx.trainer.rank  # noqa: F401
finally:
    if _before is None:
        del os.environ[NVML_CHECK]
    else:
        os.environ[NVML_CHECK] = _before
    _shut_nvml()
