"""What every policy-gradient algorithm shares: reward shaping, advantage post-processing, and
PPO's clipped policy loss with its options (clip-higher, dual clip, KL loss, entropy bonus,
truncated importance sampling, token- or sample-mean aggregation).

An algorithm is this class plus three choices: which outcome reward each sample starts from
(`outcome_rewards`), how per-token rewards become advantages (`estimate`), and which
importance ratio the loss clips (`log_ratio`). None of them looks at an algorithm's name.

Shape legend: B samples in a micro-batch, T response tokens (a lone T: one response's
tokens), N samples in one group, K loss tokens of the whole rollout batch, concatenated.
"""

from __future__ import annotations

from functools import partial
from typing import ClassVar

import torch

from rlx.algo.base import Advantages
from rlx.algo.config import AlgoConfig
from rlx.algo.losses import (
    aggregate,
    batch_outcome_token_rewards,
    clipped_policy_loss,
    kl_estimate,
    token_log_ratio,
    truncated_is_weight,
    whitening_stats,
)
from rlx.config.rules import field_errors
from rlx.flat import flat_tensor, pad_2d
from rlx.sample import Sample


class PolicyGradient:
    """Base of GRPO, GSPO, REINFORCE++, REINFORCE++-baseline and PPO; implements `Algorithm`.

    `advantages`: each sample's outcome reward (`outcome_rewards`) goes on its last loss
    token; with `use_kl_in_reward` every loss token also gets -kl_in_reward_coef *
    KL(old policy || reference); `estimate` turns these per-token rewards into advantages;
    `whiten_advantages` then whitens them over every loss token of the batch.

    `loss`: PPO's clipped surrogate on `log_ratio(mb)`, times the TIS weight when `use_tis`,
    aggregated by `loss_agg`, plus kl_loss_coef * KL when `use_kl_loss`, minus
    entropy_coef * entropy.

    Class-level hooks read by `rlx.config.validate` before anything starts:
    `config_errors(cfg) -> list[str]` (this algorithm's rules, each naming its keys) and
    `min_group_size` (samples per prompt it needs).
    """

    min_group_size: ClassVar[int] = 2  # group-relative estimators compare samples of one prompt
    needs_critic: ClassVar[bool] = False  # PPO learns a value model; the others need none

    def __init__(self, cfg: AlgoConfig) -> None:
        # fail at construction, not at the first loss call after a long rollout
        errors = field_errors(cfg, AlgoConfig, "algo") + self.config_errors(cfg)
        if errors:
            raise ValueError("; ".join(errors))
        self.cfg = cfg

    @classmethod
    def config_errors(cls, cfg: AlgoConfig) -> list[str]:
        """Rules between `algo` fields (single-field choices and ranges are `AlgoConfig.RULES`)."""
        errors = []
        if cfg.use_kl_loss and cfg.use_kl_in_reward:
            errors.append(
                "algo.use_kl_loss=true and algo.use_kl_in_reward=true both penalise KL to the reference; "
                "choose one: set algo.use_kl_loss=false or algo.use_kl_in_reward=false"
            )
        if cfg.loss_agg == "seq_mean_token_sum_norm" and not cfg.loss_norm_len:
            errors.append(
                "algo.loss_agg=seq_mean_token_sum_norm divides each sample's token sum by algo.loss_norm_len, "
                f"which is {cfg.loss_norm_len!r}; set algo.loss_norm_len to the maximum response length "
                "(conf/config.yaml sets it to ${rollout.max_response_len})"
            )
        if cfg.eps_clip_c is not None and cfg.eps_clip_c <= 1.0:
            errors.append(
                f"algo.eps_clip_c={cfg.eps_clip_c!r} must be > 1 (dual clip caps the loss of negative "
                "advantages at eps_clip_c * |A|, above the clipped surrogate); set algo.eps_clip_c=3.0, "
                "say, or null to turn dual clip off"
            )
        return errors

    @property
    def needs_ref(self) -> bool:
        return self.cfg.use_kl_loss or self.cfg.use_kl_in_reward

    @property
    def needs_old_logp(self) -> bool:
        """Whether `advantages` reads "old_logp": only for the KL penalty in the reward."""
        return self.cfg.use_kl_in_reward

    # ---- advantages ---------------------------------------------------------------------

    def advantages(
        self, samples: list[Sample], logprobs: dict[str, list[torch.Tensor]] | None = None
    ) -> Advantages:
        """Per-token advantages, one float32 tensor of length `response_len` per sample."""
        cfg = self.cfg
        masks = batch_loss_masks(samples)
        penalties: list[torch.Tensor] | None = None
        metrics: dict[str, float] = {}
        if cfg.use_kl_in_reward:
            kls = self._kl_to_ref(logprobs)
            penalties = [cfg.kl_in_reward_coef * kl_T for kl_T in kls]
            metrics["kl_in_reward"] = _masked_mean(kls, masks)
        token_rewards = (
            batch_outcome_token_rewards(self.outcome_rewards(samples), masks, penalties) if samples else []
        )
        metrics["return_mean"] = float(per_sample_sums(token_rewards).mean()) if samples else 0.0
        advs, returns = self.estimate(samples, token_rewards, logprobs or {}, masks)
        if cfg.whiten_advantages:
            advs = _whiten_over_loss_tokens(advs, masks)
        if not advs:
            return Advantages([], returns, metrics)
        return Advantages(list(torch.cat(advs).float().split([a.shape[0] for a in advs])), returns, metrics)

    def outcome_rewards(self, samples: list[Sample]) -> list[float]:
        """The scalar reward each sample starts from (REINFORCE++-baseline centres it)."""
        return [sample_reward(s) for s in samples]

    def estimate(
        self,
        samples: list[Sample],
        token_rewards: list[torch.Tensor],
        logprobs: dict[str, list[torch.Tensor]],
        masks: list[torch.Tensor],
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Advantages [response_len] per sample from per-token rewards [response_len], and the
        critic's targets when the algorithm has a critic (None otherwise). `masks`: each sample's
        float64 loss mask [response_len] (`batch_loss_masks`, made once per batch)."""
        raise NotImplementedError

    def _kl_to_ref(self, logprobs: dict[str, list[torch.Tensor]] | None) -> list[torch.Tensor]:
        """Per-token KL(old policy || reference) of each sample (the reward penalty's KL)."""
        if not logprobs or "ref_logp" not in logprobs:
            raise KeyError("algo.use_kl_in_reward is set but advantages() got no 'ref_logp'")
        return [
            kl_estimate(old_T.double(), ref_T.double(), self.cfg.kl_in_reward_type)
            for old_T, ref_T in zip(logprobs["old_logp"], logprobs["ref_logp"], strict=True)
        ]

    # ---- loss ---------------------------------------------------------------------------

    def log_ratio(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        """The log importance ratio the loss clips: per token (PPO), per sequence in GSPO."""
        return token_log_ratio(mb["logp"], mb["old_logp"])

    def loss(
        self, mb: dict[str, torch.Tensor], num_global_tokens: int, num_global_samples: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """pg_loss + kl_loss_coef * kl - entropy_coef * entropy, normalised by global counts."""
        cfg = self.cfg
        agg = partial(
            aggregate,
            mask_BT=mb["mask"],
            mode=cfg.loss_agg,
            num_global_tokens=num_global_tokens,
            num_global_samples=num_global_samples,
            norm_len=cfg.loss_norm_len,
        )
        pg_loss_BT, clipfrac_BT, dual_clipfrac_BT = clipped_policy_loss(
            self.log_ratio(mb), mb["adv"], cfg.eps_clip, cfg.eps_clip_high, cfg.eps_clip_c
        )
        metrics: dict[str, torch.Tensor] = {}
        if cfg.use_tis:
            if "rollout_logp" not in mb:
                raise KeyError("algo.use_tis is set but the micro-batch has no 'rollout_logp'")
            weight_BT, tis_clipped_BT = truncated_is_weight(
                mb["old_logp"], mb["rollout_logp"], cfg.tis_clip, mb["mask"], cfg.tis_level, cfg.tis_mode
            )
            pg_loss_BT = pg_loss_BT * weight_BT
            metrics["tis_weight_mean"] = agg(weight_BT)
            metrics["tis_clipfrac"] = agg(tis_clipped_BT)
        pg_loss = agg(pg_loss_BT)
        entropy = agg(mb["entropy"])
        loss = pg_loss - cfg.entropy_coef * entropy
        metrics |= {
            "pg_loss": pg_loss.detach(),
            "pg_clipfrac": agg(clipfrac_BT),
            "ppo_kl": agg((mb["old_logp"] - mb["logp"]).detach()),  # k1 estimate of KL(old || policy)
            "entropy": entropy.detach(),
        }
        if cfg.eps_clip_c is not None:
            metrics["pg_clipfrac_lower"] = agg(dual_clipfrac_BT)
        if self.needs_ref:
            if "ref_logp" not in mb:
                raise KeyError(
                    "algo.use_kl_loss or algo.use_kl_in_reward is set but the micro-batch has no 'ref_logp'"
                )
            # with KL in the reward this is only watched: how far the policy has moved from the reference
            kind = cfg.kl_loss_type if cfg.use_kl_loss else cfg.kl_in_reward_type
            kl = agg(kl_estimate(mb["logp"], mb["ref_logp"], kind))
            if cfg.use_kl_loss:
                loss = loss + cfg.kl_loss_coef * kl
            metrics["kl"] = kl.detach()
        metrics["loss"] = loss.detach()
        return loss, metrics


def contiguous_groups(samples: list[Sample]) -> list[list[int]]:
    """Indices of runs of equal `group`; a group split across runs is an error, because
    normalising its halves separately would silently give wrong advantages."""
    groups: list[list[int]] = []
    seen: set[int] = set()
    for i, sample in enumerate(samples):
        if groups and samples[groups[-1][0]].group == sample.group:
            groups[-1].append(i)
            continue
        if sample.group in seen:
            raise ValueError(
                f"group {sample.group} is not contiguous; samples must be ordered by (group, index)"
            )
        seen.add(sample.group)
        groups.append([i])
    return groups


def sample_reward(sample: Sample) -> float:
    if sample.reward is None:
        raise ValueError(
            f"sample (group={sample.group}, index={sample.index}) has no reward; "
            "every sample must be rewarded (or filtered out) before advantages"
        )
    return float(sample.reward)


def loss_mask(sample: Sample) -> torch.Tensor:
    """The sample's loss mask as float64 0/1 [response_len] (all ones when it has none)."""
    return torch.tensor(sample.loss_mask or [1] * sample.response_len, dtype=torch.float64)


def flat_loss_mask(samples: list[Sample], dtype: torch.dtype = torch.bool) -> torch.Tensor:
    """Every sample's loss mask (all ones where it has none), end to end: [sum of response_len]."""
    return flat_tensor((s.loss_mask or [1] * s.response_len for s in samples), dtype)


def batch_loss_masks(samples: list[Sample]) -> list[torch.Tensor]:
    """`loss_mask` of every sample (views of one tensor, made in one conversion)."""
    return list(flat_loss_mask(samples, torch.float64).split([s.response_len for s in samples]))


def per_sample_sums(values: list[torch.Tensor]) -> torch.Tensor:
    """[len(values)]: the sum of each tensor (0 for an empty one), in one reduction."""
    lengths = torch.tensor([v.shape[0] for v in values], dtype=torch.long)
    return torch.segment_reduce(torch.cat(values), "sum", lengths=lengths, unsafe=True)


def padded_rows(values: list[torch.Tensor], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """[len(values), longest]: the 1-d tensors as rows, right-padded with 0 (the estimators' scans
    run over the columns of a whole batch)."""
    width = max((v.shape[0] for v in values), default=0)
    return pad_2d(values, width, dtype)


def unpadded_rows(values_BT: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """Row b of `values_BT` cut to `lengths[b]` (views of one tensor of the rows end to end, made
    in one masked read), the inverse of `padded_rows`."""
    lengths_B = torch.tensor(lengths, dtype=torch.long)
    keep_BT = torch.arange(values_BT.shape[1]) < lengths_B.unsqueeze(1)
    return list(values_BT[keep_BT].split(lengths))


def _masked_mean(values: list[torch.Tensor], masks: list[torch.Tensor]) -> float:
    if not values:
        return 0.0
    mask = torch.cat(masks)
    return float((torch.cat(values) * mask).sum()) / max(float(mask.sum()), 1.0)


def _whiten_over_loss_tokens(advs: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Whiten with the mean and std of the loss tokens of the whole batch (every token moves
    alike; those outside the mask never reach the loss)."""
    if not advs:
        return advs
    adv = torch.cat(advs)
    adv_K = adv[torch.cat(masks).bool()]
    if adv_K.numel() == 0:
        return advs
    mean, rstd = whitening_stats(adv_K)
    return list(((adv - mean) * rstd).split([a.shape[0] for a in advs]))
