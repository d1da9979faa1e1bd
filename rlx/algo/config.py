"""The `algo` config group's schema, shared by every algorithm.

Each `conf/algo/<name>.yaml` is a thin file over this schema: it names its class with
`_target_` and sets only the values where its paper differs from these defaults. Rules that
tie fields together (KL in the loss or in the reward, not both; dual clip > 1; ...) are the
algorithm classes' `config_errors`, run by `rlx.config.validate` at compose time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rlx.algo.options import KL_ESTIMATOR_NAMES, LOSS_AGGREGATIONS, TIS_LEVELS, TIS_MODES
from rlx.config.rules import AT_LEAST_1, NON_NEGATIVE, POSITIVE, UNIT, Rule, one_of


@dataclass
class AlgoConfig:
    """Advantage estimator, policy-loss and (PPO) critic options."""

    _target_: str = "rlx.algo.grpo.GRPO"  # the algorithm class
    # --- advantages ---
    normalize_std: bool = True  # GRPO/GSPO: divide group-centred rewards by the group std (False: Dr.GRPO)
    gamma: float = 1.0  # REINFORCE++ and PPO's GAE: discount of the token-level returns, in [0, 1]
    # whiten advantages over the batch: (adv - mean) / std over every loss token of the rollout batch
    whiten_advantages: bool = False
    # KL(old policy || reference) as a per-token reward penalty, before advantages (REINFORCE++, verl's
    # use_kl_in_reward); mutually exclusive with use_kl_loss
    use_kl_in_reward: bool = False
    kl_in_reward_coef: float = 0.0  # the penalty is -kl_in_reward_coef * kl on every loss token
    kl_in_reward_type: str = "k1"  # a KL estimator: k1 | k2 | k3 | low_var_kl
    # --- policy loss ---
    eps_clip: float = 0.2  # lower clip range of the importance ratio: 1 - eps_clip
    eps_clip_high: float | None = None  # upper clip range: 1 + eps_clip_high (None: eps_clip)
    eps_clip_c: float | None = None  # dual clip, > 1: the loss of a negative advantage is at most c*|A|
    use_kl_loss: bool = False  # add kl_loss_coef * KL(policy || reference) to the loss
    kl_loss_coef: float = 0.0  # weight of the KL loss term
    kl_loss_type: str = "low_var_kl"  # a KL estimator: k1 | k2 | k3 | low_var_kl
    entropy_coef: float = 0.0  # entropy bonus (subtracted from the loss)
    # token_mean: over all tokens of the batch; sample_mean: per sample first;
    # seq_mean_token_sum_norm: Dr. GRPO's, each sample's token sum / loss_norm_len (rlx.algo.losses.aggregate)
    loss_agg: str = "token_mean"
    # seq_mean_token_sum_norm's constant divisor: the maximum response length (conf/config.yaml sets
    # ${rollout.max_response_len}); read only by that aggregation
    loss_norm_len: int | None = None
    # Truncated importance sampling: weight each token's policy loss by min(exp(old_logp - rollout_logp),
    # tis_clip), detached, to correct for the rollout engine's numerics differing from the trainer's,
    # and in rollout.mode=async for its older weights (the decoupled PPO objective; see
    # rlx.algo.losses.truncated_is_weight). Needs the engine's log-probs; every rollout engine returns them.
    use_tis: bool = False
    tis_clip: float = 2.0  # upper bound of the TIS weight
    tis_level: str = "token"  # token | sequence (product over the sample) | geometric (its geometric mean)
    tis_mode: str = "truncate"  # truncate: cap the weight at tis_clip; mask: drop what exceeds it
    # --- PPO's critic (read only by algorithms with `needs_critic`) ---
    # GAE's lambda, in [0, 1]: 1 gives Monte-Carlo returns minus the value (unbiased, noisy),
    # 0 the one-step TD error (leans entirely on the critic); `gamma` above is GAE's discount
    lambd: float = 1.0
    critic_lr: float = 1e-3  # the critic's own Adam learning rate (its other optimizer settings are train.*)
    # clip each value to V_old +- value_clip in the value loss, so one rollout's critic updates stay
    # near the values its advantages were computed with (None: plain squared error)
    value_clip: float | None = 0.2
    critic_warmup_steps: int = 0  # first rollout steps on which only the critic trains (the policy waits)

    RULES: ClassVar[dict[str, Rule]] = {
        "kl_in_reward_type": one_of(KL_ESTIMATOR_NAMES),
        "kl_loss_type": one_of(KL_ESTIMATOR_NAMES),
        "loss_agg": one_of(LOSS_AGGREGATIONS),
        "loss_norm_len": AT_LEAST_1,
        "eps_clip": POSITIVE,
        "eps_clip_high": POSITIVE,
        "kl_loss_coef": NON_NEGATIVE,
        "kl_in_reward_coef": NON_NEGATIVE,
        "tis_clip": POSITIVE,
        "tis_level": one_of(TIS_LEVELS),
        "tis_mode": one_of(TIS_MODES),
        "gamma": UNIT,
        "lambd": UNIT,
        "critic_lr": POSITIVE,
        "value_clip": POSITIVE,
        "critic_warmup_steps": NON_NEGATIVE,
    }
