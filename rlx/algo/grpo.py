"""GRPO: group-normalised outcome rewards as advantages, PPO's clipped surrogate as the loss.

Shape legend: T one response's tokens, N samples in one group.
"""

from __future__ import annotations

import torch

from rlx.algo.losses import group_normalized_advantages
from rlx.algo.policy_gradient import PolicyGradient, contiguous_groups, per_sample_sums
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
        masks: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor], None]:
        returns_S = per_sample_sums(token_rewards)
        adv_S = torch.zeros(len(samples), dtype=torch.float64)
        for group in contiguous_groups(samples):  # contiguous: a slice of the batch
            first, last = group[0], group[-1] + 1
            adv_S[first:last] = group_normalized_advantages(
                returns_S[first:last].unsqueeze(0), self.cfg.normalize_std
            )[0]
        lengths = [s.response_len for s in samples]
        # every response token gets its sample's advantage
        return list(adv_S.repeat_interleave(torch.tensor(lengths, dtype=torch.long)).split(lengths)), None
