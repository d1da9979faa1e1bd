"""Turns on colocated GPUs: the engines hold the memory while they generate, the trainer while it
trains, and the new weights cross over in between. With split placement every turn is free.

One step, colocated (slime's order):
    generate                     engines hold weights + KV cache; trainer offloaded to CPU
    to_trainer()                 engines release everything, trainer onloads
    train
    publish(sync, version)       engines resume their weights, receive the new ones, the trainer
                                 offloads, engines resume their KV cache
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the driver imports Megatron (seconds) only once a trainer starts
    from rlx.rollout.pool import RolloutPool
    from rlx.trainer.group import TrainerGroup


class GpuTurns:
    """Alternates a colocated trainer and its engines on the same GPUs (no-ops when split)."""

    def __init__(self, colocated: bool, trainer: TrainerGroup):
        self.colocated, self.trainer = colocated, trainer
        self.pool: RolloutPool | None = None

    def before_engines_start(self) -> dict[str, float]:
        """The trainer leaves the GPU before the engines allocate their weights and KV cache."""
        return self.trainer.offload() if self.colocated else {}

    def to_trainer(self) -> dict[str, float]:
        """The engines free their GPU memory and the trainer takes it back; memory figures."""
        if not self.colocated:
            return {}
        start = time.perf_counter()
        self.pool.release_memory()
        metrics = self.trainer.onload()
        return metrics | {"time/colocate_to_trainer_s": time.perf_counter() - start}

    def publish(self, sync: Callable[[int], float], version: int) -> dict[str, float]:
        """The trainer's weights reach the engines as `version`; colocated, the GPU goes back to them."""
        if not self.colocated:
            return {"time/weight_sync_s": sync(version)}
        start = time.perf_counter()
        self.pool.resume_memory(["weights"])
        metrics = {"time/weight_sync_s": sync(version)}
        metrics |= self.trainer.offload()
        self.pool.resume_memory(["kv_cache"])
        return metrics | {"time/colocate_to_engines_s": time.perf_counter() - start}
