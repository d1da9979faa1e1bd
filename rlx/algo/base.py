"""The `Algorithm` seam: advantages from rewarded samples, a loss from a micro-batch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from rlx.algo.config import AlgoConfig
from rlx.sample import Sample


@dataclass
class Advantages:
    """What `Algorithm.advantages` computes for one rollout batch, one entry per sample in batch order."""

    advantages: list[torch.Tensor]  # float32 [response_len] per sample
    # The critic's regression targets (float32 [response_len] per sample) when the algorithm
    # `needs_critic`; None otherwise.
    returns: list[torch.Tensor] | None = None
    # Statistics the trainer's own advantage statistics cannot see, e.g. "return_mean" (mean
    # per-sample return before normalisation), "kl_in_reward"; logged as `train/<key>`.
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Algorithm(Protocol):
    """Advantage estimator + policy loss + KL terms; pure tensor code, no model, no processes.

    Built once per process as `Cls(cfg.algo)` with the class named by `cfg.algo._target_`
    (the config object, dataclass or DictConfig, is passed whole; its fields are read as
    attributes). An algorithm keeps no state between calls: everything it computes is returned.

    Contract:

    `advantages(samples, logprobs) -> Advantages`
        `samples` is a whole rollout batch ordered by (group, index): every group's samples
        are contiguous (normally `rollout.n_samples_per_prompt` of them). Every sample must
        have a `reward`; a `None` reward raises `ValueError` naming the sample. `logprobs`
        maps "old_logp" (unless `needs_old_logp` is False), "ref_logp" (when `needs_ref`) and
        "values" (when `needs_critic`: the critic's value of the state before each response
        token) to one [response_len] tensor per sample, computed by the trainer before any
        update of this rollout, for estimators that shape rewards with them (KL in the reward)
        or bootstrap from the critic (GAE). Returns one float32 advantage tensor of shape
        [sample.response_len] per sample, in the same order (for every response token; the
        trainer applies `loss_mask`), the critic's targets when `needs_critic`, and metrics.

    `loss(mb, num_global_tokens, num_global_samples) -> (loss, metrics)`
        `mb` holds right-padded [B, T] tensors over response tokens of one micro-batch:
            "logp"      current policy log-probs (requires grad)
            "old_logp"  log-probs of the policy that started this rollout's updates (no grad)
            "ref_logp"  reference-model log-probs; present when `needs_ref`, else may be absent
            "rollout_logp" the rollout engine's log-probs of the same tokens (no grad)
            "adv"       advantages
            "mask"      float 0/1: tokens that count (loss mask and padding)
            "entropy"   per-token entropy of the current policy
        `num_global_tokens` is the number of masked tokens and `num_global_samples` the number
        of samples of the whole global batch (all micro-batches of one optimizer step; the
        trainer carries both in each micro-batch). The returned scalar is this micro-batch's
        share of the global-batch loss, so the trainer calls backward on each and sums
        gradients, with no rescaling. Total loss is
            pg_loss + kl_loss_coef * kl - entropy_coef * entropy
        `metrics` are detached scalars normalised the same way (summing over micro-batches
        gives the batch value): "pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "loss", "kl"
        when `needs_ref` (KL(policy || ref), whether or not it is in the loss),
        "pg_clipfrac_lower" with dual clip, "tis_weight_mean" and "tis_clipfrac" with TIS.

    `needs_ref`
        True when the loss or the advantages need "ref_logp", so the trainer computes it.

    `needs_critic`
        True when the algorithm learns a value model (PPO): the trainer then builds a critic
        (the policy's family and weights, a fresh scalar head; `algo.critic_lr`,
        `algo.value_clip`, `algo.critic_warmup_steps`), passes its "values" to `advantages`,
        trains it on the returned `returns`, and holds the policy during the critic's warm-up.

    `needs_old_logp` (optional; True when absent)
        False when `advantages` never reads "old_logp": the trainer may then take the old
        policy's log-probs in `loss` from the training pass itself (`train.old_logprobs=auto`),
        instead of a forward-only pass over the batch first.

    Class-level hooks, read by `rlx.config.validate` before anything starts (both optional):
    `config_errors(cfg: AlgoConfig) -> list[str]`, a classmethod returning one message per
    broken rule of the algorithm's own options, each naming its keys and the fix; and
    `min_group_size: int`, the samples per prompt it needs (default 2).
    """

    def __init__(self, cfg: AlgoConfig) -> None: ...

    def advantages(self, samples: list[Sample], logprobs: dict[str, list[torch.Tensor]]) -> Advantages:
        """Per-token advantages (and the critic's targets), one entry per sample."""
        ...

    def loss(
        self, mb: dict[str, torch.Tensor], num_global_tokens: int, num_global_samples: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """This micro-batch's globally normalised loss and detached metrics."""
        ...

    @property
    def needs_ref(self) -> bool:
        """Whether `advantages` or `loss` read "ref_logp"."""
        ...

    @property
    def needs_critic(self) -> bool:
        """Whether the trainer builds and trains a value model for `advantages`."""
        ...
