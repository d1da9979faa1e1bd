"""rlx.engine.memory_saver's layout on the CPU: `Arena.holding` sizes an arena to its tensors,
each at a 256-byte-aligned offset, back to back, and `take` refuses what does not fit. The
device mapping itself needs CUDA (tests/gpu/test_memory_saver.py)."""

from __future__ import annotations

import pytest
import torch

from rlx.engine.memory_saver import Arena


class HostArena(Arena):
    """The arena's bookkeeping over a host buffer (no CUDA driver calls)."""

    def __init__(self, num_bytes: int, device: torch.device):
        self.num_bytes, self._used = num_bytes, 0
        self._whole = torch.zeros(num_bytes, dtype=torch.uint8)


def test_holding_lays_tensors_out_aligned_and_sized_exactly():
    specs = [((3, 5), torch.bfloat16), ((7,), torch.float32), ((2, 2, 2), torch.int64)]
    arena, tensors = HostArena.holding(specs, torch.device("cpu"))
    # 30 bytes at 0; 28 at 256; 64 at 512: the arena ends with the last tensor
    base = arena._whole.data_ptr()
    assert [t.data_ptr() - base for t in tensors] == [0, 256, 512]
    assert arena.num_bytes == 512 + 64
    assert [(tuple(t.shape), t.dtype) for t in tensors] == [(tuple(s), d) for s, d in specs]
    tensors[1].fill_(2.5)  # views of one buffer, apart
    assert tensors[0].float().sum() == 0 and tensors[1].sum() == 17.5
    with pytest.raises(ValueError, match="the arena holds 576 bytes; 769 asked for"):
        arena.take((1,), torch.uint8)
