"""Loading HF safetensors into the live model, in place: names and shapes are checked for every
file before any tensor is copied, so a bad checkpoint changes nothing."""

from __future__ import annotations

import bisect
import json
from pathlib import Path

import torch

# Buffers some exporters write that the engine recomputes itself.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def safetensors_files(path: Path) -> list[Path]:
    """The checkpoint's files: the index's shards if there is an index, else every *.safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {path}")
    return files


def load_weights(views: dict[str, torch.Tensor], path: str | Path, *, require_all: bool = False) -> int:
    """Copy every tensor of the checkpoint at `path` into `views[name]`; returns tensors loaded.

    `require_all`: every distinct live tensor must be written (the initial load).
    """
    from safetensors import safe_open

    files = safetensors_files(Path(path))
    plan: list[tuple[Path, str]] = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name not in views:
                    raise ValueError(f"{name}: not a tensor of this model")
                shape = tuple(f.get_slice(name).get_shape())
                if tuple(views[name].shape) != shape:
                    raise ValueError(f"{name}: shape {shape} != model's {tuple(views[name].shape)}")
                plan.append((file, name))
    if require_all:
        missing = unwritten(views, [name for _, name in plan])
        if missing:
            raise ValueError(f"checkpoint at {path} lacks {missing[:5]}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for _, name in (item for item in plan if item[0] == file):
                views[name].copy_(f.get_tensor(name))
    return len(plan)


def unwritten(views: dict[str, torch.Tensor], written_names, among=None) -> list[str]:
    """The names (of `among`, default all of `views`) whose live tensor none of `written_names`
    wrote: tied names share a tensor, and a stacked tensor counts once one of its views is written.
    Sorted start addresses make it O(n log n): a MoE model has thousands of per-expert views, and
    a weight sync calls this once per bucket."""
    written = {_key(views[name]) for name in written_names}
    starts = sorted(ptr for ptr, _ in written)
    names = views if among is None else among
    return sorted(n for n in names if _key(views[n]) not in written and not _covered(views[n], starts))


def _key(t: torch.Tensor) -> tuple[int, tuple[int, ...]]:
    return (t.data_ptr(), tuple(t.shape))


def _covered(t: torch.Tensor, starts: list[int]) -> bool:
    """Whether a written tensor starts inside `t` (a stacked tensor whose per-expert views were written)."""
    ptr = t.data_ptr()
    i = bisect.bisect_left(starts, ptr)
    return i < len(starts) and starts[i] < ptr + t.nbytes
