"""Advantage, KL and policy-loss building blocks as pure tensor functions.

Every algorithm (GRPO, GSPO, PPO, REINFORCE++) and PPO's critic compose these; none of them
touches a model, a config tree or a process group, so each is tested on hand-computed numbers.
A lone `T` is one response's tokens; the estimators (returns, GAE) take a batch of responses
right-padded to `_BT`, or one response.

Shape legend (suffixes on tensor names):
    B  samples in a micro-batch
    T  response tokens (right-padded to the longest response of the micro-batch)
    G  prompt groups
    N  samples per group (rollout.n_samples_per_prompt)
    K  loss tokens of a whole rollout batch, concatenated (batch whitening)

Token-level tensors cover response tokens only. `mask_BT` is float 0/1 and marks the tokens
that count in the loss. Masked-out values never reach a result (even inf), but callers should
fill padding with finite numbers (0) so that no NaN can appear in the backward pass.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from rlx.algo.options import LOSS_AGGREGATIONS, LossAgg

# exp() of a log-ratio beyond this overflows float32 soon after; clamping before exp keeps
# both the value and the backward pass finite (verl clamps at the same bound).
MAX_LOG_RATIO = 20.0
# low_var_kl's per-token bound, as in verl and slime: one wild token cannot dominate the KL.
LOW_VAR_KL_BOUND = 10.0


def group_normalized_advantages(
    rewards_GN: torch.Tensor, normalize_std: bool, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO's outcome advantage: each reward minus its group's mean, optionally over its std.

    The std is the unbiased (Bessel-corrected, N - 1) sample std, i.e. `torch.std`'s default,
    because that is what the GRPO reference systems compute (verl, slime, TRL all call
    `torch.std`); using it keeps rlx's advantages number-for-number comparable with theirs.
    (The population std would scale every advantage by sqrt(N / (N - 1)).)

    `eps` is added to the std, not max'ed with it, as those systems do: a group whose rewards
    are all equal is centred to exact zeros, and 0 / eps stays 0 instead of NaN. A group of one
    sample has no defined std; its centred reward is already 0, so it is left undivided.
    With `normalize_std=False` this is Dr. GRPO's mean-centred advantage.
    """
    if not rewards_GN.is_floating_point():
        rewards_GN = rewards_GN.float()
    centred_GN = rewards_GN - rewards_GN.mean(dim=1, keepdim=True)
    if not normalize_std or rewards_GN.shape[1] < 2:
        return centred_GN
    std_G1 = rewards_GN.std(dim=1, keepdim=True, correction=1)
    return centred_GN / (std_G1 + eps)


def outcome_token_rewards(
    reward: float, mask_T: torch.Tensor, kl_penalty_T: torch.Tensor | None
) -> torch.Tensor:
    """One response's per-token rewards: the outcome `reward` on its last loss token, minus the
    per-token KL penalty (`kl_penalty_T`, e.g. kl_in_reward_coef * kl, or None) on every loss token.

    This is OpenRLHF's `compute_reward` and verl's `apply_kl_penalty`: the reward arrives
    when the policy's last action is taken; tokens outside the loss mask (tool output) are no
    action of the policy and get nothing. With no loss token the reward sits on the last token.
    """
    penalties = None if kl_penalty_T is None else [kl_penalty_T]
    return batch_outcome_token_rewards([reward], [mask_T], penalties)[0]


