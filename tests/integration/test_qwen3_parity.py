"""Qwen3 on megatron-core equals Qwen3 in transformers, at TP=1 and TP=2 (CPU, gloo).

The tiny checkpoints are real HF directories written by the family on first use (under a
temporary RLX_CACHE), one with tied embeddings and one with a separate lm_head.
"""

from __future__ import annotations

import json
from pathlib import Path

import helpers  # tests/ is on sys.path (conftest)
import pytest
import torch
from helpers import assert_same_tensors, megatron_logits, megatron_world, spawn_ranks, token_batch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlx.models.attention import SDPAttention
from rlx.models.config import ModelConfig
from rlx.models.qwen3 import Qwen3

TIES = [True, False]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[bool, Path]:
    """tie_word_embeddings -> tiny Qwen3 checkpoint dir, written by `Qwen3.checkpoint_dir`."""
    cache = tmp_path_factory.mktemp("rlx_cache")
    dirs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLX_CACHE", str(cache))
        for tie in TIES:
            dirs[tie] = Qwen3(
                ModelConfig(name=f"tiny_qwen3_tie{int(tie)}", tie_word_embeddings=tie)
            ).checkpoint_dir()
    for path in dirs.values():
        assert path.is_relative_to(cache) and (path / "model.safetensors").is_file()
    return dirs


def family_for(hf_dir: Path, tie: bool) -> Qwen3:
    return Qwen3(ModelConfig(hf_checkpoint=str(hf_dir), tie_word_embeddings=tie))


def load_megatron(hf_dir: Path, tie: bool):
    family = family_for(hf_dir, tie)
    return family, helpers.load_megatron(family, hf_dir)


@pytest.mark.parametrize("tie", TIES)
def test_logits_match_transformers(world, checkpoints, tie):
    hf_dir = checkpoints[tie]
    _, model = load_megatron(hf_dir, tie)
    assert isinstance(model.decoder.layers[0].self_attention.core_attention, SDPAttention)
    hf_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    ids = token_batch()
    with torch.no_grad():
        expected = hf_model(input_ids=ids).logits
    logits = megatron_logits(model, ids)
    assert logits.shape == expected.shape == (2, 12, 16)
    assert expected.std() > 0.1  # a real, non-degenerate output
    assert (logits - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("tie", TIES)
def test_round_trip_returns_the_checkpoint(world, checkpoints, tie, tmp_path):
    hf_dir = checkpoints[tie]
    on_disk = load_file(hf_dir / "model.safetensors")
    assert ("lm_head.weight" in on_disk) is not tie
    family, model = load_megatron(hf_dir, tie)
    assert_same_tensors(dict(family.export_hf_weights(model)), on_disk)

    # The same weights saved as several shards with an index load to the same model.
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).save_pretrained(
        sharded, max_shard_size="60KB"
    )
    assert (sharded / "model.safetensors.index.json").is_file()
    family, model = load_megatron(sharded, tie)
    assert_same_tensors(dict(family.export_hf_weights(model)), on_disk)


def _tp2_rank(rank: int, world_size: int, port: int, checkpoints: dict[bool, Path], out_dir: Path) -> None:
    torch.set_num_threads(1)
    results = {}
    with megatron_world(rank, world_size, port, tp=2):
        for tie, hf_dir in checkpoints.items():
            family, model = load_megatron(hf_dir, tie)
            results[tie] = {
                "local_vocab": model.output_layer.output_size_per_partition,
                "logits": megatron_logits(model, token_batch()),
                "weights": dict(family.export_hf_weights(model)),
            }
    torch.save(results, out_dir / f"rank{rank}.pt")


def test_tp2_matches_tp1(world, checkpoints, tmp_path):
    spawn_ranks(_tp2_rank, 2, checkpoints, tmp_path)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for tie, hf_dir in checkpoints.items():
            _, model = load_megatron(hf_dir, tie)
            assert results[tie]["local_vocab"] == 8  # really sharded: half the vocabulary per rank
            torch.testing.assert_close(
                results[tie]["logits"], megatron_logits(model, token_batch()), atol=1e-5, rtol=1e-5
            )
            # Every TP rank gets the full tensors back, identical to the checkpoint.
            assert_same_tensors(results[tie]["weights"], load_file(hf_dir / "model.safetensors"))


def test_check_hf_config_names_each_wrong_field(checkpoints, tmp_path):
    family = family_for(tmp_path, tie=True)
    config = json.loads((checkpoints[True] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 8}))
    with pytest.raises(ValueError, match="model.num_attention_heads=4 but config.json has 8") as error:
        family.check_hf_config(tmp_path)
    assert "num_query_groups" not in str(error.value)

    (tmp_path / "config.json").write_text(
        json.dumps({**config, "num_attention_heads": 8, "intermediate_size": 96})
    )
    with pytest.raises(ValueError) as error:
        family.check_hf_config(tmp_path)
    assert "model.num_attention_heads=4 but config.json has 8" in str(error.value)
    assert "model.ffn_hidden_size=128 but config.json has 96" in str(error.value)

    # Older config.json files keep rope_theta at the top level; equal values pass.
    legacy = {k: v for k, v in config.items() if k != "rope_parameters"}
    (tmp_path / "config.json").write_text(json.dumps({**legacy, "rope_theta": 10000.0}))
    family.check_hf_config(tmp_path)


def test_checkpoint_dir_rejects_a_missing_checkpoint(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match="model.hf_checkpoint") as error:
        Qwen3(ModelConfig(hf_checkpoint=str(missing))).checkpoint_dir()
    assert str(missing) in str(error.value)
