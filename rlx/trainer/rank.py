"""One trainer rank's Ray actor: a process that imports Megatron only when it sets up.

The driver creates the actor from this class, so its module imports nothing of Megatron (the
driver never loads megatron-core for a run: 3.4 s of CPU in every `launch.py` process); `setup`
imports `rlx.trainer.megatron` in the rank's own process and builds the `MegatronTrainer`, and
`call` runs one of its methods (`rlx.trainer.group.TrainerGroup` names them).
"""

from __future__ import annotations

import os
import time
from typing import Any

from rlx import ports, process_clock
from rlx.gc_freeze import collect_after_shutdown, freeze_after_set_up, in_ray_actor
from rlx.trainer.parallel import rendezvous_store

LOADED = time.time()  # this module, and torch with it, loaded: a rank's process is ready for its calls


class TrainerRank:
    """Started empty: the group first asks rank 0 where it runs (the rendezvous must be on rank 0's
    node, which only Ray knows), then `setup` builds the MegatronTrainer."""

    def __init__(self) -> None:  # the trainer is built by `setup`, once the rendezvous is known
        self.trainer = None
        self.runs = 0  # groups this process was set up for (a kept one: by earlier runs)

    def warm_up(self, kernels: str) -> dict[str, float | None]:
        """Before `setup`: import Megatron and rlx's trainer, and the modules of the kernel set
        `model.kernels=kernels` (liger's, on a GPU): 8-12 s of a rank's start on 1×H100, spent
        while the driver does what else it has to (a split run's engines start meanwhile).
        Returns when (seconds since the epoch) this process `started` (None where the kernel
        cannot say), when it had `loaded` this module (torch with it), `imports_s`, this call's
        time, and how many `runs` set it up before: the group's start-up log splits a rank's
        start with them."""
        began, started = time.perf_counter(), process_clock.started_at()
        import rlx.trainer.megatron  # noqa: F401
        from rlx.models.kernels import load_ahead

        load_ahead(kernels)
        imports_s = time.perf_counter() - began
        return {"started": started, "loaded": LOADED, "imports_s": imports_s, "runs": self.runs}

    def setup(self, *args, **kwargs) -> None:
        from rlx.trainer.megatron import MegatronTrainer

        # the store host_rendezvous made for this group (rank 0), taken: a rank process set up
        # again for another group (TrainerGroup.release) must not find an old one
        self.trainer = MegatronTrainer(*args, store=self.__dict__.pop("_store", None), **kwargs)
        self.runs += 1
        if in_ray_actor():  # Megatron, the models, the optimizer: out of the collector's way
            freeze_after_set_up()

    def call(self, method: str, *args) -> Any:
        """The trainer's `method(*args)`."""
        return getattr(self.trainer, method)(*args)

    def shutdown(self) -> None:
        """Leave the process groups, then let go of the models, optimizers and what else holds
        them: a rank kept for another group (`rlx.actor_reuse.keep_actors`) idles without them
        (each gloo group's threads poll until the group is freed)."""
        if self.trainer is not None:
            self.trainer.shutdown()
        runs = self.runs
        self.__dict__.clear()
        self.trainer, self.runs = None, runs
        collect_after_shutdown()  # the set-up's objects freed (rlx.gc_freeze)

    def host_rendezvous(self) -> int:
        """Rank 0: start hosting the group's rendezvous on this node; its port."""
        self._store = rendezvous_store(ports.node_address())
        return self._store.port

    def endpoint(self) -> tuple[str, int]:
        """(this node's address, this process's id)."""
        return ports.node_address(), os.getpid()
