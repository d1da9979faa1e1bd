"""Cluster configs (conf/cluster/): each composes with the models that fit it and gives the counts
it says; each impossible GPU/parallel combination fails naming its keys and the fix. CPU, no GPUs:
everything here is checked at compose time, before Ray starts."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import yaml

from rlx.cluster import ClusterConfig
from rlx.config.compose import CONF_DIR, compose, to_object
from rlx.errors import ConfigError

CLUSTER_DIR = CONF_DIR / "cluster"
SGLANG = ["rollout=sglang", "rollout.server_module=rlx.engine.serve"]  # SGLang is not installed here


@pytest.fixture
def checkpoint(tmp_path):
    """A stand-in for a downloaded HF checkpoint of a full-size model (validation reads config.json)."""
    (tmp_path / "config.json").write_text(json.dumps({}))
    return tmp_path


# name: (overrides, expected (num_nodes, GPUs per node, trainer GPUs, rollout GPUs, engines,
#        GPUs per engine, data-parallel size))
SETUPS = {
    "local, the embedded default": ([], (1, 0, 1, 0, 1, 1, 1)),
    "1x8, Qwen3-8B at TP 2, SGLang engines of 2 GPUs": (
        [
            "cluster=1x8",
            "model=qwen3_8b",
            "cluster.tensor_parallel_size=2",
            *SGLANG,
            "rollout.gpus_per_engine=2",
            "rollout.num_engines=2",
        ],
        (1, 8, 4, 4, 2, 2, 2),
    ),
    "1x8, tiny model, rlx engines": (["cluster=1x8", "rollout.num_engines=4"], (1, 8, 4, 4, 4, 1, 4)),
    "2x8, GLM-4-9B at TP 2, rlx engines": (
        ["cluster=2x8", "model=glm4_9b", "cluster.tensor_parallel_size=2", "rollout.num_engines=8"],
        (2, 8, 8, 8, 8, 1, 4),
    ),
    "4x8, Qwen3-30B-A3B at TP 4 x EP 4, SGLang engines of 4 GPUs": (
        [
            "cluster=4x8",
            "model=qwen3_30b_a3b",
            "cluster.tensor_parallel_size=4",
            "cluster.expert_parallel_size=4",
            *SGLANG,
            "rollout.gpus_per_engine=4",
            "rollout.num_engines=4",
        ],
        (4, 8, 16, 16, 4, 4, 4),
    ),
    "4x8, Llama-3.1-8B at TP 2 x PP 2": (
        [
            "cluster=4x8",
            "model=llama3_8b",
            "cluster.tensor_parallel_size=2",
            "cluster.pipeline_parallel_size=2",
            "rollout.num_engines=16",
        ],
        (4, 8, 16, 16, 16, 1, 4),
    ),
}


@pytest.mark.parametrize("overrides, counts", SETUPS.values(), ids=SETUPS.keys())
def test_cluster_configs_compose_with_the_models_that_fit(overrides, counts, checkpoint):
    if any(o.startswith("model=") for o in overrides):
        overrides = [*overrides, f"model.hf_checkpoint={checkpoint}"]
    rc = to_object(compose(overrides))
    c, r = rc.cluster, rc.rollout
    dp = c.num_trainer_procs // (c.tensor_parallel_size * c.pipeline_parallel_size)
    got = (
        c.num_nodes,
        c.gpus_per_node,
        c.num_trainer_procs,
        c.num_rollout_gpus,
        r.num_engines,
        r.gpus_per_engine,
        dp,
    )
    assert got == counts


def test_1gpu_shares_its_gpu():
    """`cluster=1gpu`: one trainer rank and one engine take turns on the one GPU."""
    c = to_object(compose(["cluster=1gpu"])).cluster
    assert (c.num_nodes, c.gpus_per_node, c.num_trainer_procs, c.num_rollout_gpus, c.colocate) == (
        1,
        1,
        1,
        1,
        True,
    )


def test_train_only_needs_no_gpus_for_engines(tmp_path):
    """`debug.train_only` starts no engines, so every GPU may be the trainer's (tests/gpu's parallel
    parity replays dumps so); the same GPUs with engines are refused, naming the key."""
    (tmp_path / "rollouts").mkdir()
    (tmp_path / "rollouts" / "step_000000.jsonl").write_text("")
    gpus = ["cluster.gpus_per_node=2", "cluster.num_trainer_procs=2", "cluster.num_rollout_gpus=0"]
    c = to_object(compose([*gpus, "debug.train_only=true", f"debug.load_rollouts={tmp_path}"])).cluster
    assert (c.gpus_per_node, c.num_trainer_procs, c.num_rollout_gpus) == (2, 2, 0)
    with pytest.raises(ConfigError, match="cluster.num_rollout_gpus=0 on a GPU cluster"):
        compose(gpus)


@pytest.mark.parametrize("path", sorted(CLUSTER_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_cluster_options_override_only_what_differs_from_the_schema(path):
    text = path.read_text()
    assert text.startswith("# "), f"{path.name} opens with a comment saying what it is and the command"
    option = yaml.safe_load(text)
    assert option.pop("defaults") == ["base_cluster", "_self_"]
    defaults = {f.name: f.default for f in fields(ClusterConfig)}
    assert {k: v for k, v in option.items() if defaults[k] == v} == {}


# (overrides, fragments the messages must contain); {checkpoint}: a directory with a config.json
FAILURES = {
    "rollout GPUs on CPU": (
        ["cluster.num_rollout_gpus=2"],
        ["cluster.num_rollout_gpus=2", "cluster.gpus_per_node=0", "set cluster.num_rollout_gpus=0"],
    ),
    "engine over GPUs on CPU": (
        [*SGLANG, "rollout.gpus_per_engine=2"],
        ["rollout.gpus_per_engine=2", "cluster.gpus_per_node=0", "set rollout.gpus_per_engine=1"],
    ),
    "GPU cluster without rollout GPUs": (
        ["cluster.gpus_per_node=1"],
        [
            "cluster.num_rollout_gpus=0",
            "cluster.gpus_per_node=1",
            "set cluster.num_rollout_gpus=1",
            "cluster.colocate=true",
        ],
    ),
    "trainer beyond the GPUs": (
        [
            "cluster=1x8",
            "cluster.num_trainer_procs=16",
            "cluster.num_rollout_gpus=1",
            "rollout.num_engines=1",
        ],
        ["cluster.num_trainer_procs=16", "cluster.num_nodes=1 × cluster.gpus_per_node=8", "<= 8"],
    ),
    "split beyond the GPUs": (
        ["cluster=1x8", "cluster.num_rollout_gpus=6", "rollout.num_engines=6"],
        [
            "cluster.num_trainer_procs=4 + cluster.num_rollout_gpus=6 = 10",
            "cluster.gpus_per_node=8",
            "set cluster.num_rollout_gpus=4 or cluster.num_trainer_procs=2 or cluster.num_nodes=2",
        ],
    ),
    "colocated rollout GPUs other than the trainer's": (
        ["cluster=1x8", "cluster.colocate=true", "cluster.num_rollout_gpus=2", "rollout.num_engines=2"],
        ["cluster.num_rollout_gpus=2", "cluster.num_trainer_procs=4", "set cluster.num_rollout_gpus=4"],
    ),
    "engines fewer than the rollout GPUs hold": (
        ["cluster=1x8"],
        [
            "rollout.num_engines=1",
            "cluster.num_rollout_gpus=4",
            "rollout.gpus_per_engine=1",
            "set rollout.num_engines=4",
        ],
    ),
    "rollout GPUs not divisible by GPUs per engine": (
        ["cluster=1x8", *SGLANG, "rollout.gpus_per_engine=3"],
        [
            "cluster.num_rollout_gpus=4",
            "rollout.gpus_per_engine=3",
            "set cluster.num_rollout_gpus=3 or rollout.gpus_per_engine=2",
        ],
    ),
    "engine wider than a node": (
        [
            "cluster=2x8",
            "cluster.num_nodes=3",
            "cluster.num_rollout_gpus=16",
            *SGLANG,
            "rollout.gpus_per_engine=16",
            "train.micro_batch_size=32",
        ],
        ["rollout.gpus_per_engine=16", "cluster.gpus_per_node=8", "set rollout.gpus_per_engine=8"],
    ),
    "rlx engine over several GPUs": (
        ["cluster=1x8", "rollout.gpus_per_engine=2", "rollout.num_engines=2"],
        [
            "rollout.gpus_per_engine=2",
            "rlx.rollout.launchers.LocalLauncher",
            "set rollout.gpus_per_engine=1",
            "rollout=sglang",
        ],
    ),
    "heads by TP": (
        ["cluster.num_trainer_procs=4", "cluster.tensor_parallel_size=4"],
        [
            "model.num_attention_heads=4",
            "model.num_query_groups=2",
            "cluster.tensor_parallel_size=4",
            "set cluster.tensor_parallel_size=2",
        ],
    ),
    "KV groups by TP (GLM-4-9B has 2)": (
        [
            "cluster=1x8",
            "rollout.num_engines=4",
            "model=glm4_9b",
            "model.hf_checkpoint={checkpoint}",
            "cluster.tensor_parallel_size=4",
        ],
        [
            "model.num_attention_heads=32",
            "model.num_query_groups=2",
            "cluster.tensor_parallel_size=4",
            "set cluster.tensor_parallel_size=2",
        ],
    ),
    "vocabulary by TP": (
        ["model.vocab_size=17", "cluster.num_trainer_procs=2", "cluster.tensor_parallel_size=2"],
        ["model.vocab_size=17", "cluster.tensor_parallel_size=2", "set cluster.tensor_parallel_size=1"],
    ),
    "layers by PP": (
        ["cluster.num_trainer_procs=3", "cluster.pipeline_parallel_size=3"],
        ["model.num_layers=2", "cluster.pipeline_parallel_size=3", "set cluster.pipeline_parallel_size=2"],
    ),
    "TP across nodes": (
        [
            "cluster=2x8",
            "cluster.gpus_per_node=12",
            "model=llama3_8b",
            "model.hf_checkpoint={checkpoint}",
            "cluster.tensor_parallel_size=8",
            "rollout.num_engines=8",
        ],
        [
            "cluster.tensor_parallel_size=8",
            "cluster.gpus_per_node=12",
            "within one node",
            "set cluster.tensor_parallel_size=6",
        ],
    ),
    "several nodes without a Ray cluster": (
        ["cluster=2x8", "cluster.ray_address=null", "rollout.num_engines=8", "train.micro_batch_size=32"],
        ["cluster.num_nodes=2", "cluster.ray_address", "set cluster.ray_address=auto"],
    ),
}


@pytest.mark.parametrize("overrides, fragments", FAILURES.values(), ids=FAILURES.keys())
def test_each_impossible_combination_fails_naming_its_keys(overrides, fragments, checkpoint):
    with pytest.raises(ConfigError) as e:
        compose([o.format(checkpoint=checkpoint) for o in overrides])
    for fragment in fragments:
        assert fragment in str(e.value)
