"""Pipeline parallelism through the trainer (CPU, gloo, Ray actors): PP=2 and TP=2 x PP=2 take
the one-rank steps, for GRPO and for PPO's critic, export the one-rank HF directory, and their
checkpoints load under another pipeline size.

Tolerances: the ranks compute the same fp32 arithmetic in a different order (the TP all-reduces,
stage boundaries), so metrics agree to rel 1e-4 and weights after two Adam steps to 1e-6 (with
adam_eps=1, as in test_trainer.py, a weight moves by about lr * gradient).
"""

from __future__ import annotations

import pytest
import ray
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlx.config.compose import compose, to_object
from rlx.models.qwen3 import Qwen3
from rlx.sample import Sample
from rlx.trainer.group import TrainerGroup

PP2 = ["cluster.num_trainer_procs=2", "cluster.pipeline_parallel_size=2"]
TP2_PP2 = [
    "cluster.num_trainer_procs=4",
    "cluster.tensor_parallel_size=2",
    "cluster.pipeline_parallel_size=2",
]
COMPARED = (
    "train/loss",
    "train/pg_loss",
    "train/entropy",
    "train/grad_norm",
    "train/logprob_abs_diff",
    "train/ppo_kl",
)


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def batch(hf_dir, num_samples: int = 32, seed: int = 0) -> list[Sample]:
    """Groups of 8 samples of varied lengths, transformers' log-probs as rollout log-probs."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_samples):
        prompt = torch.randint(2, 12, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g).tolist()
        response = torch.randint(2, 16, (int(torch.randint(1, 7, (1,), generator=g)),), generator=g).tolist()
        with torch.no_grad():
            logp_V = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0].float(), -1)
        rollout_logp = [logp_V[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response)]
        samples.append(Sample(prompt="", prompt_ids=prompt, response_ids=response, rollout_logprobs=rollout_logp,
                              loss_mask=[1] * len(response), reward=float(torch.rand(1, generator=g) > 0.5),
                              group=i // 8, index=i % 8))  # fmt: skip
    return samples


def config(tmp_path, *overrides):
    # 32 samples: two optimizer steps of 16 per rollout, micro-batches of 4 (so 4 micro-batches
    # per step go through the pipeline); adam_eps=1 makes the update ~lr * gradient
    return to_object(compose([f"run.output_dir={tmp_path}", "rollout.batch_size=4", "rollout.n_samples_per_prompt=8",
                              "train.global_batch_size=16", "train.num_steps_per_rollout=2", "train.micro_batch_size=4",
                              "train.adam_eps=1.0", "train.lr=0.1", "algo.critic_lr=0.1", *overrides]))  # fmt: skip


def train(tmp_path, name, *overrides, save: bool = False, load: str | None = None):
    """Two rollouts of training (two optimizer steps each); each rollout's metrics, the export."""
    cfg = config(tmp_path, *overrides)
    group = TrainerGroup(cfg)
    try:
        if load:
            group.load(load)
        samples = batch(Qwen3(cfg.model).checkpoint_dir())
        history = [group.train(samples[:32]), group.train(list(reversed(samples)))]
        group.export_weights(str(tmp_path / name))
        if save:
            group.save(str(tmp_path / f"{name}_ckpt"))
    finally:
        group.shutdown()
    return history, load_file(tmp_path / name / "model-00001.safetensors")


def assert_same_run(name, got, expected, keys=COMPARED):
    (history, weights), (base_history, base_weights) = got, expected
    for step, (metrics, base) in enumerate(zip(history, base_history, strict=True)):
        for key in keys:
            assert metrics[key] == pytest.approx(base[key], rel=1e-4, abs=1e-6), (name, step, key)
    assert list(weights) == list(base_weights)  # the one-rank names, in the one-rank order
    for key, tensor in base_weights.items():
        torch.testing.assert_close(weights[key], tensor, rtol=0, atol=1e-6, msg=f"{name}: {key}")


def test_pp2_and_tp2_pp2_match_one_rank(ray_session, tmp_path, monkeypatch):
    monkeypatch.setenv("RLX_CACHE", str(tmp_path / "cache"))
    base = train(tmp_path, "one_rank")
    assert base[0][0]["train/logprob_abs_diff"] <= 1e-5  # the trainer reproduces transformers
    assert base[0][1]["train/ppo_kl"] != 0.0  # the second rollout starts from updated weights
    assert_same_run("pp2", train(tmp_path, "pp2", *PP2), base)
    assert_same_run("tp2_pp2", train(tmp_path, "tp2_pp2", *TP2_PP2), base)
    # the steps moved the weights (the comparison is not between untouched copies)
    initial = load_file(Qwen3(config(tmp_path).model).checkpoint_dir() / "model.safetensors")
    assert max((base[1][k] - initial[k]).abs().max().item() for k in initial) > 1e-3
