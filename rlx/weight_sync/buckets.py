"""Buckets of named tensors: bounded size, flattened into one contiguous uint8 buffer each.

The layout is SGLang's `flattened_bucket` one: tensors packed back to back in order, no padding,
so an engine that knows only the names, dtypes and shapes (the `/update_weights_from_distributed`
fields) recomputes the same byte offsets (`BucketMeta.from_fields`). A tensor whose packed offset
would not be a multiple of its element size starts a new bucket instead of being padded, so every
view on the receiving side is aligned and the layout stays SGLang's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "BucketMeta",
    "TensorSpec",
    "dtype_from_str",
    "dtype_to_str",
    "flatten",
    "iter_buckets",
    "unflatten",
]


def dtype_to_str(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `"bfloat16"`, the spelling SGLang's HTTP API takes."""
    return str(dtype).removeprefix("torch.")


def dtype_from_str(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor's place in a bucket: `nbytes` bytes at byte `offset` of the flat buffer."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class BucketMeta:
    """What a receiver needs to rebuild a bucket: each tensor's name, shape, dtype and byte range."""

    specs: tuple[TensorSpec, ...]
    nbytes: int

    @property
    def names(self) -> list[str]:
        return [spec.name for spec in self.specs]

    @property
    def dtypes(self) -> list[str]:
        return [dtype_to_str(spec.dtype) for spec in self.specs]

    @property
    def shapes(self) -> list[list[int]]:
        return [list(spec.shape) for spec in self.specs]

    def to_fields(self) -> dict[str, list]:
        """The `names`, `dtypes`, `shapes` fields of SGLang's `/update_weights_from_distributed`."""
        return {"names": self.names, "dtypes": self.dtypes, "shapes": self.shapes}

    @classmethod
    def from_fields(
        cls, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]
    ) -> BucketMeta:
        """Rebuild the metadata from the HTTP fields (offsets are implied by the packed layout)."""
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(
                f"names, dtypes, shapes differ in length: {len(names)}, {len(dtypes)}, {len(shapes)}"
            )
        specs, offset = [], 0
        for name, dtype_name, shape in zip(names, dtypes, shapes, strict=True):
            dtype = dtype_from_str(dtype_name)
            nbytes = _numel(shape) * dtype.itemsize
            specs.append(TensorSpec(name, tuple(int(d) for d in shape), dtype, offset, nbytes))
            offset += nbytes
        return cls(tuple(specs), offset)

    @classmethod
    def of(cls, named_tensors: Sequence[tuple[str, torch.Tensor]]) -> BucketMeta:
        """The packed layout of these tensors, in order."""
        return cls.from_fields(
            [name for name, _ in named_tensors],
            [dtype_to_str(t.dtype) for _, t in named_tensors],
            [tuple(t.shape) for _, t in named_tensors],
        )


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for dim in shape:
        numel *= int(dim)
    return numel


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of (name, tensor) into consecutive buckets of at most `bucket_bytes` bytes.

    Streams: a bucket is yielded as soon as the next tensor does not fit, so a caller that
    gathers weights lazily (a collective per tensor) holds at most one bucket at a time. A tensor
    larger than the bound is a bucket of its own. See the module docstring for alignment.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    used = 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        misaligned = used % tensor.element_size() != 0
        if bucket and (used + nbytes > bucket_bytes or misaligned):
            yield bucket
            bucket, used = [], 0
        bucket.append((name, tensor))
        used += nbytes
    if bucket:
        yield bucket


def flatten(
    named_tensors: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor | None = None
) -> tuple[BucketMeta, torch.Tensor]:
    """Copy the tensors into one uint8 buffer (`out[:nbytes]` when given, reused across buckets).

    The buffer lives on the first tensor's device unless `out` says otherwise.
    """
    meta = BucketMeta.of(named_tensors)
    if out is None:
        device = named_tensors[0][1].device if named_tensors else "cpu"
        out = torch.empty(meta.nbytes, dtype=torch.uint8, device=device)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < meta.nbytes:
        raise ValueError(f"out must be a 1-D uint8 tensor of at least {meta.nbytes} bytes")
    flat = out[: meta.nbytes]
    for (_, tensor), view in zip(named_tensors, _views(flat, meta), strict=True):
        # Copying into a typed view takes non-contiguous sources without an extra copy.
        view.copy_(tensor)
    return meta, flat


def unflatten(flat: torch.Tensor, meta: BucketMeta) -> list[tuple[str, torch.Tensor]]:
    """Views of the bucket's tensors into `flat` (no copy): valid while `flat` is not overwritten."""
    if flat.dtype != torch.uint8 or flat.numel() < meta.nbytes:
        raise ValueError(f"flat must be a uint8 tensor of at least {meta.nbytes} bytes, got {flat.numel()}")
    return [(spec.name, view) for spec, view in zip(meta.specs, _views(flat, meta), strict=True)]


def _views(flat: torch.Tensor, meta: BucketMeta) -> list[torch.Tensor]:
    return [flat[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape) for s in meta.specs]
