"""GSPO: GRPO's group-normalised advantages with a sequence-level importance ratio.

Shape legend: B samples in a micro-batch, T response tokens.
"""

from __future__ import annotations

import torch

from rlx.algo.config import AlgoConfig
from rlx.algo.grpo import GRPO
from rlx.algo.losses import sequence_log_ratio


class GSPO(GRPO):
    """Group Sequence Policy Optimization (Zheng et al., 2025, arXiv:2507.18071).

    The importance ratio of a response is the geometric mean of its token ratios,
    s = exp(mean over its loss tokens of (logp - old_logp)), clipped as a whole, so one
    response is either inside the trust region or not (no token-level noise from
    per-token ratios). Its clip range is much narrower than PPO's because s averages token
    log-ratios: the paper uses eps_clip 3e-4, eps_clip_high 4e-4 (conf/algo/gspo.yaml).

    The ratio is computed in the GSPO-token form, as verl's `compute_policy_loss_gspo` does,
    and the loss is averaged per sample first (`loss_agg=sample_mean`, verl's
    "seq-mean-token-mean"), which is GSPO's objective: (1/G) sum_i min(s_i A_i, clip(s_i) A_i).
    Every GRPO option (std normalisation, KL, entropy, dual clip, TIS) applies unchanged.
    """

    @classmethod
    def config_errors(cls, cfg: AlgoConfig) -> list[str]:
        errors = super().config_errors(cfg)
        if cfg.loss_agg != "sample_mean":
            errors.append(
                f"algo.loss_agg={cfg.loss_agg!r}: GSPO's objective weighs every response equally "
                "(its sequence ratio is per response, so token_mean would weigh long responses more); "
                "set algo.loss_agg=sample_mean"
            )
        return errors

    def log_ratio(self, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        return sequence_log_ratio(mb["logp"], mb["old_logp"], mb["mask"])
