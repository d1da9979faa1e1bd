"""The Triton kernels' own tests (tests/kernels) run in Triton's CPU interpreter, so that CI, which
has no GPU, checks what the kernels compute (in fp32: the interpreter holds no bf16). scripts/test.sh
installs Triton for it into a directory of its own, `RLX_TRITON_DIR`, which only the child process
below has on its path: an importable triton would change what torch and liger-kernel choose in
this process on the CPU. Triton 3.9: 3.6's interpreter (what torch 2.11 brings on the GPU machine)
cannot take a loop bound passed as an argument under numpy 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_triton_kernels_pass_in_the_interpreter():
    triton_dir = os.environ.get("RLX_TRITON_DIR")
    if not triton_dir:
        pytest.skip("RLX_TRITON_DIR unset: scripts/test.sh installs Triton for the interpreter and sets it")
    assert (Path(triton_dir) / "triton").is_dir(), (
        f"RLX_TRITON_DIR={triton_dir} holds no triton package: "
        f"python -m pip install --no-deps --target {triton_dir} triton==3.9.0"
    )
    path = [triton_dir, str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(path))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider", "-n", "0"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    output = result.stdout[-4000:] + result.stderr[-2000:]
    assert result.returncode == 0, output
    assert " passed" in summary and "skipped" not in summary, output  # every kernel test ran
