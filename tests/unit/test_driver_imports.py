"""The driver's side of a run imports no Megatron: a trainer rank's actor class lives in a module of
its own (`rlx.trainer.rank`) whose process imports Megatron when it sets up. Every `launch.py`,
SLURM and sweep process used to pay megatron-core's import (about 3.8 s of CPU) for a class it
only hands to Ray."""

from __future__ import annotations

import subprocess
import sys


def test_the_run_loop_and_the_trainer_group_import_no_megatron():
    code = (
        "import sys; import rlx.runtime, rlx.trainer.group, rlx.colocation, rlx.weight_sync.publisher; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout[:500]
