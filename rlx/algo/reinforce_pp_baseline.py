"""REINFORCE++-baseline: REINFORCE++ with each outcome reward centred on its group's mean."""

from __future__ import annotations

from typing import ClassVar

from rlx.algo.config import AlgoConfig
from rlx.algo.policy_gradient import contiguous_groups, sample_reward
from rlx.algo.reinforce_pp import ReinforcePP
from rlx.sample import Sample


class ReinforcePPBaseline(ReinforcePP):
    """REINFORCE++-baseline (Hu, 2025, arXiv:2501.03262, section on reasoning tasks), as
    OpenRLHF's `advantage_estimator=reinforce_baseline` and verl's
    `reinforce_plus_plus_baseline` compute it.

    Each outcome reward minus its group's mean (no division by the group std: that is GRPO)
    is the reward of the last loss token; the rest is REINFORCE++: an optional per-token KL
    penalty, undiscounted returns, and whitening over every loss token of the batch, so the
    batch std (of centred rewards) sets the scale. OpenRLHF forces gamma to 1 for this
    estimator and verl has none; rlx rejects another gamma instead of ignoring it.
    """

    min_group_size: ClassVar[int] = 2

    @classmethod
    def config_errors(cls, cfg: AlgoConfig) -> list[str]:
        errors = super().config_errors(cfg)
        if cfg.gamma != 1.0:
            errors.append(
                f"algo.gamma={cfg.gamma!r}: REINFORCE++-baseline subtracts a per-response baseline from "
                "undiscounted returns (as OpenRLHF and verl do); set algo.gamma=1.0, or use algo=reinforce_pp "
                "for discounted returns"
            )
        return errors

    def outcome_rewards(self, samples: list[Sample]) -> list[float]:
        centred = [0.0] * len(samples)
        for group in contiguous_groups(samples):
            mean = sum(sample_reward(samples[i]) for i in group) / len(group)
            for i in group:
                centred[i] = sample_reward(samples[i]) - mean
        return centred
