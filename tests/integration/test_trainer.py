"""The Megatron trainer as a Ray actor group: TP and DP give the one-rank result."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import rlx.actor_reuse
from rlx.actor_reuse import keep_actors
from rlx.config.compose import compose, to_object
from rlx.models.qwen3 import Qwen3
from rlx.sample import Sample
from rlx.trainer.group import TrainerGroup


def _batch(hf_dir) -> list[Sample]:
    """64 samples (8 groups of 8) of varied lengths, with transformers' log-probs as rollout log-probs."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(64):
        prompt = torch.randint(2, 12, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g).tolist()
        response = torch.randint(2, 16, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
        ids = torch.tensor([prompt + response])
        with torch.no_grad():
            logp_V = torch.log_softmax(model(ids).logits[0].float(), -1)
        rollout_logp = [logp_V[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response)]
        samples.append(Sample(prompt="", prompt_ids=prompt, response_ids=response, rollout_logprobs=rollout_logp,
                              loss_mask=[1] * len(response), reward=float(torch.rand(1, generator=g) > 0.5),
                              group=i // 8, index=i % 8))  # fmt: skip
    return samples


def _train_once(tmp_path, name, *overrides):
    # Adam's first update is lr * g / (|g| + eps): with the usual tiny eps that is lr * sign(g), so a
    # gradient of 1e-9 and one of -1e-9 (summation order under TP/DP) move a weight 2 * lr apart.
    # With eps = 1 the update is ~lr * g, and comparing weights compares gradients.
    cfg = to_object(compose([f"run.output_dir={tmp_path}", "rollout.batch_size=8", "rollout.n_samples_per_prompt=8",
                             "train.micro_batch_size=16", "train.adam_eps=1.0", "train.lr=0.1", *overrides]))  # fmt: skip
    group = TrainerGroup(cfg)
    try:
        metrics = group.train(_batch(Qwen3(cfg.model).checkpoint_dir()))
        group.export_weights(str(tmp_path / name))
    finally:
        group.shutdown()
    return metrics, load_file(tmp_path / name / "model-00001.safetensors")


def test_tp2_and_dp2_match_one_rank(ray_session, tmp_path, monkeypatch):
    monkeypatch.setenv("RLX_CACHE", str(tmp_path / "cache"))
    base, base_weights = _train_once(tmp_path, "tp1")
    # the old policy is the current one at the first step: ratio exactly 1
    assert base["train/ppo_kl"] == 0.0 and base["train/pg_clipfrac"] == 0.0
    # one optimizer step per rollout: the old log-probs are the training pass's, no pass before it
    assert "time/logprobs_s" not in base
    # the trainer reproduces transformers' log-probs of the same tokens
    assert base["train/logprob_abs_diff"] <= 1e-5
    assert base["train/grad_norm"] > 0

    for name, overrides in {
        "tp2": ["cluster.num_trainer_procs=2", "cluster.tensor_parallel_size=2"],
        # and each DP rank's 32 samples in one forward-only micro-batch (training's: two of 16)
        "dp2": [
            "cluster.num_trainer_procs=2",
            "train.logprob_micro_batch_size=32",
            "train.old_logprobs=recompute",
        ],
        # the old log-probs from a forward-only pass first, instead of the training pass's own
        "old_logprobs_recomputed": ["train.old_logprobs=recompute"],
        # Adam's state sharded over the two DP ranks: the same step
        "dp2_distributed_optimizer": ["cluster.num_trainer_procs=2", "train.distributed_optimizer=true"],
        # activations recomputed in the backward pass: the same gradients
        "recompute": ["train.recompute=full"],
    }.items():
        metrics, weights = _train_once(tmp_path, name, *overrides)
        assert ("time/logprobs_s" in metrics) == ("train.old_logprobs=recompute" in overrides), name
        for key in (
            "train/loss",
            "train/pg_loss",
            "train/entropy",
            "train/grad_norm",
            "train/logprob_abs_diff",
        ):
            assert metrics[key] == pytest.approx(base[key], rel=1e-4, abs=1e-6), (name, key)
        assert weights.keys() == base_weights.keys()
        for key, tensor in base_weights.items():
            torch.testing.assert_close(weights[key], tensor, rtol=0, atol=1e-6, msg=f"{name}: {key}")
        # and the step changed the weights (the comparison is not between untouched copies)
    initial = load_file(Qwen3(to_object(compose([])).model).checkpoint_dir() / "model.safetensors")
    assert max((base_weights[k] - initial[k]).abs().max().item() for k in initial) > 1e-4


def test_a_kept_rank_process_trains_exactly_as_a_new_one(ray_session, tmp_path, monkeypatch):
    """keep_actors: the next group sets the first group's rank process up again (same pid), and
    after a PPO run in it (policy, critic, optimizers) a GRPO step there equals the step of a new
    process bit for bit: nothing of Megatron's state from the run before is left."""
    monkeypatch.setenv("RLX_CACHE", str(tmp_path / "cache"))
    with keep_actors():  # a pool of its own, empty: the first group starts a new process
        fresh, fresh_weights = _train_once(tmp_path, "fresh")
        (kept,) = rlx.actor_reuse._kept["trainer"]
        _train_once(tmp_path, "ppo", "algo=ppo", "algo.critic_lr=0.1")
        again, again_weights = _train_once(tmp_path, "again")
        assert rlx.actor_reuse._kept["trainer"] == [kept]  # the same process each time, handed back after
    # not kept: ranks on GPUs, in a placement group or in an environment of their run's own
    for options in (
        {"num_gpus": 1},
        {"scheduling_strategy": "pg"},
        {"runtime_env": {"env_vars": {"K": "v"}}},
    ):
        assert not rlx.actor_reuse.keepable({"num_cpus": 0, **options})
    # the step's numbers, not the process's own measures (seconds, peak memory: a kept process's differs)
    numbers = lambda metrics: {k: v for k, v in metrics.items() if not k.startswith(("time/", "perf/"))}  # noqa: E731
    assert numbers(again) == numbers(fresh) and "train/grad_norm" in numbers(fresh)
    assert again_weights.keys() == fresh_weights.keys()
    for key, tensor in fresh_weights.items():
        assert torch.equal(again_weights[key], tensor), key


def test_ppo_tp2_and_dp2_match_one_rank(ray_session, tmp_path, monkeypatch):
    """PPO through the trainer: the critic's values gathered over DP feed GAE, and the critic
    and the policy take the one-rank steps under TP=2 and DP=2."""
    monkeypatch.setenv("RLX_CACHE", str(tmp_path / "cache"))
    ppo = ["algo=ppo", "algo.critic_lr=0.1"]
    base, base_weights = _train_once(tmp_path, "ppo_tp1", *ppo)
    assert base["train/value_loss"] > 0 and base["train/critic_grad_norm"] > 0
    assert base["train/explained_variance"] < 0  # a fresh value head
    for name, overrides in {
        "ppo_tp2": ["cluster.num_trainer_procs=2", "cluster.tensor_parallel_size=2"],
        "ppo_dp2": ["cluster.num_trainer_procs=2"],
    }.items():
        metrics, weights = _train_once(tmp_path, name, *ppo, *overrides)
        for key in ("train/values_mean", "train/explained_variance", "train/value_loss",
                    "train/critic_grad_norm", "train/pg_loss", "train/grad_norm"):  # fmt: skip
            assert metrics[key] == pytest.approx(base[key], rel=1e-4, abs=1e-6), (name, key)
        for key, tensor in base_weights.items():
            torch.testing.assert_close(weights[key], tensor, rtol=0, atol=1e-6, msg=f"{name}: {key}")


def test_kl_loss_with_the_old_logprobs_from_the_training_pass(tmp_path, monkeypatch):
    """GRPO with a KL loss: the reference's forward-only pass still runs (and is timed), the old
    log-probs come from the training pass, and the step is the one computed with both passes."""
    monkeypatch.setenv("RLX_CACHE", str(tmp_path / "cache"))
    kl = ["algo.use_kl_loss=true", "algo.kl_loss_coef=0.5"]
    auto, auto_weights = _train_once(tmp_path, "kl_auto", *kl)
    both, both_weights = _train_once(tmp_path, "kl_recompute", *kl, "train.old_logprobs=recompute")
    assert "time/logprobs_s" in auto and "time/logprobs_s" in both  # the reference's pass
    assert auto["train/kl"] == 0.0  # policy and reference are the same weights before the step
    for key in ("train/loss", "train/pg_loss", "train/grad_norm", "train/logprob_abs_diff", "train/ppo_kl"):
        assert auto[key] == pytest.approx(both[key], rel=1e-5, abs=1e-7), key
    for key, tensor in both_weights.items():
        torch.testing.assert_close(auto_weights[key], tensor, rtol=0, atol=1e-7, msg=key)
