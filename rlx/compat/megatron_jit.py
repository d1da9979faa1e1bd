"""megatron-core's torch.compile'd helpers, left uncompiled on a machine without a GPU.

megatron-core wraps about twenty small functions (bias + SwiGLU/GeLU fusions, the MoE router's
expert-bias update, ...) in `megatron.core.jit.jit_fuser`, which is `torch.compile`. Making those
wrappers imports inductor while megatron loads: about 2.6 s of CPU in every process that imports
megatron (7.2 s with it, 4.6 s without). On a CPU they buy nothing: rlx turns megatron's fusions
off without CUDA (rlx.models.kernels), and the one that still runs there, the MoE router's
expert-bias update on a vector of a few experts, is compiled anew in every trainer process, a
few seconds each (dynamo retraces rlx's CPU device mode, rlx.compat.megatron_cpu).

So, without CUDA (`_has_gpu`, which leaves CUDA uninitialised), megatron takes its own
`noop_decorator` (`megatron.core.jit.disable_jit_fuser`) as `megatron.core.jit` loads, before the
modules that use `jit_fuser` import it; the functions then run eagerly. With a GPU each is
torch.compile'd as before, but on its first call (`compile_on_first_call`): with rlx's fused kernels
none of them runs in a dense model's step, and megatron's import then loads no inductor (1xH200's
host, 2026-11-30: `python -X importtime` put 4.0 s under `fused_bias_geglu`, the first helper;
`import rlx.trainer.megatron` 7.9 -> 5.1 s). `install()` runs when `rlx` is imported (rlx's modules
import megatron only after that); in a process that imported megatron before rlx it is too late, and
megatron stays as it was.

No torch at import time: `import rlx` stays light.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import os
import sys

JIT_MODULE = "megatron.core.jit"
NVIDIA_DEVICE = "/dev/nvidiactl"  # the driver's control device, there wherever an NVIDIA GPU is


class _JitFinder(importlib.abc.MetaPathFinder):
    """Finds `megatron.core.jit` through the normal path finder and runs `_after_load` on it."""

    def find_spec(self, name, path, target=None):
        if name != JIT_MODULE:
            return None
        uninstall()  # once is enough; find the real spec without this finder in the way
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_adjust(module):
            exec_module(module)
            _after_load(module)

        spec.loader.exec_module = exec_then_adjust
        return spec


_finder = _JitFinder()


def _after_load(jit_module) -> None:
    if not _has_gpu():
        jit_module.disable_jit_fuser()
    else:
        jit_module.jit_fuser = compile_on_first_call


def compile_on_first_call(fn):
    """megatron's `jit_fuser` on a GPU: `torch.compile(fn)`, made when `fn` is first called."""

    def compile_(fn):
        import torch

        return torch.compile(fn)

    return at_first_call(fn, compile_)


def at_first_call(fn, decorate):
    """`fn` as `decorate(fn)`, which is made when `fn` is first called (a decorator whose import
    or work a process should pay only if it calls `fn`; rlx.compat.liger's too)."""
    decorated = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal decorated
        if decorated is None:
            decorated = decorate(fn)
        return decorated(*args, **kwargs)

    return call


def _has_gpu() -> bool:
    """Whether this process will find a CUDA GPU, asked without initialising CUDA where it is not
    yet: a process that initialised CUDA keeps the GPUs it saw then, and a Ray worker that imports
    megatron before it takes a GPU actor (`rlx.trainer.preload`) is told its GPU only when it takes
    it (CUDA_VISIBLE_DEVICES). So: a CUDA build of torch, the NVIDIA driver's device node, and
    CUDA_VISIBLE_DEVICES not set to none."""
    import torch  # loaded by megatron.core.jit itself

    if torch.cuda.is_initialized():
        return torch.cuda.is_available()
    if torch.version.cuda is None or os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1"):
        return False
    return os.path.exists(NVIDIA_DEVICE)


def install() -> None:
    """Have megatron load without torch.compile'd helpers when there is no CUDA, and compile them
    when first called where there is (idempotent)."""
    if JIT_MODULE not in sys.modules and _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def uninstall() -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
