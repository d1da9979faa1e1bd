"""The truncating sampler (rlx.engine.triton_truncate) compiles its kernels once: a step's
truncating rows vary (requests finish, join, change settings), and a compile inside a rollout
costs about a second. Its draws are tested in tests/kernels/test_truncated_sampler.py."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def compiled_kernels() -> int:
    """Kernels Triton holds compiled for the module's jit functions, over every device."""
    from rlx.engine import triton_truncate

    functions = [getattr(triton_truncate, name) for name in dir(triton_truncate) if name.startswith("_")]
    caches = [c[0] for f in functions if hasattr(f, "device_caches") for c in f.device_caches.values()]
    return sum(map(len, caches))  # each device's (kernel cache, ...) entry


def test_truncated_sampler_compiles_once_whatever_the_rows():
    """After a first call at 256 rows, calls at 1-300 rows compile nothing."""
    from rlx.engine.triton_truncate import truncated_sample

    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(4)
    logits = torch.randn(300, 151936, device=device, generator=g).bfloat16()
    n = logits.shape[0]
    params = (
        torch.ones(n, device=device), torch.full((n,), 40, device=device), torch.full((n,), 0.9, device=device),
        torch.zeros(n, device=device), torch.arange(n, device=device), torch.zeros(n, dtype=torch.int64, device=device),
    )  # fmt: skip
    tokens = torch.empty(n, dtype=torch.int64, device=device)
    logprobs = torch.empty(n, device=device)

    def draw(rows: int) -> None:
        truncated_sample(logits, torch.arange(rows, device=device), *params, tokens, logprobs)

    draw(256)
    before = compiled_kernels()
    for rows in (1, 3, 17, 64, 100, 255, 300):
        draw(rows)
    torch.cuda.synchronize()
    assert compiled_kernels() == before > 0
