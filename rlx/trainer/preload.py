"""A trainer rank's imports, for Ray to load into its idle worker processes ahead of any run.

Ray imports the modules its system config names in `preload_python_modules` into every worker it
starts, before the worker takes work: a Ray that serves several runs in a row (a test session's,
a notebook's) started with `ray_start.start_local(preload=True)` hands each run's trainer ranks
processes that have torch, Megatron and rlx's trainer loaded already (torch 4 s and Megatron 9 s
of a rank's start on 1×H100), where a new process would spend them in the run's start. Idle
workers a run's actors take are not replaced until a run asks for more processes than are idle
(Ray starts one worker a CPU when it starts).

Nothing here may touch CUDA: Ray sets a GPU actor's CUDA_VISIBLE_DEVICES in the worker only when
the actor takes it, and a process that initialised CUDA before keeps seeing every GPU (two ranks
then share one: NCCL's "invalid usage"). liger-kernel asks CUDA whether it is there as its modules
load (`liger_kernel.utils.infer_device`), so its kernels stay in the rank's own warm-up
(`TrainerRank.warm_up`), after Ray has set the GPU.
"""

from __future__ import annotations

import rlx.trainer.megatron  # noqa: F401  (torch, Megatron, rlx's trainer)
import rlx.trainer.rank  # noqa: F401
