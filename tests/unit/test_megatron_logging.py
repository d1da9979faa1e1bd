"""megatron-core's Megatron-FSDP modules log three INFO lines when imported; rlx quiets them
(rlx/compat/megatron_logging.py), so a run's output does not start with them."""

from __future__ import annotations

import subprocess
import sys

IMPORT = (
    "import logging; logging.basicConfig(level=logging.INFO); {first}"
    "import megatron.core.distributed; logging.getLogger('megatron.core.distributed.fsdp').warning('still warns')"
)


def _stderr(first: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", IMPORT.format(first=first)], capture_output=True, text=True, timeout=120
    ).stderr


def test_importing_megatron_after_rlx_logs_no_fsdp_info_but_keeps_warnings():
    assert "Megatron-FSDP" in _stderr("")  # megatron alone says it (the check below can fail)
    quiet = _stderr("import rlx; ")
    assert "Megatron-FSDP" not in quiet
    assert "still warns" in quiet


STORAGE = (
    "import torch; {first}t = torch.zeros(4); "
    "exec(compile('t.storage().size()', 'param_and_grad_buffer.py', 'exec'), {{'__name__': '{module}', 't': t}})"
)


def _storage_stderr(first: str, module: str) -> str:
    code = STORAGE.format(first=first, module=module)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stderr


def test_megatrons_typed_storage_warning_is_quiet_on_trainer_ranks_and_others_still_warn():
    """megatron's buffers free themselves through `tensor.storage()` when a colocated trainer
    offloads (seen once a run on the GPU); rlx.trainer quiets that warning for megatron's code
    only: the same call from another module still warns."""
    module = "megatron.core.distributed.param_and_grad_buffer"
    assert "TypedStorage is deprecated" in _storage_stderr("", module)  # torch warns without rlx
    assert "TypedStorage is deprecated" not in _storage_stderr("import rlx.trainer; ", module)
    assert "TypedStorage is deprecated" in _storage_stderr("import rlx.trainer; ", "users_code")
