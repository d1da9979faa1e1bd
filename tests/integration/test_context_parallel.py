"""Context parallelism through the trainer (CPU, gloo, Ray actors): CP=2 takes the one-rank steps,
for GRPO (padded and packed micro-batches) and for PPO's critic, exports the one-rank HF
directory, writes a checkpoint one rank loads, and runs the whole loop.

Samples are 10 to 52 tokens (responses up to 40), so every micro-batch's sequence spans all four
of CP=2's chunks. Tolerances: tests/trainer_runs.py (attention over gathered keys and gradients
summed over CP ranks are the same fp32 arithmetic in another order).
"""

from __future__ import annotations

import functools
import re

import pytest
import trainer_runs  # tests/ is on sys.path (conftest)
from trainer_runs import assert_same_run

from rlx.config.compose import compose, to_object
from rlx.errors import ConfigError

CP2 = ["cluster.num_trainer_procs=2", "cluster.context_parallel_size=2"]
PACKED = "train.max_tokens_per_micro_batch=63"
# 16 samples of 10 to 52 tokens: every micro-batch's sequence spans all four of CP=2's chunks; one
# rollout (two optimizer steps, the second on moved weights) unless a test asks for more
train = functools.partial(trainer_runs.train, shape=(16, (3, 13), (7, 41)), rollouts=1)


def test_cp2_matches_one_rank_and_its_checkpoint_loads_on_one_rank(ray_session, tmp_path):
    base = train(tmp_path, "one_rank", rollouts=3)
    assert base[0][0]["train/logprob_abs_diff"] <= 1e-5  # the trainer reproduces transformers
    assert base[0][1]["train/ppo_kl"] != 0.0  # the second step of a rollout moved the policy
    initial = trainer_runs.initial_weights(tmp_path)
    assert max((base[1][0][k] - initial[k]).abs().max().item() for k in initial) > 1e-3

    cp2 = train(tmp_path, "cp2", *CP2, rollouts=3, save_after=1)
    assert_same_run("cp2", cp2, base)
    # written by two CP ranks, loaded by one rank (model and Adam state): the third rollout again
    resumed = train(tmp_path, "resumed", load=str(tmp_path / "cp2_ckpt"), rollouts=1)
    assert_same_run("cp2 -> one rank", resumed, ([cp2[0][2]], [cp2[1][2]]))


@pytest.fixture(scope="module")
def packed_one_rank(ray_session, tmp_path_factory):
    """GRPO on one rank with packed micro-batches: the reference of the packed layouts."""
    return train(tmp_path_factory.mktemp("packed_one_rank"), "packed_one_rank", PACKED)


def test_cp2_packed_matches_one_rank_packed(packed_one_rank, tmp_path):
    """Packed rows (block-diagonal masks: each CP rank's query rows against every key) of
    different widths, each padded to a multiple of 4."""
    assert_same_run("cp2 packed", train(tmp_path, "cp2_packed", *CP2, PACKED), packed_one_rank)


@pytest.mark.parametrize(
    "name, layout",
    [
        ("dp2_cp2", []),  # gradients reduced over DP x CP, samples sharded over DP only
        ("tp2_cp2", ["cluster.tensor_parallel_size=2"]),  # each CP rank's heads and vocabulary split over TP
        ("pp2_cp2", ["cluster.pipeline_parallel_size=2"]),  # stages exchange each CP rank's activations
    ],
)
def test_cp2_with_dp_tp_or_pp_matches_one_rank(packed_one_rank, tmp_path, name, layout):
    """4 gloo ranks: CP=2 beside DP=2, TP=2 or PP=2, with packed micro-batches."""
    four_ranks = ["cluster.num_trainer_procs=4", "cluster.context_parallel_size=2", *layout]
    assert_same_run(name, train(tmp_path, name, *four_ranks, PACKED), packed_one_rank)


def test_ppo_critic_under_cp2_matches_one_rank(ray_session, tmp_path):
    """PPO: the critic's values come back in sequence order for GAE; critic and policy take the
    one-rank steps."""
    keys = ("train/values_mean", "train/explained_variance", "train/value_loss", "train/critic_grad_norm",
            "train/pg_loss", "train/grad_norm")  # fmt: skip
    base = train(tmp_path, "ppo_one_rank", "algo=ppo")
    assert base[0][0]["train/value_loss"] > 0 and base[0][0]["train/critic_grad_norm"] > 0
    assert_same_run("ppo cp2", train(tmp_path, "ppo_cp2", "algo=ppo", *CP2), base, keys)