def batch_outcome_token_rewards(
    rewards: list[float], masks: list[torch.Tensor], kl_penalties: list[torch.Tensor] | None
) -> list[torch.Tensor]:
    """`outcome_token_rewards` of every response of a batch (float64 [len(mask)] each, views of
    one tensor), in a few whole-batch ops: a rollout batch has a thousand responses."""
    lengths = torch.tensor([mask_T.shape[0] for mask_T in masks], dtype=torch.long)
    mask_K = torch.cat(masks).bool() if masks else torch.zeros(0, dtype=torch.bool)
    rewards_K = torch.zeros(mask_K.shape[0], dtype=torch.float64)
    if kl_penalties is not None:
        rewards_K -= torch.where(mask_K, torch.cat(kl_penalties).double(), 0.0)
    sample_K = torch.repeat_interleave(torch.arange(len(masks)), lengths)
    loss_positions_K = torch.where(mask_K, torch.arange(mask_K.shape[0]), -1)
    last_loss = torch.full((len(masks),), -1).scatter_reduce(0, sample_K, loss_positions_K, "amax")
    last = torch.where(last_loss >= 0, last_loss, lengths.cumsum(0) - 1)  # no loss token: the last token
    has_tokens = lengths > 0  # an empty response has nowhere to put its reward
    rewards_K.index_add_(0, last[has_tokens], torch.tensor(rewards, dtype=torch.float64)[has_tokens])
    return list(rewards_K.split(lengths.tolist()))


def discounted_returns(rewards_BT: torch.Tensor, gamma: float) -> torch.Tensor:
    """REINFORCE's reward-to-go per token: G_t = r_t + gamma * G_{t+1}, G after the last token 0.

    Every response token is a step, masked ones too (they carry no reward but still discount),
    as in OpenRLHF's `get_cumulative_returns`. Rows are responses right-padded with zero rewards
    (padding after a response adds nothing to its returns); one response may come as [T]. The
    scan runs over the T columns, each step a whole-batch op, not over every token of every
    response: the same arithmetic, in the same order, per token (in numpy over the columns
    stored contiguously, `_columns`: torch's per-op overhead was most of the scan's time).
    """
    rows_TB = _columns(rewards_BT)
    returns_TB = np.empty_like(rows_TB)
    running_B = np.zeros(rows_TB.shape[1], dtype=rows_TB.dtype)
    for t in range(rows_TB.shape[0] - 1, -1, -1):
        running_B = rows_TB[t] + gamma * running_B
        returns_TB[t] = running_B
    return _rows(returns_TB, rewards_BT.shape)


