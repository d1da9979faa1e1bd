"""The Triton kernels' own tests: on a CUDA GPU (run with `python -m pytest tests/gpu tests/kernels`,
docs/gpu.md) in the dtype the engine serves, bf16; and on the CPU in Triton's interpreter
(`TRITON_INTERPRET=1`, in fp32: the interpreter holds no bf16), which is how CI checks them:
tests/unit/test_triton_interpreted.py runs this directory so. Without either they skip."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.fixture(scope="session")
def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    if INTERPRETED:
        return torch.device("cpu")
    pytest.skip("needs CUDA, or Triton's CPU interpreter (tests/unit/test_triton_interpreted.py runs it)")


@pytest.fixture(scope="session")
def dtype(device) -> torch.dtype:
    """bf16 on the GPU, as the engine serves; fp32 in the interpreter, which holds no bf16."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32
