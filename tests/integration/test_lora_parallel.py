"""LoRA under the parallel layouts (CPU, gloo, Ray actors): TP=2 x PP=2, DP=2, an MoE model under
TP=2 (sequence parallel: the adapters' reduce-scatter and gather paths) and its routed experts'
adapters under EP=2 take the one-rank steps and export the one-rank merged weights; a checkpoint
of adapters written by four ranks loads on one.

Tolerances: tests/trainer_runs.py. The adapters start from the same values in every layout (A is
drawn from the seed and the layer's global name, B is zero), so the runs can be compared.
"""

from __future__ import annotations

import functools

import pytest
import trainer_runs  # tests/ is on sys.path (conftest)
from trainer_runs import assert_same_run

LORA = ("train.lora.rank=4", "train.lora.alpha=8")
TP2_PP2 = (
    "cluster.num_trainer_procs=4",
    "cluster.tensor_parallel_size=2",
    "cluster.pipeline_parallel_size=2",
)
DP2 = ("cluster.num_trainer_procs=2",)
MOE = ("model=tiny_qwen3_moe",)
train = functools.partial(trainer_runs.train, shape=(32, (3, 6), (1, 7)))


@pytest.fixture(scope="module")
def one_rank(ray_session, tmp_path_factory):
    """LoRA on one rank, three rollouts: the reference."""
    return train(tmp_path_factory.mktemp("lora_one_rank"), "one_rank", *LORA, rollouts=3)


def test_lora_tp2_pp2_matches_one_rank_and_its_checkpoint_loads_on_one_rank(one_rank, tmp_path):
    history, exports = one_rank
    assert history[1]["train/ppo_kl"] != 0.0  # the second optimizer step saw a moved policy
    initial = trainer_runs.initial_weights(tmp_path)
    moved = {k for k in initial if (exports[0][k] - initial[k]).abs().max() > 1e-4}
    assert moved and all("layers" in k and "norm" not in k for k in moved), moved  # the adapted layers only

    tp2_pp2 = train(tmp_path, "tp2_pp2", *LORA, *TP2_PP2, rollouts=3, save_after=1)
    assert_same_run("lora tp2_pp2", tp2_pp2, one_rank)
    # adapters (and their Adam state) written by TP=2 x PP=2, resharded onto one rank: the third
    # rollout again (the same sample order as the first)
    resumed = train(tmp_path, "resumed", *LORA, load=str(tmp_path / "tp2_pp2_ckpt"), rollouts=1)
    assert_same_run("lora tp2_pp2 -> one rank", resumed, ([tp2_pp2[0][2]], [tp2_pp2[1][2]]))


def test_lora_dp2_matches_one_rank(one_rank, tmp_path):
    dp2 = train(tmp_path, "dp2", *LORA, *DP2)
    assert_same_run("lora dp2", dp2, (one_rank[0][:2], one_rank[1][:2]))


def test_lora_moe_under_sequence_parallel_tp2_matches_one_rank(ray_session, tmp_path):
    base = train(tmp_path, "moe_one_rank", *LORA, *MOE)
    tp2 = train(
        tmp_path, "moe_tp2", *LORA, *MOE, "cluster.num_trainer_procs=2", "cluster.tensor_parallel_size=2"
    )
    assert_same_run("lora moe tp2", tp2, base)


def test_lora_on_routed_experts_under_ep2_matches_one_rank(ray_session, tmp_path):
    experts = (*LORA, *MOE, "train.lora.experts=true")
    base = train(tmp_path, "experts_one_rank", *experts)
    initial = trainer_runs.initial_weights(tmp_path, *MOE)
    assert any(".experts." in k and (base[1][0][k] - initial[k]).abs().max() > 1e-4 for k in initial)
    ep2 = train(
        tmp_path, "experts_ep2", *experts, "cluster.num_trainer_procs=2", "cluster.expert_parallel_size=2"
    )
    assert_same_run("lora experts ep2", ep2, base)
