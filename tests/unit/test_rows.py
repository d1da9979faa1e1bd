"""rlx.models.rows: the row layouts the Triton norm reads in place (tests/gpu/test_kernels.py checks
its numbers on a GPU). Each layout is checked by reading every row back from the tensor's storage
at the offsets the kernel would use, against the tensor's own rows."""

from __future__ import annotations

import pytest
import torch

from rlx.models.rows import grouped_rows, rows


def read_back(view: torch.Tensor, layout: tuple[int, int, int], n_rows: int, n: int) -> torch.Tensor:
    """The [n_rows, n] rows at the layout's offsets from `view`'s first element, as the kernel reads
    them (row r at (r // group) * outer + (r % group) * inner)."""
    outer, inner, group = layout
    storage = torch.as_strided(view, (view.untyped_storage().nbytes() // view.element_size(),), (1,), 0)
    r = torch.arange(n_rows)
    at = view.storage_offset() + (r // group) * outer + (r % group) * inner
    return storage[at[:, None] + torch.arange(n)]


def fused_qkv(s=5, b=3, groups=4, heads_a_group=2, d=16) -> torch.Tensor:
    """megatron's fused QKV projection output, [s, b, groups, (heads a group + 2) x d]."""
    return torch.randn(s, b, groups, (heads_a_group + 2) * d)


CASES = {
    # the query heads of each KV group: groups of 2 evenly spaced rows, the groups evenly spaced
    "query heads": (lambda qkv: qkv[..., :32].unflatten(-1, (2, 16)), (4 * 16, 16, 2), True),
    # the key head of each group (one a group): evenly spaced rows
    "key heads": (lambda qkv: qkv[..., 32:48], (4 * 16, 0, 1), True),
    "contiguous": (lambda qkv: qkv.clone(), (4 * 16, 0, 1), True),
    # batch-major over a sequence-major tensor: neither evenly spaced nor in groups, so copied
    "transposed": (lambda qkv: qkv.transpose(0, 1)[:, :, :3, :16], (16, 0, 1), False),
}


@pytest.mark.parametrize("name", CASES)
def test_grouped_rows_address_every_row_where_it_lies(name):
    take, layout, in_place = CASES[name]
    t = take(fused_qkv())
    n = t.shape[-1]
    view, got = grouped_rows(t)
    assert got == layout
    assert (view.data_ptr() == t.data_ptr()) is in_place
    assert torch.equal(read_back(view, got, t.numel() // n, n), t.reshape(-1, n))


def test_rows_copy_what_is_not_evenly_spaced():
    qkv = fused_qkv()
    keys = qkv[..., 32:48]
    view, stride = rows(keys)
    assert view.data_ptr() == keys.data_ptr() and stride == 4 * 16
    query = qkv[..., :32].unflatten(-1, (2, 16))
    view, stride = rows(query)  # in groups only: a plain [rows, N] read needs the copy
    assert view.data_ptr() != query.data_ptr() and view.is_contiguous() and stride == 16
    assert torch.equal(view, query.reshape(-1, 16))
