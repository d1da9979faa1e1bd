"""liger-kernel's modules, imported without peft.

`liger_kernel.utils`, which every liger module imports first, begins with `import peft` only to set
a flag (`PEFT_AVAILABLE`) that liger's transformers monkey patches read; rlx uses none of them,
only two Triton kernels (the gate-up SwiGLU and the vocab-parallel cross entropy). peft imports
transformers, and transformers whatever of sklearn, scipy and pandas is installed: 3.6 s of a
trainer rank's start on the GPU machine's image (1×H100, `python -X importtime`), in every run,
for a flag. So liger loads with peft hidden (an import of it fails, liger records "no peft"), and
peft is importable as before once liger has loaded. A process that imported peft or liger before
is left as it is.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

UTILS = "liger_kernel.utils"
HIDDEN = "peft"


def module(name: str) -> ModuleType:
    """`importlib.import_module(name)` for a liger-kernel module, without peft's import."""
    if UTILS in sys.modules or HIDDEN in sys.modules:
        return importlib.import_module(name)
    sys.modules[HIDDEN] = None  # `import peft` raises ImportError while this entry is None
    try:
        return importlib.import_module(name)
    finally:
        if sys.modules.get(HIDDEN, 0) is None:
            del sys.modules[HIDDEN]
