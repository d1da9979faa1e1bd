"""rlx.flat.flat_tensor: per-sample lists end to end, the values torch.tensor would give."""

from __future__ import annotations

import math
import warnings
from itertools import chain

import pytest
import torch

from rlx.flat import flat_tensor


def test_rows_end_to_end_with_their_values():
    assert flat_tensor([[3, 1], [], [4, 1, 5]], torch.int64).tolist() == [3, 1, 4, 1, 5]
    assert flat_tensor([[2**40, -7]], torch.int64).dtype == torch.int64
    assert flat_tensor([[1, 0, 2], [0]], torch.bool).tolist() == [True, False, True, False]  # nonzero is True
    assert flat_tensor([[1, 0]], torch.float64).tolist() == [1.0, 0.0]
    assert flat_tensor([]).shape == (0,) and flat_tensor([]).dtype == torch.float32
    assert flat_tensor(iter([(0.5,), (0.25,)])).tolist() == [0.5, 0.25]  # any iterables


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_floats_round_as_torch_tensor_rounds_them(dtype):
    # 0.1 and 1/3 are not floats exactly; 1e-46 is below float32's smallest subnormal
    rows = [[0.1, 1 / 3, -2.5e-8], [1e-46, 123456.789], [-math.inf, math.inf]]
    expected = torch.tensor(list(chain.from_iterable(rows)), dtype=dtype)
    assert torch.equal(flat_tensor(rows, dtype), expected)
    assert flat_tensor([[math.nan]], dtype).isnan().all()


def test_none_reads_as_nan_and_overflow_as_inf_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        values = flat_tensor([[None, 3.4e39, -3.4e39]]).tolist()
    assert math.isnan(values[0]) and values[1:] == [math.inf, -math.inf]


def test_an_unsupported_dtype_is_named():
    with pytest.raises(ValueError, match="torch.float16"):
        flat_tensor([[1.0]], torch.float16)