def gae(
    rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's generalised advantage estimation (Schulman et al., 2016) over each response.

    The steps are the loss tokens: a token outside the mask (tool output) is no action of the
    policy, so a loss token bootstraps from the value of the next *loss* token, and the value
    after the last one is 0 (the episode ends there), as verl's `compute_gae_advantage_return`
    skips observation tokens:
        delta_t = r_t + gamma * V_next(t) - V_t
        A_t     = delta_t + gamma * lambd * A_next(t)
        R_t     = A_t + V_t                      (the critic's regression target)
    `values_BT[b, t]` is the critic's value of the state before token t. Rows are responses
    right-padded with mask 0 (one response may come as [T]); the scan runs over the T columns,
    whole-batch ops per column, in numpy as `discounted_returns`' (both in their common dtype,
    float64 from `padded_rows`). Returns `(adv_BT, returns_BT)`; both are 0 outside the mask
    (they never reach a loss).
    """
    shape = rewards_BT.shape
    dtype = torch.promote_types(rewards_BT.dtype, values_BT.dtype)
    rewards_TB, values_TB = _columns(rewards_BT.to(dtype)), _columns(values_BT.to(dtype))
    keep_TB = _columns(mask_BT.bool())
    adv_TB, returns_TB = np.zeros_like(rewards_TB), np.zeros_like(rewards_TB)
    next_value_B = next_adv_B = np.zeros(rewards_TB.shape[1], dtype=rewards_TB.dtype)
    for t in range(shape[-1] - 1, -1, -1):
        keep_B, value_B = keep_TB[t], values_TB[t]
        adv_B = rewards_TB[t] + gamma * next_value_B - value_B + gamma * lambd * next_adv_B
        next_adv_B = np.where(keep_B, adv_B, next_adv_B)
        next_value_B = np.where(keep_B, value_B, next_value_B)
        adv_TB[t] = np.where(keep_B, adv_B, 0.0)
        returns_TB[t] = np.where(keep_B, adv_B + value_B, 0.0)
    return _rows(adv_TB, shape), _rows(returns_TB, shape)


def _columns(x_BT: torch.Tensor) -> np.ndarray:
    """[T, B]: the columns of a host tensor of rows (or of one row) as contiguous numpy rows, which
    a scan over the columns reads one at a time."""
    return np.ascontiguousarray(x_BT.detach().reshape(-1, x_BT.shape[-1]).numpy().T)


def _rows(x_TB: np.ndarray, shape: torch.Size) -> torch.Tensor:
    """The inverse of `_columns`: a tensor of `shape`."""
    return torch.from_numpy(np.ascontiguousarray(x_TB.T)).view(shape)


def clipped_value_loss(
    values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor, value_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's clipped regression loss per token: max((V - R)^2, (V_clip - R)^2) / 2.

    V_clip = V_old + clip(V - V_old, -value_clip, value_clip) keeps one rollout's updates from
    moving a value far from the one its advantage was computed with (PPO2's `cliprange_value`,
    OpenRLHF's `value_clip`); taking the max makes the clip pessimistic, as the policy's is.
    `value_clip=None` is the plain squared error. Returns `(loss_BT, clipfrac_BT)`, the latter
    detached 0/1: 1.0 where the clipped term was chosen (the token has no gradient).
    """
    unclipped_BT = (values_BT - returns_BT).square()
    if value_clip is None:
        return 0.5 * unclipped_BT, torch.zeros_like(unclipped_BT).detach()
    clipped_values_BT = old_values_BT + (values_BT - old_values_BT).clamp(-value_clip, value_clip)
    clipped_BT = (clipped_values_BT - returns_BT).square()
    clipfrac_BT = (clipped_BT > unclipped_BT).to(values_BT.dtype).detach()
    return 0.5 * torch.maximum(unclipped_BT, clipped_BT), clipfrac_BT


def whitening_stats(values_K: torch.Tensor, eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """`(mean, rstd)` of K values (the loss tokens of a whole rollout batch), so that
    (x - mean) * rstd whitens them to mean 0 and std 1.

    The population std (divide by K), floored at sqrt(eps), as REINFORCE++'s reference code
    whitens (OpenRLHF: `var.clamp(min=1e-8).rsqrt()`); all-equal values whiten to zeros.
    """
    mean = values_K.mean()
    var = (values_K - mean).square().mean()
    return mean, var.clamp(min=eps).rsqrt()


def _kl_k1(log_ratio_BT: torch.Tensor) -> torch.Tensor:
    # log_ratio = ref - logp, so k1 = logp - ref
    return -log_ratio_BT


def _kl_k2(log_ratio_BT: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio_BT.square()


def _kl_k3(log_ratio_BT: torch.Tensor) -> torch.Tensor:
    return log_ratio_BT.exp() - log_ratio_BT - 1.0


def _kl_low_var(log_ratio_BT: torch.Tensor) -> torch.Tensor:
    log_ratio_BT = log_ratio_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return _kl_k3(log_ratio_BT).clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)


# Schulman's estimators of KL(policy || ref) from samples of the policy; r = ref / policy.
KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _kl_k1,  # logp - ref: unbiased, high variance, can be negative per token
    "k2": _kl_k2,  # 0.5 * (logp - ref)^2: biased, low variance, >= 0
    "k3": _kl_k3,  # r - log r - 1: unbiased, low variance, >= 0
    "low_var_kl": _kl_low_var,  # k3 clamped to [-10, 10] (verl / slime)
}


def kl_estimate(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) of the given `kind` (see KL_ESTIMATORS)."""
    try:
        estimator = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown KL estimator {kind!r}; expected one of {sorted(KL_ESTIMATORS)}") from None
    return estimator(ref_logp_BT - logp_BT)


def token_log_ratio(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor) -> torch.Tensor:
    """PPO's per-token log importance ratio, log(pi / pi_old) = logp - old_logp."""
    return logp_BT - old_logp_BT


def sequence_log_ratio(
    logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """GSPO's sequence-level log ratio, in its GSPO-token form (Zheng et al., 2025, eqs. 7 and 13).

    The value at every token of sample b is log s_b = mean over b's masked tokens of
    (logp - old_logp), the log of the geometric mean of its token ratios; the gradient at token
    t is that of logp[b, t] alone: log s_bt = sg[log s_b] + logp_bt - sg[logp_bt], as verl's
    `compute_policy_loss_gspo` computes it. Averaged per sample (`sample_mean`) and with one
    advantage per sample this is exactly GSPO's gradient, s_b * mean_t grad logp_bt. A sample
    with no masked token gets log ratio 0 (its tokens count nowhere anyway).
    """
    diff_BT = torch.where(mask_BT.bool(), logp_BT - old_logp_BT, torch.zeros_like(logp_BT))
    seq_log_ratio_B1 = diff_BT.sum(dim=1, keepdim=True) / mask_BT.sum(dim=1, keepdim=True).clamp(min=1)
    return seq_log_ratio_B1.detach() + logp_BT - logp_BT.detach()


def clipped_policy_loss(
    log_ratio_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token: -min(r * A, clip(r, 1 - eps, 1 + eps_high) * A).

    r = exp(log_ratio) (token-level for PPO/GRPO, sequence-level for GSPO). `eps_clip_high`
    (None: `eps_clip`) widens only the upper bound, DAPO's clip-higher, so low-probability
    tokens with positive advantage can still grow. `eps_clip_c` (None: off) is dual-clip PPO
    (Ye et al., 2020; verl's `clip_ratio_c`, slime's `--eps-clip-c`): where A < 0 the loss is
    capped at c * |A|, so a token whose ratio has run far above 1 cannot push a huge update.

    Returns `(loss_BT, clipfrac_BT, dual_clipfrac_BT)`, the last two detached 0/1:
      loss_BT           differentiable w.r.t. `log_ratio_BT`;
      clipfrac_BT       1.0 where the clipped term was chosen (so the token has no gradient);
      dual_clipfrac_BT  1.0 where the dual-clip cap was chosen (always 0 when it is off).
    """
    if eps_clip_high is None:
        eps_clip_high = eps_clip
    ratio_BT = log_ratio_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    unclipped_BT = -ratio_BT * adv_BT
    clipped_BT = -ratio_BT.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * adv_BT
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    # strictly greater: at the clip boundary both terms agree and the gradient is still live
    clipfrac_BT = (clipped_BT > unclipped_BT).to(ratio_BT.dtype).detach()
    dual_clipfrac_BT = torch.zeros_like(clipfrac_BT)
    if eps_clip_c is not None:
        cap_BT = -eps_clip_c * adv_BT
        dual_BT = (adv_BT < 0) & (loss_BT > cap_BT)
        loss_BT = torch.where(dual_BT, cap_BT, loss_BT)
        dual_clipfrac_BT = dual_BT.to(ratio_BT.dtype).detach()
    return loss_BT, clipfrac_BT, dual_clipfrac_BT


def truncated_is_weight(
    old_logp_BT: torch.Tensor,
    rollout_logp_BT: torch.Tensor,
    tis_clip: float,
    mask_BT: torch.Tensor | None = None,
    level: str = "token",
    mode: str = "truncate",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weight of the trainer's old (proximal) policy against the policy that sampled
    the tokens, the rollout engine's: exp(old_logp - rollout_logp), capped at `tis_clip`.

    Synchronous, it corrects the engine's numerics differing from the trainer's (Yao et al.,
    2025; slime's `--use-tis`, verl's `tis_imp_ratio_cap`). Asynchronous, the engine's weights
    are older than the trainer's, and the same weight on PPO's ratio against the recomputed
    `old_logp` is AReaL's decoupled objective (Fu et al., 2025): clip against the proximal
    policy, correct the behaviour policy's samples by importance weighting.

    `level`: "token" weighs each token by its own ratio; "sequence" by the product over the
    sample's loss tokens (unbiased for a sequence-level reward, high variance); "geometric" by
    their geometric mean, exp(mean log ratio). The sequence levels need `mask_BT`.
    `mode`: "truncate" caps the weight at `tis_clip` (TIS); "mask" keeps it uncapped where it is
    within the cap and zeroes it (the token or sample leaves the loss) where it is above
    (AReaL's `behav_imp_weight_cap`, verl's masked IS). Returns `(weight_BT, capped_BT)`, both
    detached; `capped_BT` is 1.0 where the cap was hit.
    """
    log_w_BT = (old_logp_BT - rollout_logp_BT).detach()
    if level != "token":
        if mask_BT is None:
            raise ValueError(f"tis level {level!r} needs the loss mask")
        log_w_B = (log_w_BT * mask_BT).sum(dim=1)
        if level == "geometric":
            log_w_B = log_w_B / mask_BT.sum(dim=1).clamp(min=1)
        log_w_BT = log_w_B[:, None].expand_as(log_w_BT)
    raw_BT = log_w_BT.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO).exp()
    capped_BT = (raw_BT > tis_clip).to(raw_BT.dtype)
    if mode == "mask":
        return raw_BT * (1.0 - capped_BT), capped_BT
    return raw_BT.clamp(max=tis_clip), capped_BT


def aggregate(
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: LossAgg | str,
    num_global_tokens: int,
    num_global_samples: int,
    norm_len: int | None = None,
) -> torch.Tensor:
    """Reduce per-token values of one micro-batch to a scalar, normalised by GLOBAL counts.

    Dividing by the counts of the whole global batch (not this micro-batch's) makes the sum
    over micro-batches equal the value on the global batch, so the trainer just accumulates
    gradients and metrics, however the batch was split and padded.

    token_mean:  sum of masked values / `num_global_tokens` (masked tokens in the global batch);
                 every token weighs the same, so long responses weigh more (DAPO).
    sample_mean: each sample's mean over its own masked tokens, summed, / `num_global_samples`
                 (samples in the global batch); every sample weighs the same (original GRPO).
                 A sample with no masked token contributes 0 but still counts as a sample.
    seq_mean_token_sum_norm: each sample's sum over its masked tokens divided by one constant,
                 `norm_len` (the maximum response length), summed, / `num_global_samples`:
                 Dr. GRPO's loss (Liu et al., 2025), which removes the per-sample 1/|o_i|
                 length bias of sample_mean; verl's "seq-mean-token-sum-norm".
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; expected one of {LOSS_AGGREGATIONS}")
    # where(), not a product: padding may hold inf/NaN, and inf * 0 is NaN
    masked_BT = torch.where(mask_BT.bool(), values_BT, torch.zeros_like(values_BT))
    if mode == "token_mean":
        if num_global_tokens <= 0:
            raise ValueError(f"num_global_tokens must be positive, got {num_global_tokens}")
        return masked_BT.sum() / num_global_tokens
    if num_global_samples <= 0:
        raise ValueError(f"num_global_samples must be positive, got {num_global_samples}")
    if mode == "seq_mean_token_sum_norm":
        if norm_len is None or norm_len <= 0:
            raise ValueError(f"seq_mean_token_sum_norm needs a positive norm_len, got {norm_len}")
        return masked_BT.sum() / norm_len / num_global_samples
    num_tokens_B = mask_BT.sum(dim=1).clamp(min=1)
    return (masked_BT.sum(dim=1) / num_tokens_B).sum() / num_global_samples
