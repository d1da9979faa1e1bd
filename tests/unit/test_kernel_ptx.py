"""The engine's Triton kernels compiled for Hopper (sm90) on the CPU by bench/kernel_ptx.py, in a
child process with the interpreter's Triton (`RLX_TRITON_DIR`, as tests/unit/test_triton_interpreted.py
runs it): none spills to local memory, and the RMSNorm, the engine's most called small kernel
(57 calls a 1.7B decode step), loads its weight before its PDL wait and nothing after its first
store (a load written after work on earlier data is issued only once that data has arrived:
docs/benchmarks.md, Decisions, PDL)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_engine_kernels_compile_for_sm90_without_spills_and_the_norm_loads_first():
    triton_dir = os.environ.get("RLX_TRITON_DIR")
    if not triton_dir:
        pytest.skip("RLX_TRITON_DIR unset: scripts/test.sh installs Triton for the interpreter and sets it")
    path = [triton_dir, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    result = subprocess.run(
        [sys.executable, "bench/kernel_ptx.py"], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(path)),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    kernels = {name: k for name, k in report.items() if isinstance(k, dict)}
    assert set(kernels) == {
        "add_rms_norm",
        "qk_norm_rope_store",
        "silu_mul",
        "sample_blocks",
        "sample_select",
    }
    assert all(k["local_bytes"] == 0 for k in kernels.values()), kernels
    ops = [op for op, _ in kernels["add_rms_norm"]["memory_order"]]
    wait = ops.index("griddepcontrol.wait")
    first_store = next(i for i, op in enumerate(ops) if op.startswith("st.global"))
    assert any(op.startswith("ld.global") for op in ops[:wait]), ops  # the weight, before the wait
    assert not any(op.startswith("ld.global") for op in ops[first_store:]), ops
