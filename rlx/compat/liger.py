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
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

HIDDEN = ("peft", "transformers")


def module(name: str) -> ModuleType:
    """`importlib.import_module(name)` for a liger-kernel module, without peft's or transformers'
    imports (those the process has not made already)."""
    hidden = [h for h in HIDDEN if h not in sys.modules]
    for h in hidden:
        sys.modules[h] = None  # `import h` raises ImportError while this entry is None
    try:
        return importlib.import_module(name)
    finally:
        for h in hidden:
            if sys.modules.get(h, 0) is None:
                del sys.modules[h]
