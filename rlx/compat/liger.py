"""liger-kernel's modules, imported without peft or transformers.

`liger_kernel.utils`, which every liger module imports first, begins with `import peft` only to set
a flag (`PEFT_AVAILABLE`) that liger's transformers monkey patches read; rlx uses none of them,
only two Triton kernels (the gate-up SwiGLU and the vocab-parallel cross entropy). peft imports
transformers, and transformers whatever of sklearn, scipy and pandas is installed: 3.6 s of a
trainer rank's start on the GPU machine's image (1×H100, `python -X importtime`), in every run,
for a flag. Without peft, liger still imported transformers as it loaded, to ask it whether an
Ascend NPU is there (`liger_kernel.utils.is_npu_available`, called by its cross entropy's module):
2.6 s of a trainer rank's imports on a fresh 1×H200 machine, where a rank that loads a checkpoint
imports transformers for nothing else. So liger loads with both hidden (an import of either fails:
liger records "no peft" and "no NPU", which rlx, CUDA only, never has), and both are importable as
before once liger has loaded. A module a process imported before is left as it is.

liger also marks its op dispatcher (`liger_kernel.backends.dispatch.dispatch`, its functional API,
which rlx does not call) with `@torch.compiler.disable` as it loads, and that decorator imports
dynamo, inductor's modules with it: 0.5 s of CPU here, 1.7 s of a GPU host's (`python -X
importtime`), in a process that compiles nothing. While liger loads, the decorator is applied at
the marked function's first call instead (`_disable_when_called`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import torch

from rlx.compat.megatron_jit import at_first_call

HIDDEN = ("peft", "transformers")


def module(name: str) -> ModuleType:
    """`importlib.import_module(name)` for a liger-kernel module, without peft's or transformers'
    imports (those the process has not made already)."""
    hidden = [h for h in HIDDEN if h not in sys.modules]
    for h in hidden:
        sys.modules[h] = None  # `import h` raises ImportError while this entry is None
    try:
        with _disable_when_called():
            return importlib.import_module(name)
    finally:
        for h in hidden:
            if sys.modules.get(h, 0) is None:
                del sys.modules[h]


@contextlib.contextmanager
def _disable_when_called() -> Iterator[None]:
    """`torch.compiler.disable` deferred to each marked function's first call, within the block."""
    disable = torch.compiler.disable

    def deferred(fn=None, recursive=True, **kwargs):
        if fn is None:  # @torch.compiler.disable(recursive=...)
            return functools.partial(deferred, recursive=recursive, **kwargs)
        return at_first_call(fn, lambda fn: disable(fn, recursive, **kwargs))

    torch.compiler.disable = deferred
    try:
        yield
    finally:
        torch.compiler.disable = disable
