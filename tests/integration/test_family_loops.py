"""Every tiny model family (conf/model/tiny_*.yaml: dense and MoE) through the real loop: two GRPO
steps in which the trainer reproduces the engine's log-probs, before the first update and after the
synced one. The families' parity with transformers is in test_dense_families.py and
test_moe_families.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlx.config.compose import compose
from rlx.runtime import run

OPTIONS = sorted(p.stem for p in (Path(__file__).parents[2] / "conf" / "model").glob("tiny_*.yaml"))


def test_every_tiny_family_is_here():
    assert {"tiny_qwen3", "tiny_llama3", "tiny_glm4", "tiny_qwen3_moe", "tiny_deepseek_v3"} <= set(OPTIONS)


@pytest.mark.parametrize("option", OPTIONS)
def test_two_grpo_steps_keep_trainer_and_engine_logprobs_equal(option, tmp_path, monkeypatch):
    monkeypatch.setenv("RLX_CACHE", str(tmp_path / "cache"))
    overrides = [
        f"run.output_dir={tmp_path / 'run'}",
        f"model={option}",
        "run.num_rollout=2",
        "rollout.batch_size=8",
        "rollout.n_samples_per_prompt=4",
        "train.micro_batch_size=16",
        "run.progress=false",
    ]
    history = run(compose(overrides))
    assert [h["step"] for h in history] == [0, 1]
    # Same weights, same temperature-1 distribution, fp32: the trainer reproduces the engine, and
    # after the first update the engines serve the synced weights: still the trainer's policy.
    assert [h["train/logprob_abs_diff"] <= 1e-5 for h in history] == [True, True]
    assert all(
        torch.isfinite(torch.tensor(h["train/grad_norm"])) and h["train/grad_norm"] > 0 for h in history
    )
    # The tiny model went to this test's cache, not the user's.
    assert [p.name.split("-")[0] for p in (tmp_path / "cache" / "models").iterdir()] == [option]
