"""Weight-sync buckets (CPU): hand-checked bucket boundaries, bit-exact flatten/unflatten round trips."""

from __future__ import annotations

import pytest
import torch

from rlx.weight_sync.buckets import BucketMeta, flatten, iter_buckets, unflatten


def _named(*specs: tuple[str, int, torch.dtype]) -> list[tuple[str, torch.Tensor]]:
    return [(name, torch.zeros(numel, dtype=dtype)) for name, numel, dtype in specs]


def _names(buckets) -> list[list[str]]:
    return [[name for name, _ in bucket] for bucket in buckets]


def test_bucket_boundaries_by_hand():
    # Byte sizes: a 40, b 40, c 24, d 200 (over the bound), e 8, f 100.
    tensors = _named(
        ("a", 10, torch.float32),
        ("b", 20, torch.bfloat16),
        ("c", 3, torch.int64),
        ("d", 50, torch.float32),
        ("e", 2, torch.float32),
        ("f", 25, torch.float32),
    )
    # Bound 100: a+b = 80, +c = 104 > 100 -> cut; c alone then d (200) does not fit -> cut;
    # d alone (over the bound); e+f = 108 > 100 -> cut.
    assert _names(iter_buckets(iter(tensors), 100)) == [["a", "b"], ["c"], ["d"], ["e"], ["f"]]
    # Bound exactly a+b+c = 104 keeps all three.
    assert _names(iter_buckets(tensors, 104))[0] == ["a", "b", "c"]
    # One huge bound: one bucket.
    assert _names(iter_buckets(tensors, 1 << 30)) == [["a", "b", "c", "d", "e", "f"]]


def test_misaligned_tensor_starts_a_new_bucket():
    # 3 bf16 = 6 bytes: an fp32 after it would sit at offset 6, not a multiple of 4.
    tensors = _named(("odd", 3, torch.bfloat16), ("w", 4, torch.float32), ("h", 1, torch.bfloat16))
    assert _names(iter_buckets(tensors, 1 << 20)) == [["odd"], ["w", "h"]]


def test_metadata_offsets_and_fields():
    tensors = [
        ("w", torch.zeros(2, 3, dtype=torch.float32)),
        ("n", torch.zeros(4, dtype=torch.bfloat16)),
        ("i", torch.zeros((), dtype=torch.int64)),
    ]
    meta = BucketMeta.of(tensors)
    assert [(s.offset, s.nbytes) for s in meta.specs] == [(0, 24), (24, 8), (32, 8)]
    assert meta.nbytes == 40
    assert meta.to_fields() == {
        "names": ["w", "n", "i"],
        "dtypes": ["float32", "bfloat16", "int64"],
        "shapes": [[2, 3], [4], []],
    }
    assert BucketMeta.from_fields(**meta.to_fields()) == meta


def test_round_trip_is_bit_exact_for_mixed_dtypes():
    gen = torch.Generator().manual_seed(0)
    tensors = [
        ("fp32", torch.randn(7, 5, generator=gen)),
        ("bf16", torch.randn(6, 3, generator=gen).to(torch.bfloat16)),
        ("int64", torch.randint(-(2**62), 2**62, (9,), generator=gen)),
        ("fp32_t", torch.randn(4, 6, generator=gen).t()),  # non-contiguous source
        ("nan", torch.tensor([float("nan"), float("-inf"), -0.0])),
    ]
    out = torch.full((4096,), 0xAB, dtype=torch.uint8)  # a reused, larger buffer
    meta, flat = flatten(tensors, out=out)
    assert flat.data_ptr() == out.data_ptr() and flat.numel() == meta.nbytes
    received = unflatten(flat.clone(), BucketMeta.from_fields(**meta.to_fields()))
    for (name, sent), (got_name, got) in zip(tensors, received, strict=True):
        assert got_name == name and got.dtype == sent.dtype and got.shape == sent.shape
        # Compare the bits, so NaN and -0.0 count too.
        assert torch.equal(got.contiguous().view(torch.uint8), sent.contiguous().view(torch.uint8))


def test_unflatten_returns_views_not_copies():
    tensors = [("a", torch.arange(4, dtype=torch.float32)), ("b", torch.arange(2, dtype=torch.int64))]
    meta, flat = flatten(tensors)
    (_, a), (_, b) = unflatten(flat, meta)
    assert a.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    assert b.data_ptr() == flat.data_ptr() + 16


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(iter_buckets([], 0))
    with pytest.raises(ValueError, match="at least 16 bytes"):
        flatten([("a", torch.zeros(4))], out=torch.empty(8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unknown dtype"):
        BucketMeta.from_fields(["a"], ["float33"], [[1]])
