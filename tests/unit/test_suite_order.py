"""The suite's order (tests/conftest.py `pytest_collection_modifyitems`): a module that uses the
GPU suite's Ray (`gpu_ray`, whose idle workers preload a trainer rank's imports) runs before every
module of the last band, the first of which stops its process's Ray. Placed after one, such a
module found Ray stopped, and its runs started a Ray without the preload
(tests/gpu/test_preload_gpu.py failed on a GPU). Collection alone says it, so it runs on CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_modules_of_the_gpu_suites_ray_come_before_the_last_band():
    files = ["tests/unit/test_pytest_cpu.py", "tests/gpu/test_preload_gpu.py", "tests/gpu/test_kernels.py"]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    order = [line.split("::")[0] for line in done.stdout.splitlines() if "::" in line]
    first = list(dict.fromkeys(order))  # each file once, in the order its tests run
    # test_pytest_cpu (5 s in FILE_SECONDS) and test_kernels are last-band modules
    assert first[0] == "tests/gpu/test_preload_gpu.py", first
    assert set(first) == set(files), first
