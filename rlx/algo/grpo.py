"""GRPO: group-normalised outcome rewards as advantages, PPO's clipped surrogate as the loss.

Shape legend: B samples in a micro-batch, T response tokens, N samples in one group.
"""

from __future__ import annotations

from functools import partial

import torch

from rlx.algo.config import AlgoConfig
from rlx.algo.losses import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    aggregate,
    clipped_policy_loss,
    group_normalized_advantages,
    kl_estimate,
)
from rlx.sample import Sample


class GRPO:
    """Group Relative Policy Optimization (Shao et al., 2024), with DAPO's clip-higher and
    token-mean options and Dr. GRPO's unnormalised advantages through `AlgoConfig`.

    Every token of a response gets its sample's scalar advantage. Implements `Algorithm`.
    """

    def __init__(self, cfg: AlgoConfig) -> None:
        # fail at construction, not at the first loss call after a long rollout
        if cfg.kl_loss_type not in KL_ESTIMATORS:
            raise ValueError(f"algo.kl_loss_type={cfg.kl_loss_type!r} is not one of {sorted(KL_ESTIMATORS)}")
        if cfg.loss_agg not in LOSS_AGGREGATIONS:
            raise ValueError(f"algo.loss_agg={cfg.loss_agg!r} is not one of {LOSS_AGGREGATIONS}")
        self.cfg = cfg

    @property
    def needs_ref(self) -> bool:
        return self.cfg.use_kl_loss

    def advantages(
        self, samples: list[Sample], logprobs: dict[str, list[torch.Tensor]] | None = None
    ) -> list[torch.Tensor]:
        """Each sample's group-normalised reward, repeated over its response tokens (GRPO's
        outcome advantage does not use `logprobs`)."""
        adv_per_sample: list[torch.Tensor] = []
        for group in _contiguous_groups(samples):
            rewards_1N = torch.tensor([[_reward(s) for s in group]], dtype=torch.float64)
            adv_N = group_normalized_advantages(rewards_1N, self.cfg.normalize_std)[0]
            adv_per_sample.extend(adv_N.float())
        return [adv.expand(s.response_len).clone() for adv, s in zip(adv_per_sample, samples, strict=True)]

    def loss(
        self, mb: dict[str, torch.Tensor], num_global_tokens: int, num_global_samples: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """pg_loss + kl_loss_coef * kl - entropy_coef * entropy, normalised by global counts."""
        cfg = self.cfg
        mask_BT = mb["mask"]
        agg = partial(
            aggregate,
            mask_BT=mask_BT,
            mode=cfg.loss_agg,
            num_global_tokens=num_global_tokens,
            num_global_samples=num_global_samples,
        )
        pg_loss_BT, clipfrac_BT, ppo_kl_BT = clipped_policy_loss(
            mb["logp"], mb["old_logp"], mb["adv"], cfg.eps_clip, cfg.eps_clip_high
        )
        pg_loss = agg(pg_loss_BT)
        entropy = agg(mb["entropy"])
        loss = pg_loss - cfg.entropy_coef * entropy
        metrics = {
            "pg_loss": pg_loss.detach(),
            "pg_clipfrac": agg(clipfrac_BT),
            "ppo_kl": agg(ppo_kl_BT),
            "entropy": entropy.detach(),
        }
        if cfg.use_kl_loss:
            if "ref_logp" not in mb:
                raise KeyError("algo.use_kl_loss is set but the micro-batch has no 'ref_logp'")
            kl = agg(kl_estimate(mb["logp"], mb["ref_logp"], cfg.kl_loss_type))
            loss = loss + cfg.kl_loss_coef * kl
            metrics["kl"] = kl.detach()
        metrics["loss"] = loss.detach()
        return loss, metrics


def _reward(sample: Sample) -> float:
    if sample.reward is None:
        raise ValueError(
            f"sample (group={sample.group}, index={sample.index}) has no reward; "
            "every sample must be rewarded (or filtered out) before advantages"
        )
    return float(sample.reward)


def _contiguous_groups(samples: list[Sample]) -> list[list[Sample]]:
    """Split samples into runs of equal `group`; a group split across runs is an error,
    because normalising its halves separately would silently give wrong advantages."""
    groups: list[list[Sample]] = []
    seen: set[int] = set()
    for sample in samples:
        if groups and groups[-1][0].group == sample.group:
            groups[-1].append(sample)
            continue
        if sample.group in seen:
            raise ValueError(
                f"group {sample.group} is not contiguous; samples must be ordered by (group, index)"
            )
        seen.add(sample.group)
        groups.append([sample])
    return groups
