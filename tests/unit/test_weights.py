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


def test_unwritten_counts_tied_names_and_stacked_experts_by_their_views():
    from rlx.engine.models.weights import unwritten

    stacked = torch.zeros(4, 6, 3)  # 4 experts; gate rows 0-2, up rows 3-5 of each
    tied = torch.zeros(5, 3)
    views = {"embed": tied, "lm_head": tied, "norm": torch.zeros(3), "experts.gate_up": stacked}
    for e in range(4):
        views[f"experts.{e}.gate"], views[f"experts.{e}.up"] = stacked[e, :3], stacked[e, 3:]
    # the tied head is written through the embedding; the stack counts once one expert view is
    written = ["embed", "experts.1.gate", "experts.2.up"]
    expected = sorted(
        {"norm"} | {f"experts.{e}.{p}" for e in range(4) for p in ("gate", "up")} - set(written)
    )
    assert unwritten(views, written) == expected
    assert unwritten(views, written, among=["norm", "lm_head", "experts.1.up"]) == ["experts.1.up", "norm"]
    assert unwritten(views, list(views)) == []
