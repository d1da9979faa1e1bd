"""REINFORCE++: token-level discounted returns with the KL penalty in the reward, whitened
over the batch; no critic, no groups.

Shape legend: B responses of the batch, T response tokens (right-padded).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from rlx.algo.losses import discounted_returns
from rlx.algo.policy_gradient import PolicyGradient, padded_rows, unpadded_rows
from rlx.sample import Sample


class ReinforcePP(PolicyGradient):
    """REINFORCE++ (Hu, 2025, arXiv:2501.03262), as OpenRLHF (`advantage_estimator=reinforce`)
    and verl (`reinforce_plus_plus`) compute it.

    Per-token reward: -kl_in_reward_coef * KL(old policy || reference) on every loss token
    (`use_kl_in_reward`, set by conf/algo/reinforce_pp.yaml) plus the outcome reward on the
    last loss token. The advantage of token t is its discounted return
    G_t = sum_{k >= t} gamma^(k - t) r_k, whitened over every loss token of the rollout batch
    (`whiten_advantages`, also set by the yaml): the batch mean is the baseline, so no group
    of samples per prompt is needed. The loss is PPO's clipped surrogate, as in GRPO.
    """

    min_group_size: ClassVar[int] = 1  # the baseline is the batch, not the prompt's group

    def estimate(
        self,
        samples: list[Sample],
        token_rewards: list[torch.Tensor],
        logprobs: dict[str, list[torch.Tensor]],
        masks: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor], None]:
        returns_BT = discounted_returns(padded_rows(token_rewards), self.cfg.gamma)
        return unpadded_rows(returns_BT, [r.shape[0] for r in token_rewards]), None
