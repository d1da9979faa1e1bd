"""megatron-core on a machine without a GPU: the one place where its CUDA-only calls are redirected.

megatron-core assumes CUDA throughout (about 500 `torch.cuda.*` calls, about 80 hard-coded
`device="cuda"`), and no configuration flag avoids them. `apply()` makes the dense GPT training
path (TP, PP with the 1F1B and interleaved schedules, DP, megatron DDP, `get_megatron_optimizer`,
grad clipping, `get_forward_backward_func`) run on CPU over gloo:

- `torch.cuda.current_device()` returns device index 0, which the device mode below turns into
  the CPU wherever it reaches a tensor;
- the CUDA RNG (`torch.cuda.{get,set}_rng_state`, `manual_seed`) and megatron's own tracker
  helpers (`_get_cuda_rng_state` / `_set_cuda_rng_state`) act on the CPU generator, so megatron's
  RNG tracker forks and restores real state exactly as it would on a GPU;
- `torch.cuda.synchronize`, streams, events and `Tensor.record_stream` become no-ops (CPU work
  is already ordered);
- the autograd engine runs backward passes without the caller's torch-function modes, so the
  backward of every Python autograd Function (megatron's TP/SP/EP communication ops allocate
  on "cuda" there) re-enters the device mode below;
- a `TorchFunctionMode` rewrites `device="cuda"` / an index / `.cuda()` / `.to("cuda")` /
  `torch.device(<index>)` to the CPU, makes `pin_memory` (the method and the argument) a no-op, and answers `Tensor.type()` with the CUDA
  type name when megatron itself asks (its optimizer and grad clipping insist on
  `torch.cuda.FloatTensor`).

Nothing is changed when a GPU is present. The device mode lives on a thread's torch-function
mode stack, so `apply()` must run in every thread that executes megatron code (it is cheap and
idempotent; `rlx.trainer.parallel.init_distributed` calls it).

Without Transformer Engine (GPU or not), `apply()` also works around megatron-core bugs on the
MoE, MLA and sequence-parallel paths (see `_patch_without_te`); on the CPU it also makes the
MoE all-to-all pass its split sizes as lists (`_patch_cpu_all_to_all`). Not covered: CUDA graphs, FSDP,
offloading, fused kernels.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import logging
import sys
import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_lock = threading.Lock()
_patched = False  # process-wide patches (module attributes) are applied once
_patched_without_te = False
_thread_state = threading.local()  # the device mode is pushed once per thread

# Tensor types megatron compares `Tensor.type()` against, keyed by the CPU answer.
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
}


def apply() -> bool:
    """Redirect megatron-core's CUDA-only calls to the CPU; with a GPU, only the no-TE fixes.

    Idempotent: the process-wide patches are applied once, the device mode once per calling
    thread. Returns True when the boundary is active (no GPU), False otherwise.
    """
    global _patched, _patched_without_te
    with _lock:
        if not _patched_without_te:
            if importlib.util.find_spec("transformer_engine") is None:
                _patch_without_te()
            _patched_without_te = True
    if torch.cuda.is_available():
        return False
    with _lock:
        if not _patched:
            _patch_torch_cuda()
            _patch_megatron_rng()
            _patch_cpu_all_to_all()
            _patch_custom_function_backward()
            _patched = True
    if not getattr(_thread_state, "mode", None):
        mode = _CpuDeviceMode()
        # Entered and never exited: the mode stays on this thread's stack for its lifetime.
        mode.__enter__()
        _thread_state.mode = mode
    return True


def is_applied() -> bool:
    """Whether `apply()` has taken effect in this thread."""
    return bool(getattr(_thread_state, "mode", None))


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    # A bare int is a CUDA index here: it is what the patched current_device() hands out.
    return isinstance(device, int) and not isinstance(device, bool)


class _CpuDeviceMode(TorchFunctionMode):
    """Sends every tensor megatron puts on "cuda" to the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]  # already where "the device" is
        if func is torch.Tensor.pin_memory:
            return args[0]  # pinning needs a CUDA context; CPU memory is already "host" memory
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _type_name(args[0], caller=sys._getframe(1))
        if func is torch.device and args and _is_cuda_device(args[0]) and isinstance(args[0], int):
            # torch.device(current_device()) (e.g. `with torch.device(...)` in YaRN RoPE) raises
            # on a CPU build; the index is the patched current_device()'s, i.e. "the device".
            return torch.device("cpu")
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):  # torch.tensor(..., pin_memory=True): CP's RoPE rows, for one
            kwargs = {**kwargs, "pin_memory": False}
        if func is torch.Tensor.to and any(_is_cuda_device(a) for a in args[1:]):
            args = (args[0], *("cpu" if _is_cuda_device(a) else a for a in args[1:]))
        return func(*args, **kwargs)


def _type_name(tensor: torch.Tensor, caller) -> str:
    name = torch.Tensor.type(tensor)
    # Only megatron gets the CUDA name, so code elsewhere still sees the truth.
    if caller.f_globals.get("__name__", "").startswith("megatron."):
        return _CUDA_TYPE_NAMES.get(name, name)
    return name


class _CpuStream:
    """Stands in for torch.cuda.Stream: CPU work is already ordered, so waiting is a no-op."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuEvent:
    """Stands in for torch.cuda.Event (no timing on CPU)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event) -> float:
        return 0.0


