"""PPO with a learned critic: GAE advantages from per-token rewards and the critic's values,
the critic's regression targets (returns) returned beside them, PPO's clipped surrogate.

Shape legend: T one response's tokens, K loss tokens of the whole rollout batch, concatenated.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from rlx.algo.base import Advantages
from rlx.algo.losses import gae
from rlx.algo.policy_gradient import (
    PolicyGradient,
    flat_loss_mask,
    padded_rows,
    unpadded_rows,
)
from rlx.sample import Sample


class PPO(PolicyGradient):
    """Proximal Policy Optimization (Schulman et al., 2017) with a value model, as OpenRLHF
    (`advantage_estimator=gae`) and verl (`adv_estimator=gae`) run it on LLMs.

    Per-token rewards are the base class's: the outcome reward on the last loss token, minus
    kl_in_reward_coef * KL(old || ref) on every loss token when `use_kl_in_reward`. The
    trainer's critic gives one value per response token (`logprobs["values"]`, the value of
    the state before that token); `estimate` runs GAE (`gamma`, `lambd`) over each response's
    loss tokens and returns the returns, advantages + values, as the critic's targets
    (`Advantages.returns`). `whiten_advantages` (on in conf/algo/ppo.yaml, as both reference systems do) then
    whitens the advantages over the batch; the returns stay unwhitened. The loss is PPO's
    clipped surrogate, shared with GRPO.

    Logged besides the base class's metrics ("return_mean" there is the mean summed
    reward per sample): "values_mean" and "returns_mean" over loss tokens, and
    "explained_variance", 1 - Var(R - V) / Var(R) over loss tokens, of the values the critic gave
    before this rollout's update (1: the critic predicts the returns; <= 0: no better than
    their mean).
    """

    min_group_size: ClassVar[int] = 1  # the critic is the baseline, not the prompt's group
    needs_critic: ClassVar[bool] = True  # the trainer builds a value model and trains it on `returns`

    def advantages(
        self, samples: list[Sample], logprobs: dict[str, list[torch.Tensor]] | None = None
    ) -> Advantages:
        """GAE advantages per sample, the critic's targets (`returns`) and value metrics."""
        result = super().advantages(samples, logprobs)
        mask_K = flat_loss_mask(samples)
        values_K = torch.cat(logprobs["values"]).double()[mask_K] if samples else torch.zeros(0)
        returns_K = torch.cat(result.returns).double()[mask_K] if samples else torch.zeros(0)
        result.metrics |= _value_metrics(values_K, returns_K)
        return result

    def estimate(
        self,
        samples: list[Sample],
        token_rewards: list[torch.Tensor],
        logprobs: dict[str, list[torch.Tensor]],
        masks: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if "values" not in logprobs:
            raise KeyError("PPO's advantages need the critic's values: logprobs['values'] is missing")
        lengths = [s.response_len for s in samples]
        adv_BT, returns_BT = gae(
            padded_rows(token_rewards),
            padded_rows(logprobs["values"]),
            padded_rows(masks),
            self.cfg.gamma,
            self.cfg.lambd,
        )
        return unpadded_rows(adv_BT, lengths), unpadded_rows(returns_BT.float(), lengths)


def _value_metrics(values_K: torch.Tensor, returns_K: torch.Tensor) -> dict[str, float]:
    if values_K.numel() == 0:
        return {}
    var_returns = returns_K.var(correction=0)
    explained = 1.0 - (returns_K - values_K).var(correction=0) / var_returns if var_returns > 0 else torch.nan
    return {
        "values_mean": float(values_K.mean()),
        "returns_mean": float(returns_K.mean()),
        "explained_variance": float(explained),
    }
