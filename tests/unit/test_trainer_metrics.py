"""The trainer's per-batch metrics from whole-batch tensors: hand-computed values."""

import math

import pytest
import torch

from rlx.sample import Sample
from rlx.trainer.megatron import advantage_stats, logprob_gap, rollout_logprobs


def _samples() -> list[Sample]:
    return [
        # the second token is tool output: outside the loss, whatever its log-probs
        Sample(prompt="a", prompt_ids=[1], response_ids=[4, 5, 6], loss_mask=[1, 0, 1],
               rollout_logprobs=[-1.0, -2.0, -0.5]),
        Sample(prompt="b", prompt_ids=[2], response_ids=[7, 8], rollout_logprobs=[-0.1, -0.2]),
        Sample(prompt="c", prompt_ids=[3], response_ids=[9, 9]),  # no engine log-probs: left out
    ]  # fmt: skip


def test_logprob_gap_is_the_mean_over_loss_tokens_of_samples_with_engine_logprobs():
    old_logp = [torch.tensor([-1.25, -9.0, -0.5]), torch.tensor([-0.3, -0.2]), torch.tensor([0.0, 0.0])]
    # |-1.25 + 1| + |-0.5 + 0.5| + |-0.3 + 0.1| + |-0.2 + 0.2| over 4 loss tokens
    gap = logprob_gap(_samples(), old_logp)["train/logprob_abs_diff"]
    assert gap == pytest.approx((0.25 + 0.2) / 4, abs=1e-7)
    assert logprob_gap(_samples()[2:], old_logp[2:]) == {"train/logprob_abs_diff": 0.0}


def test_advantage_stats_over_loss_tokens_only():
    advantages = [torch.tensor([1.0, 100.0, 3.0]), torch.tensor([-2.0, -2.0])]
    stats = advantage_stats(_samples()[:2], advantages)  # values 1, 3, -2, -2 (100 is tool output)
    assert stats["train/adv_mean"] == 0.0
    assert stats["train/adv_std"] == pytest.approx(math.sqrt(18 / 3))  # unbiased, as torch.std
    assert (stats["train/adv_max"], stats["train/adv_min"]) == (3.0, -2.0)


def test_rollout_logprobs_one_float32_row_per_sample():
    rows = rollout_logprobs(_samples()[:2])
    assert [row.tolist() for row in rows] == [pytest.approx([-1.0, -2.0, -0.5]), pytest.approx([-0.1, -0.2])]
    assert all(row.dtype == torch.float32 for row in rows)
