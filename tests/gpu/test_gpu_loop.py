"""The loop with the trainer on a GPU (NCCL, no CPU boundary module); skipped without a GPU.

Run on the GPU machine:  source .whl/install.sh && python3 -m pytest tests/gpu -q
"""

from __future__ import annotations

import pytest
import torch

from rlx.config.compose import compose
from rlx.runtime import run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHORT = [
    "rollout.batch_size=8",
    "rollout.n_samples_per_prompt=4",
    "train.micro_batch_size=16",
    "run.progress=false",
]


def test_loop_trains_on_gpu(tmp_path):
    history = run(
        compose([f"run.output_dir={tmp_path}", "cluster.gpus_per_node=1", "run.num_rollout=3", *SHORT])
    )
    assert len(history) == 3
    # Trainer on the GPU (fp32, TF32 off) against the CPU engine: same distribution up to
    # kernel summation order, far below any policy change.
    assert history[0]["train/logprob_abs_diff"] <= 1e-5
    assert all(h["train/grad_norm"] > 0 for h in history)


def test_default_job_learns_on_gpu(tmp_path):
    history = run(compose([f"run.output_dir={tmp_path}", "cluster.gpus_per_node=1", "run.progress=false"]))
    rewards = [h["rollout/reward_mean"] for h in history]
    assert sum(rewards[-5:]) / 5 >= sum(rewards[:5]) / 5 + 0.4, rewards


def test_ppo_loop_trains_its_critic_on_gpu(tmp_path):
    history = run(compose([f"run.output_dir={tmp_path}", "cluster.gpus_per_node=1", "run.num_rollout=3",
                           "algo=ppo", "run.save=true", *SHORT]))  # fmt: skip
    assert len(history) == 3
    for h in history:
        assert h["train/value_loss"] > 0 and h["train/critic_grad_norm"] > 0 and h["train/grad_norm"] > 0
        assert -10.0 < h["train/explained_variance"] < 1.0
    assert (tmp_path / "checkpoints" / "step_000002" / "megatron_critic").is_dir()
