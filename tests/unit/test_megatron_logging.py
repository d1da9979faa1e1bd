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
