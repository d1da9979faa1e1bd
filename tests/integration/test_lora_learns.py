"""The default toy job (copy 3 digits, tiny Qwen3, CPU) learns with LoRA through the real loop, and
its exports load: the merged model in transformers, the adapters with peft.

LoRA freezes the embedding and the final norm. The tiny model's random tied embedding (std 0.02)
and unit norm weight give logits within about +-1.3 whatever the layers compute, so no adapter
can make a digit likely (full fine-tuning learns by growing exactly those two): a LoRA run on it
stays at its starting reward (0.07 -> 0.08 over 150 steps at rank 16 or 32, lr 5e-3 to 3e-2).
A trained model's logits have range; here the base is the same tiny checkpoint with its final
norm's weight times 5 (logits within about +-6), written by the test.

Seeded run of 150 steps at half the default rollout batch (16 prompts x 8 samples, about 60 s on
a free 2-core CPU), rank 16, alpha 32, lr 2e-3 (2026-11-27): mean reward of the first 5 steps ->
the last 10: 0.062 -> 0.58 (run.seed=1), 0.083 -> 0.61 (run.seed=2). (lr 5e-3: 0.09 -> 0.34; norm x3
at lr 5e-3: 0.08 -> 0.39.) The asserted margin, +0.3, leaves room for drift across machines.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rlx.config.build import build
from rlx.config.compose import compose, to_object
from rlx.runtime import run

MARGIN = 0.3
NORM_SCALE = 5.0


def _base_with_range(tmp_path):
    """The default tiny checkpoint with its final norm's weight times NORM_SCALE."""
    source = build(to_object(compose([])).model).checkpoint_dir()
    base = tmp_path / "base"
    shutil.copytree(source, base)
    weights = load_file(base / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"] * NORM_SCALE
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    return base


@pytest.mark.slow
def test_lora_raises_reward_on_the_toy_task_and_its_exports_load(tmp_path):
    from peft import PeftModel

    base = _base_with_range(tmp_path)
    out = tmp_path / "run"
    lora = ["train.lora.rank=16", "train.lora.alpha=32", "train.lr=2e-3"]
    overrides = [f"run.output_dir={out}", f"model.hf_checkpoint={base}", "rollout.batch_size=16",
                 "run.num_rollout=150", "run.progress=false", "run.save_hf=true", *lora]  # fmt: skip
    history = run(compose(overrides))
    rewards = [h["rollout/reward_mean"] for h in history]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert first <= 0.3, rewards
    assert last >= first + MARGIN, rewards
    # the engine served the trainer's merged policy at every step (the trainer's log-probs of the
    # sampled tokens, before its update, against the engine's)
    assert max(h["train/logprob_abs_diff"] for h in history) < 1e-4

    # the exports: the merged model and, on the base, the PEFT adapter give the same log-probs
    ids = torch.tensor([[2, 5, 7, 9, 12, 5, 7, 9, 1]])
    merged = AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float32)
    with torch.no_grad():
        merged_logp = torch.log_softmax(merged(ids).logits.float(), -1)
        adapted = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), out / "hf_adapter"
        )
        adapted_logp = torch.log_softmax(adapted(ids).logits.float(), -1)
        with adapted.disable_adapter():
            base_logp = torch.log_softmax(adapted(ids).logits.float(), -1)
    torch.testing.assert_close(adapted_logp, merged_logp, rtol=0, atol=1e-4)
    assert (merged_logp - base_logp).abs().max() > 0.1  # the adapters changed the model
    config = json.loads((out / "hf_adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (16, 32.0)
