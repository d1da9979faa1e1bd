"""GRPO: group-normalised outcome rewards as advantages, PPO's clipped surrogate as the loss.

Shape legend: T one response's tokens, N samples in one group.
"""

from __future__ import annotations

import torch

from rlx.algo.losses import group_normalized_advantages
from rlx.algo.policy_gradient import PolicyGradient, contiguous_groups
from rlx.sample import Sample


class GRPO(PolicyGradient):
    """Group Relative Policy Optimization (Shao et al., 2024), with DAPO's clip-higher and
    token-mean options and Dr. GRPO's unnormalised advantages through `AlgoConfig`.

    Each sample's return (its outcome reward, minus the summed KL penalty when
    `use_kl_in_reward`, as verl sums `token_level_rewards`) is centred on its group's mean and,
    with `normalize_std`, divided by the group's std; every response token gets that value.
    """

    def estimate(
        self,
        samples: list[Sample],
        token_rewards: list[torch.Tensor],
        logprobs: dict[str, list[torch.Tensor]],
    ) -> tuple[list[torch.Tensor], None]:
        adv_per_sample: list[torch.Tensor] = [torch.zeros(())] * len(samples)
        for group in contiguous_groups(samples):
            returns_1N = torch.stack([token_rewards[i].sum() for i in group]).unsqueeze(0)
            adv_N = group_normalized_advantages(returns_1N, self.cfg.normalize_std)[0]
            for i, adv in zip(group, adv_N, strict=True):
                adv_per_sample[i] = adv
        return [
            adv.expand(s.response_len).clone() for adv, s in zip(adv_per_sample, samples, strict=True)
        ], None
