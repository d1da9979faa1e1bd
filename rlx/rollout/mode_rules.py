"""Compose-time rules of how batches are produced (`rollout.mode`, staleness, over-sampling),
between themselves and with the placement and the algorithm; read by `rlx.config.validate`."""

from __future__ import annotations

from rlx.rollout.config import RolloutConfig


def mode_errors(rollout: RolloutConfig, colocate: bool, use_tis: bool) -> list[str]:
    """Rules tying rollout.mode, staleness, over-sampling to each other and to the placement and the
    algorithm (called by rlx.config.validate), each naming its keys and the fix."""
    errors = []
    if rollout.mode == "async" and colocate:
        errors.append(
            "rollout.mode=async with cluster.colocate=true: colocated engines and trainer take turns on the "
            "same GPUs, so generation cannot overlap training; set cluster.colocate=false (split GPUs) or "
            "rollout.mode=sync"
        )
    if rollout.mode == "async" and rollout.max_staleness < rollout.update_weights_interval - 1:
        errors.append(
            f"rollout.max_staleness={rollout.max_staleness} < rollout.update_weights_interval - 1 = "
            f"{rollout.update_weights_interval - 1}: weights reach the engines only every "
            f"{rollout.update_weights_interval} steps, so samples are that stale anyway; raise "
            "rollout.max_staleness or lower rollout.update_weights_interval"
        )
    # at max_staleness 0 every trained sample comes from the weights being trained: on-policy
    stale = rollout.mode == "async" and rollout.max_staleness > 0
    if stale and not use_tis and not rollout.allow_uncorrected_async:
        errors.append(
            f"rollout.mode=async with rollout.max_staleness={rollout.max_staleness} trains on samples from "
            "older policies and the policy loss has no off-policy correction (PPO-family clipping alone "
            "collapses as staleness grows); set algo.use_tis=true (the decoupled objective: ratio against the "
            "trainer's proximal policy, truncated importance weight against the engines' log-probs), "
            "rollout.max_staleness=0 (on-policy), or rollout.allow_uncorrected_async=true to run anyway"
        )
    if rollout.over_sampling_batch_size is not None and rollout.over_sampling_batch_size < rollout.batch_size:
        errors.append(
            f"rollout.over_sampling_batch_size={rollout.over_sampling_batch_size} < rollout.batch_size="
            f"{rollout.batch_size}: each round launches at least a batch; set it >= {rollout.batch_size} "
            "or null"
        )
    if rollout.partial_rollout and rollout.generate_fn:
        errors.append(
            f"rollout.partial_rollout=true with rollout.generate_fn={rollout.generate_fn!r}: a custom "
            "generation cannot be continued where an abort stopped it (it is restarted); set "
            "rollout.partial_rollout=false"
        )
    if rollout.mask_old_policy_tokens and not rollout.partial_rollout:
        errors.append(
            "rollout.mask_old_policy_tokens=true masks tokens a partial rollout carried over; set "
            "rollout.partial_rollout=true, or drop the option"
        )
    return errors
