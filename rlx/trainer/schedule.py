"""The learning-rate schedule: linear warmup, then constant or cosine decay to `train.min_lr`.

Written here rather than taken from megatron's `OptimizerParamScheduler` because that one
starts warmup at lr 0 (the first optimizer step would be wasted) and ties decay to its own
iteration bookkeeping; this is a pure function of the optimizer step, tested by hand.
"""

from __future__ import annotations

import math

from rlx.trainer.config import TrainConfig


def lr_factor(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """The learning rate of optimizer step `step` (from 0) as a fraction of the peak `cfg.lr`.

    Warmup: step k < lr_warmup_steps uses (k + 1) / lr_warmup_steps (the last warmup step
    reaches the peak). Then `constant` stays at 1; `cosine` falls from 1 at the end of warmup
    to min_lr / lr at `total_steps - 1` (the run's last optimizer step), and stays there.
    """
    warmup = cfg.lr_warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if cfg.lr_decay == "constant":
        return 1.0
    floor = cfg.min_lr / cfg.lr
    decay_steps = max(total_steps - 1 - warmup, 1)
    progress = min((step - warmup) / decay_steps, 1.0)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
