"""Many Python lists as one flat tensor, the way the trainer's host work needs them.

A rollout batch's per-token fields (tokens, engine log-probs, loss masks) arrive as one Python list
per sample; the trainer joins them end to end before padding or reducing. `torch.tensor` over
a list of Python numbers converts each number through torch's generic sequence path: 4.0 ms for
32,816 ints on a 2-core CPU, where numpy reading the same values straight from an iterator
(`np.fromiter`, then `torch.from_numpy`, no copy) takes 0.5 ms. The values, and the float32
rounding of Python floats, are the same (both cast a C double to the nearest float).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

import numpy as np
import torch

_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.bool: np.bool_,
}


def flat_tensor(rows: Iterable[Iterable], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of `rows` (lists of numbers, or any iterables) end to end, as one 1-d tensor of
        `dtype` (float32 and float64, int64 and int32, or bool: nonzero is True). Unlike `torch.tensor`,
    a None among floats reads as NaN (JSON's null for a non-finite log-prob means that too)."""
    if dtype not in _NUMPY:
        raise ValueError(f"flat_tensor takes {', '.join(map(str, _NUMPY))}, not {dtype}")
    with np.errstate(over="ignore"):  # a float beyond float32's range becomes inf, as torch makes it
        return torch.from_numpy(np.fromiter(chain.from_iterable(rows), dtype=_NUMPY[dtype]))
