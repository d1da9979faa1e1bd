"""Pipeline parallelism through the trainer (CPU, gloo, Ray actors): PP=2 and TP=2 x PP=2 take
the one-rank steps, for GRPO and for PPO's critic, export the one-rank HF directory, and their
checkpoints load under another pipeline size.

Tolerances: tests/trainer_runs.py (the TP all-reduces and stage boundaries are the same fp32
arithmetic in another order).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
import trainer_runs  # tests/ is on sys.path (conftest)
from trainer_runs import assert_same_run
from transformers import AutoModelForCausalLM

from rlx.config.compose import compose

PP2 = ["cluster.num_trainer_procs=2", "cluster.pipeline_parallel_size=2"]
TP2_PP2 = [
    "cluster.num_trainer_procs=4",
    "cluster.tensor_parallel_size=2",
    "cluster.pipeline_parallel_size=2",
]
# 32 samples of 4 to 11 tokens: four micro-batches of 4 per optimizer step through the pipeline
train = functools.partial(trainer_runs.train, shape=(32, (3, 6), (1, 7)))


@pytest.fixture(scope="module")
def one_rank(ray_session, tmp_path_factory):
    """GRPO on one rank, three rollouts: the reference of every layout."""
    return train(tmp_path_factory.mktemp("one_rank"), "one_rank", rollouts=3)


def test_pp2_matches_one_rank_and_its_checkpoint_loads_on_one_rank(one_rank, tmp_path):
    base_history, base_exports = one_rank
    assert base_history[0]["train/logprob_abs_diff"] <= 1e-5  # the trainer reproduces transformers
    assert base_history[1]["train/ppo_kl"] != 0.0  # the second step of a rollout moved the policy
    # the steps moved the weights (the comparison is not between untouched copies)
    initial = trainer_runs.initial_weights(tmp_path)
    assert max((base_exports[0][k] - initial[k]).abs().max().item() for k in initial) > 1e-3

    pp2 = train(tmp_path, "pp2", *PP2, rollouts=3, save_after=1)
    assert_same_run("pp2", pp2, one_rank)
    # written by two stages, loaded by one rank (model and Adam state): the third rollout again
    resumed = train(tmp_path, "resumed", load=str(tmp_path / "pp2_ckpt"), rollouts=1)
    assert_same_run("pp2 -> one rank", resumed, ([pp2[0][2]], [pp2[1][2]]))


def test_pp2_takes_the_old_logprobs_from_its_training_pass(tmp_path):
    """One optimizer step per rollout: PP=2 takes the old log-probs from the last stage's training
    pass (`train.old_logprobs=auto`, no forward-only pass) and matches one rank that computes
    them in a forward-only pass first; the log-prob gap is the same, computed in the loss."""
    one_step = ["train.num_steps_per_rollout=1", "train.global_batch_size=32"]
    recomputed = train(tmp_path, "recomputed", *one_step, "train.old_logprobs=recompute", rollouts=2)
    from_training = train(tmp_path, "pp2_one_step", *PP2, *one_step, rollouts=2)
    assert all("time/logprobs_s" in m for m in recomputed[0])
    assert not any("time/logprobs_s" in m for m in from_training[0])
    assert_same_run("pp2, old log-probs from the training pass", from_training, recomputed)


def test_tp2_pp2_packed_matches_one_rank(one_rank, tmp_path):
    """4 gloo ranks: two stages, each split over two tensor-parallel ranks, with packed
    micro-batches (rows of up to 63 tokens, padded to a multiple of TP) of different shapes."""
    base_history, base_exports = one_rank
    packed = train(tmp_path, "tp2_pp2", *TP2_PP2, "train.max_tokens_per_micro_batch=63")
    assert_same_run("tp2_pp2 packed", packed, (base_history[:2], base_exports[:2]))


def test_ppo_critic_under_pp2_matches_one_rank(ray_session, tmp_path):
    """PPO: the critic's values come from the last stage to GAE on every rank; critic and policy
    take the one-rank steps."""
    ppo = ["algo=ppo"]
    keys = ("train/values_mean", "train/explained_variance", "train/value_loss", "train/critic_grad_norm",
            "train/pg_loss", "train/grad_norm")  # fmt: skip
    base = train(tmp_path, "ppo_one_rank", *ppo)
    assert base[0][0]["train/value_loss"] > 0 and base[0][0]["train/critic_grad_norm"] > 0
    assert_same_run("ppo pp2", train(tmp_path, "ppo_pp2", *ppo, *PP2), base, keys)


def test_interleaved_virtual_stages_match_one_rank(ray_session, tmp_path):
    """4 layers over PP=2 x 2 virtual stages (megatron's interleaved schedule): rank 0 holds
    layers 0 and 2, rank 1 layers 1 and 3 (and the tied output layer); the export comes back in
    the one-rank order, and the checkpoint (keys model0, model1) loads on one rank."""
    four_layers = "model.num_layers=4"
    base = train(tmp_path, "four_layers_one_rank", four_layers, rollouts=3)
    vp = "+model.megatron_overrides.virtual_pipeline_model_parallel_size=2"
    interleaved = train(tmp_path, "pp2_vp2", four_layers, *PP2, vp, rollouts=3, save_after=1)
    assert_same_run("pp2 vp2", interleaved, base)
    resumed = train(tmp_path, "vp_resumed", four_layers, load=str(tmp_path / "pp2_vp2_ckpt"), rollouts=1)
    assert_same_run("pp2 vp2 -> one rank", resumed, ([interleaved[0][2]], [interleaved[1][2]]))


VP = "+model.megatron_overrides.virtual_pipeline_model_parallel_size"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([f"{VP}=2"], f"{VP[1:]}=2 interleaves pipeline stages, but cluster.pipeline_parallel_size=1"),
        ([*PP2, f"{VP}=1"], f"{VP[1:]}=1 must be an integer >= 2"),
        (
            [*PP2, f"{VP}=2"],  # the tiny model's 2 layers over 2 stages x 2 chunks
            f"model.num_layers=2 is not divisible by cluster.pipeline_parallel_size=2 × {VP[1:]}=2 = 4",
        ),
        (
            [*PP2, f"{VP}=2", "model.num_layers=4", "train.max_tokens_per_micro_batch=63"],
            f"train.max_tokens_per_micro_batch=63 (packing) with {VP[1:]}=2",
        ),
        (
            [*PP2, f"{VP}=2", "model.num_layers=4", "train.micro_batch_size=8", "rollout.batch_size=3"],
            "train.global_batch_size=24 / (train.micro_batch_size=8 × data-parallel size 1) = 3 micro-batches",
        ),
        (
            [*PP2, "model=tiny_qwen3_moe", "model.moe_token_dispatcher_type=allgather"],
            "model.moe_token_dispatcher_type=allgather cannot run with cluster.pipeline_parallel_size=2",
        ),
    ],
)
def test_pipeline_layouts_megatron_cannot_run_are_refused_at_compose(overrides, message):
    from rlx.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        compose(overrides)


def test_the_loop_trains_under_pp2_and_its_engines_serve_the_gathered_weights(tmp_path):
    """The whole loop with PP=2 (rlx.runtime.run): after each step the engine gets the weights
    both stages export, so at the next step the trainer's log-probs of the sampled tokens are
    the engine's; the HF export at the end loads in transformers."""
    from rlx.runtime import run

    history = run(compose([f"run.output_dir={tmp_path}", "run.num_rollout=3", "run.save_hf=true", *PP2,
                           "rollout.batch_size=8", "rollout.n_samples_per_prompt=4", "train.micro_batch_size=8",
                           "run.progress=false"]))  # fmt: skip
    assert len(history) == 3
    assert all(h["train/logprob_abs_diff"] <= 1e-5 for h in history), [
        h["train/logprob_abs_diff"] for h in history
    ]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32) is not None
