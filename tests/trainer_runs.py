"""Parity runs of the trainer group (CPU, gloo, Ray actors) for the parallel layouts' tests
(test_pipeline.py, test_context_parallel.py): the same samples trained under one layout and
another, every rollout's metrics and exported weights compared.

Tolerances: the ranks compute the same fp32 arithmetic in another order, so metrics agree to
rel 1e-4 and weights after two Adam steps to 1e-6 (with adam_eps=1, as in test_trainer.py, a
weight moves by about lr * gradient, so comparing weights compares gradients).
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlx.config.build import build
from rlx.config.compose import compose, to_object
from rlx.sample import Sample
from rlx.trainer.group import TrainerGroup

COMPARED = (
    "train/loss",
    "train/pg_loss",
    "train/entropy",
    "train/grad_norm",
    "train/logprob_abs_diff",
    "train/ppo_kl",
)


def random_samples(
    hf_dir, num_samples: int, prompt_lens: tuple[int, int], response_lens: tuple[int, int], seed: int = 0
) -> list[Sample]:
    """Groups of 8 samples with prompt and response lengths drawn from [lo, hi), random tokens,
    transformers' log-probs as rollout log-probs."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(num_samples):
        prompt = torch.randint(
            2, 12, (int(torch.randint(*prompt_lens, (1,), generator=g)),), generator=g
        ).tolist()
        response = torch.randint(
            2, 16, (int(torch.randint(*response_lens, (1,), generator=g)),), generator=g
        ).tolist()
        with torch.no_grad():
            logp_V = torch.log_softmax(model(torch.tensor([prompt + response])).logits[0].float(), -1)
        rollout_logp = [logp_V[len(prompt) - 1 + t, tok].item() for t, tok in enumerate(response)]
        samples.append(Sample(prompt="", prompt_ids=prompt, response_ids=response, rollout_logprobs=rollout_logp,
                              loss_mask=[1] * len(response), reward=float(torch.rand(1, generator=g) > 0.5),
                              group=i // 8, index=i % 8))  # fmt: skip
    return samples


def config(tmp_path, num_samples: int, *overrides):
    """`num_samples` per rollout: two optimizer steps of half of them, micro-batches of 4;
    adam_eps=1 makes the update ~lr * gradient."""
    return to_object(compose([f"run.output_dir={tmp_path}", f"rollout.batch_size={num_samples // 8}",
                              "rollout.n_samples_per_prompt=8", f"train.global_batch_size={num_samples // 2}",
                              "train.num_steps_per_rollout=2", "train.micro_batch_size=4", "train.adam_eps=1.0",
                              "train.lr=0.1", "algo.critic_lr=0.1", *overrides]))  # fmt: skip


def train(
    tmp_path, name: str, *overrides, shape: tuple[int, tuple[int, int], tuple[int, int]],
    load: str | None = None, rollouts: int = 2, save_after: int | None = None,
):  # fmt: skip
    """`rollouts` rollouts of training (two optimizer steps each) on the same `random_samples`
    of `shape` (number, prompt lengths, response lengths), after loading the checkpoint `load`;
    each rollout's metrics and the exported weights after each. With `save_after`=k a checkpoint
    `<name>_ckpt` is written after rollout k."""
    cfg = config(tmp_path, shape[0], *overrides)
    samples = random_samples(build(cfg.model).checkpoint_dir(), *shape)
    group = TrainerGroup(cfg)
    history, exports = [], []
    try:
        if load:
            group.load(load)
        for k in range(rollouts):
            # the same samples each rollout, in another order (other micro-batches and steps)
            history.append(group.train(samples if k % 2 == 0 else list(reversed(samples))))
            group.export_weights(str(tmp_path / f"{name}_{k}"))
            exports.append(load_file(tmp_path / f"{name}_{k}" / "model-00001.safetensors"))
            if save_after == k:
                group.save(str(tmp_path / f"{name}_ckpt"))
    finally:
        group.shutdown()
    return history, exports


def initial_weights(tmp_path, *overrides) -> dict[str, torch.Tensor]:
    """The policy's weights before any step (the checkpoint the trainer starts from): the
    default model's, or that of `overrides` (e.g. model=tiny_qwen3_moe)."""
    return load_file(build(config(tmp_path, 8, *overrides).model).checkpoint_dir() / "model.safetensors")


def assert_same_run(name, got, expected, keys=COMPARED):
    """Every rollout's metrics and exported weights as in `expected`, names in its order."""
    for k, (metrics, base) in enumerate(zip(got[0], expected[0], strict=True)):
        for key in keys:
            assert metrics[key] == pytest.approx(base[key], rel=1e-4, abs=1e-6), (name, k, key)
    for k, (weights, base) in enumerate(zip(got[1], expected[1], strict=True)):
        assert list(weights) == list(base)  # the one-rank names, in the one-rank order
        for key, tensor in base.items():
            torch.testing.assert_close(weights[key], tensor, rtol=0, atol=1e-6, msg=f"{name} {k}: {key}")