def test_moe_under_cp2_with_ep2_or_sequence_parallel_tp2_matches_one_rank(ray_session, tmp_path):
    """Qwen3-MoE: CP=2 alone, beside EP=2 (experts' all-to-all over each CP rank's tokens) and
    beside TP=2 (sequence parallelism splits each CP rank's tokens again: rows padded to a
    multiple of 8). No load-balancing loss: it counts padding tokens, of which CP adds some."""
    moe = "model=tiny_qwen3_moe"
    base = train(tmp_path, "moe_one_rank", moe)
    assert_same_run("moe cp2", train(tmp_path, "moe_cp2", moe, *CP2), base)
    for name, layout in {
        "moe_ep2_cp2": "cluster.expert_parallel_size=2",
        "moe_tp2_cp2": "cluster.tensor_parallel_size=2",
    }.items():
        four_ranks = ["cluster.num_trainer_procs=4", "cluster.context_parallel_size=2", layout]
        assert_same_run(name, train(tmp_path, name, moe, *four_ranks), base)


def test_the_loop_trains_under_cp2_and_its_engines_serve_its_weights(tmp_path):
    """The whole loop with CP=2 (rlx.runtime.run): after each step the engine gets the trainer's
    weights, so at the next step the trainer's log-probs of the sampled tokens are the engine's."""
    from rlx.runtime import run

    history = run(compose([f"run.output_dir={tmp_path}", "run.num_rollout=3", *CP2, "rollout.batch_size=8",
                           "rollout.n_samples_per_prompt=4", "train.micro_batch_size=8", "run.progress=false"]))  # fmt: skip
    assert len(history) == 3
    assert all(h["train/logprob_abs_diff"] <= 1e-5 for h in history), [
        h["train/logprob_abs_diff"] for h in history
    ]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["cluster.num_trainer_procs=3", "cluster.context_parallel_size=2"],
            "cluster.num_trainer_procs=3 is not divisible by cluster.tensor_parallel_size=1 × "
            "cluster.pipeline_parallel_size=1 × cluster.context_parallel_size=2 = 2 (the data-parallel size is "
            "their quotient); set cluster.num_trainer_procs to a multiple of 2",
        ),
        (
            [
                "cluster.num_trainer_procs=4",
                "cluster.context_parallel_size=2",
                "train.micro_batch_size=4",
                "rollout.batch_size=3",
                "rollout.n_samples_per_prompt=4",
                "train.global_batch_size=12",
            ],  # fmt: skip
            "train.global_batch_size=12 is not divisible by train.micro_batch_size=4 × data-parallel size 2 "
            "(cluster.num_trainer_procs=4 / (cluster.tensor_parallel_size=1 × cluster.pipeline_parallel_size=1 × "
            "cluster.context_parallel_size=2)) = 8; set train.micro_batch_size=3",
        ),
        (
            ["cluster.context_parallel_size=0"],
            "cluster.context_parallel_size=0 must be >= 1; set cluster.context_parallel_size to a value >= 1",
        ),
        (
            ["+model.megatron_overrides.context_parallel_size=2"],
            "model.megatron_overrides.context_parallel_size=2: the trainer's parallel sizes are set by the "
            "cluster keys (megatron's parallel state is built from them); remove it and set "
            "cluster.context_parallel_size=2",
        ),
    ],
)
def test_context_parallel_layouts_that_cannot_run_are_refused_at_compose(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose(overrides)


def test_context_parallel_layouts_compose():
    """CP with TP, PP, packing, the critic and MLA + MoE (DeepSeek-V3) composes."""
    for overrides in (
        CP2,
        ["cluster.num_trainer_procs=8", "cluster.context_parallel_size=2", "cluster.tensor_parallel_size=2",
         "cluster.pipeline_parallel_size=2", PACKED, "algo=ppo"],
        [*CP2, "model=tiny_deepseek_v3"],
    ):  # fmt: skip
        assert to_object(compose(overrides)).cluster.context_parallel_size == 2


def test_cp2_with_interleaved_virtual_stages_matches_one_rank(ray_session, tmp_path):
    """4 layers over PP=2 x 2 virtual stages (micro-batches widened to one shape, a multiple of
    4) and CP=2: 4 gloo ranks take the one-rank steps."""
    four_layers = "model.num_layers=4"
    base = train(tmp_path, "four_layers_one_rank", four_layers)
    layout = ["cluster.num_trainer_procs=4", "cluster.context_parallel_size=2", "cluster.pipeline_parallel_size=2",
              "+model.megatron_overrides.virtual_pipeline_model_parallel_size=2"]  # fmt: skip
    assert_same_run("pp2 vp2 cp2", train(tmp_path, "pp2_vp2_cp2", four_layers, *layout), base)
