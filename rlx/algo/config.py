"""The `algo` config group's schema, shared by every algorithm."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AlgoConfig:
    """Advantage estimator and policy-loss options."""

    _target_: str = "rlx.algo.grpo.GRPO"  # the algorithm class
    normalize_std: bool = True  # GRPO: divide group-centred rewards by the group std (False: Dr.GRPO)
    eps_clip: float = 0.2  # lower clip range of the importance ratio: 1 - eps_clip
    eps_clip_high: float | None = None  # upper clip range: 1 + eps_clip_high (None: eps_clip)
    use_kl_loss: bool = False  # add kl_loss_coef * KL(policy || reference) to the loss
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"  # k1 | k2 | k3 | low_var_kl
    entropy_coef: float = 0.0  # entropy bonus (subtracted from the loss)
    loss_agg: str = "token_mean"  # token_mean: over all tokens of the batch; sample_mean: per sample first
