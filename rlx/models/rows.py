"""How a tensor's rows over its last dimension lie in memory, for the Triton kernels that read rows
where they are (`rlx.models.triton_norm`): plain torch, so the layouts are tested without a GPU.

A row layout `(outer, inner, group)` puts row r at element offset
`(r // group) * outer + (r % group) * inner` from the view's start (its last dimension contiguous).
"""

from __future__ import annotations

import torch


def _even_rows(t: torch.Tensor) -> torch.Tensor | None:
    """`t` as a [rows, N] view of its last dimension where its rows are evenly spaced (torch's
    `view` merges the leading dimensions only then), else None."""
    if t.stride(-1) == 1:
        try:
            return t.view(-1, t.shape[-1])
        except RuntimeError:  # "view size is not compatible with input tensor's size and stride"
            pass
    return None


def rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """`(rows, row stride)`: `t` as a [rows, N] view where its rows are evenly spaced, else a
    contiguous copy."""
    view = _even_rows(t)
    if view is None:
        view = t.contiguous().view(-1, t.shape[-1])
    return view, view.stride(0)


def grouped_rows(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """`t`'s rows as they lie: `(view, (outer, inner, group))` (the module's row layout): evenly
    spaced rows (group 1), or groups of
    `t.shape[-2]` evenly spaced rows that are themselves evenly spaced (the query heads of a KV group
    in megatron's fused QKV projection, [s, b, groups, heads a group, d]); else a contiguous copy."""
    n = t.shape[-1]
    view = _even_rows(t)
    if view is not None:
        return view, (view.stride(0), 0, 1)
    if t.stride(-1) == 1 and t.dim() >= 3:
        try:
            groups = t.view(-1, t.shape[-2], n)
            return groups, (groups.stride(0), groups.stride(1), groups.shape[1])
        except RuntimeError:  # nor in evenly spaced groups
            pass
    return t.contiguous().view(-1, n), (n, 0, 1)
