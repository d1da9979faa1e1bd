"""Turns on colocated GPUs: the engines hold the memory while they generate, the trainer while it
trains, and the new weights cross over in between. With split placement every turn is free.

One step, colocated (slime's order):
    generate                     engines hold weights + KV cache; trainer offloaded to CPU
    to_trainer()                 engines release everything, trainer onloads
    train
    publish(sync, version)       the trainer offloads all but its weights, engines resume their
                                 weights and receive the new ones, the trainer offloads its weights,
                                 engines resume their KV cache

The trainer's gradients and optimizer state leave before the engines' weights come back: a 9B
model's (17.5 + 26 GiB a rank at TP=2 DP=2) beside the engine's weights would not fit an 80 GB GPU.
Where the memory plan fits both sides whole at once (`cluster.release_memory` false: the trainer's
training peak beside the engines' weights and KV caches), there are no turns: nothing is released
or moved, and a step's hand-over is the weight sync alone.
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

    def __init__(
        self,
        colocated: bool,
        trainer: TrainerGroup,
        offload_trainer: bool = True,
        release_memory: bool = True,
    ):
        # colocated with `release_memory` False (the trainer's state kept): both sides stay whole, no turns
        self.colocated, self.trainer = colocated, trainer
        self.turns = colocated and bool(offload_trainer or release_memory)
        self.offload_trainer = offload_trainer  # False: its weights and optimizer state stay on the GPU
        self.pool: RolloutPool | None = None

    def before_engines_start(self) -> dict[str, float]:
        """The trainer leaves the GPU before the engines allocate their weights and KV cache."""
        return self.trainer.offload(self.offload_trainer) if self.turns else {}

    def to_trainer(self) -> dict[str, float]:
        """The engines free their GPU memory and the trainer takes it back; memory figures."""
        if not self.turns:
            return {}
        clock = _Clock()
        self.pool.release_memory()
        clock.lap("engines_release")
        metrics = self.trainer.onload()
        clock.lap("trainer_onload")
        return metrics | clock.metrics("to_trainer")

    def publish(self, sync: Callable[[int], float], version: int) -> dict[str, float]:
        """The trainer's weights reach the engines as `version`; colocated, the GPU goes back to them."""
        if not self.turns:
            return {"time/weight_sync_s": sync(version)}
        clock = _Clock()
        self.trainer.offload(self.offload_trainer, keep_params=True)
        clock.lap("trainer_offload_state")
        self.pool.resume_memory(["weights"])
        clock.lap("engines_resume_weights")
        metrics = {"time/weight_sync_s": sync(version)}
        clock.lap(None)  # reported as time/weight_sync_s
        metrics |= self.trainer.offload(self.offload_trainer)
        clock.lap("trainer_offload")
        self.pool.resume_memory(["kv_cache"])
        clock.lap("engines_resume_kv_cache")
        return metrics | clock.metrics("to_engines")


class _Clock:
    """Seconds of each part of a hand-over (`time/colocate/<part>_s`) and of the whole one."""

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.parts: dict[str, float] = {}

    def lap(self, part: str | None) -> None:
        now = time.perf_counter()
        if part is not None:
            self.parts[f"time/colocate/{part}_s"] = now - self.last
        self.last = now

    def metrics(self, turn: str) -> dict[str, float]:
        return self.parts | {f"time/colocate_{turn}_s": self.last - self.start}
