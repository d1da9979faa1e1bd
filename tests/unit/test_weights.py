"""Weight shards: bounded buckets, an HF index, and exact tensors back."""

import json

import torch
from safetensors.torch import load_file

from rlx.trainer.weights import INDEX_NAME, write_weight_shards


def test_shards_are_bounded_and_complete(tmp_path):
    named = [(f"layer.{i}.weight", torch.full((16, 16), float(i))) for i in range(5)]  # 1 KiB each
    num_shards = write_weight_shards(iter(named), tmp_path, bucket_bytes=2048)
    assert num_shards == 3  # 2 + 2 + 1 tensors
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert index["metadata"]["total_size"] == 5 * 1024
    assert set(index["weight_map"]) == {n for n, _ in named}
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(tmp_path / shard)
        assert sum(t.numel() * t.element_size() for t in tensors.values()) <= 2048
        loaded |= tensors
    for name, tensor in named:
        assert torch.equal(loaded[name], tensor)


def test_a_tensor_larger_than_a_bucket_gets_its_own_shard(tmp_path):
    named = [("small", torch.zeros(4)), ("big", torch.zeros(1000)), ("tail", torch.zeros(4))]
    assert write_weight_shards(iter(named), tmp_path, bucket_bytes=64) == 3