def _noop() -> Any:
    # A fresh function per patched name: torch.compile indexes torch functions by identity and
    # rejects one object registered under several names.
    def noop(*args, **kwargs) -> None:
        return None

    return noop


def _record_stream_noop(self: torch.Tensor, stream: Any) -> None:
    return None


def _cpu_get_rng_state(device: Any = "cuda", *args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, *args, **kwargs) -> None:
    torch.set_rng_state(new_state.cpu() if new_state.device.type != "cpu" else new_state)


def _cpu_manual_seed(seed: int) -> None:
    # The CPU generator is "the device generator" here, as the CUDA one is on a GPU. Not
    # torch.manual_seed: that calls torch.cuda.manual_seed_all, which must stay a no-op.
    torch.default_generator.manual_seed(seed)


def _patch_torch_cuda() -> None:
    """Replace the torch.cuda functions megatron calls; on a CPU build they raise or do nothing."""
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.set_device = _noop()
    cuda.synchronize = _noop()
    cuda.set_stream = _noop()
    cuda.Stream = _CpuStream
    cuda.Event = _CpuEvent
    cuda.current_stream = lambda device=None: _CpuStream()
    cuda.default_stream = lambda device=None: _CpuStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    # Patched on the class, not in the device mode: the argument parser rejects a stand-in
    # stream before any torch-function mode sees the call.
    torch.Tensor.record_stream = _record_stream_noop
    for namespace in (cuda, cuda.random):
        namespace.get_rng_state = _cpu_get_rng_state
        namespace.set_rng_state = _cpu_set_rng_state
        namespace.manual_seed = _cpu_manual_seed


class _DropCpuRngWarning(logging.Filter):
    """The tracker warns when the CPU RNG moves inside a fork; here that RNG is the one forked."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != "CPU RNG state changed within GPU RNG context"


def _patch_megatron_rng() -> None:
    """Point megatron's own CUDA RNG helpers (used by its RNG tracker) at the CPU generator."""
    from megatron.core.tensor_parallel import random as mp_random

    logging.getLogger(mp_random.__name__).addFilter(_DropCpuRngWarning())

    mp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mp_random._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: _cpu_set_rng_state(
        new_state
    )


# ---- megatron-core without Transformer Engine (GPU or CPU) -----------------------------------------


def _patch_without_te() -> None:
    """Work around megatron-core 0.16 bugs that show only when Transformer Engine is absent.

    - `moe_utils.te_general_gemm` is defined only by the TE import, yet the router's gating GEMM
      tests `te_general_gemm is not None`: a NameError in every MoE forward;
    - without TE, `megatron.core.extensions.transformer_engine` stands MagicMocks in for the TE
      classes, so `multi_latent_attention`'s import guard reads HAVE_TE=True and its
      `isinstance(linear_proj, TELinear)` raises TypeError;
    - the torch norm (`WrappedTorchNorm`) refuses sequence parallelism, which MoE with TP > 1
      needs. A norm is per token, so it computes the same under SP; what SP needs is that its
      weights carry `sequence_parallel=True`, so megatron all-reduces their gradients over TP
      (what megatron's own fused norms do).

    The local spec's `DotProductAttention` also rejects the `k_channels` / `v_channels` that MLA
    passes; rlx's MLA layers use `rlx.models.attention.SDPAttention`, which accepts them.
    """
    from megatron.core.transformer import multi_latent_attention, torch_norm
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    multi_latent_attention.HAVE_TE = False
    norm_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return norm_new(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = norm_new(cls, plain, hidden_size, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)


def _patch_cpu_all_to_all() -> None:
    """The MoE all-to-all dispatcher turns its split-size tensors into numpy arrays only when they
    are on a GPU (`moe_utils.maybe_move_tensor_to_cpu`); on the CPU they stay tensors, which
    `all_to_all_single` rejects (it takes sequences of ints). Pass them as lists."""
    from megatron.core.transformer.moe import token_dispatcher

    all_to_all = token_dispatcher.all_to_all

    def as_list(splits):
        return splits.tolist() if hasattr(splits, "tolist") else splits

    def all_to_all_with_lists(group, input_, output_split_sizes_=None, input_split_sizes=None):
        return all_to_all(group, input_, as_list(output_split_sizes_), as_list(input_split_sizes))

    token_dispatcher.all_to_all = all_to_all_with_lists


def _patch_custom_function_backward() -> None:
    """Run the backward of Python autograd Functions under the device mode.

    The autograd engine does not carry torch-function modes into backward passes, so megatron's
    communication Functions (sequence-parallel reduce-scatter, the MoE all-to-all), which
    allocate with `device=torch.cuda.current_device()` in their backward, would fail there.
    """
    from torch.autograd.function import BackwardCFunction
    from torch.overrides import _get_current_function_mode_stack

    apply = BackwardCFunction.apply

    def apply_on_cpu(self, *args):
        if any(isinstance(m, _CpuDeviceMode) for m in _get_current_function_mode_stack()):
            return apply(self, *args)
        with _CpuDeviceMode():
            return apply(self, *args)

    BackwardCFunction.apply = apply_on_cpu
