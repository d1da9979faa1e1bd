"""Keep Python's cyclic garbage collector off the objects a process made at start-up.

A full (oldest-generation) collection walks every tracked object: in a process that imported
torch, transformers, FastAPI and Ray and built a model, half a million of them or more, 0.15 s
a pass on the CPU machine and more on the GPU hosts. The rollout and training steps allocate
enough to trigger one every few steps, so a step now and then took 0.3-0.5 s longer (the
bimodal rollout times in docs/benchmarks.md). `gc.freeze()` moves everything alive now to a
permanent generation the collector skips; objects made later are collected as before, and
reference counting still frees frozen objects when their last reference goes. vLLM and SGLang
freeze their engine processes after start-up for the same reason.

A trainer rank or engine process kept for later runs (`rlx.actor_reuse`) is set up and shut down
again and again, and each full pass over its start-up objects costs 0.3-0.4 s of CPU. Its first
set-up freezes everything (`freeze_after_set_up`: the model and server with it, as in a process
that serves one run); its first shutdown lets go of them with one full pass and freezes what is
left, the process's own objects (imports, their lazy parts included); a later set-up's objects,
hundreds or thousands, stay with the collector, and its shutdown frees them in a pass over those
alone (`collect_after_shutdown`).
"""

from __future__ import annotations

import gc

# whether this process's last set-up froze its objects (True), left them to the collector
# (False), or none ran yet (None): freeze_after_set_up and collect_after_shutdown
_set_up_frozen: bool | None = None


def freeze_startup_objects(collect: bool = True) -> None:
    """Collect what is garbage now, then freeze the rest (earlier freezes are undone first, so
    a process set up a second time does not keep the first set-up's garbage).

    `collect=False` skips the collection (a full pass: 0.3 s or more in a big process) and
    freezes the garbage too, for a caller that calls `gc.unfreeze()` when it is done (the run
    in the driver: its garbage goes back to the collector then)."""
    gc.unfreeze()
    if collect:
        gc.collect()
    gc.freeze()


def freeze_after_set_up() -> None:
    """An actor process's set-up is done: the first in the process freezes everything
    (`freeze_startup_objects`); a later one, after `collect_after_shutdown` froze the process's
    own objects, leaves its own to the collector (no full pass)."""
    global _set_up_frozen
    if _set_up_frozen is None:
        freeze_startup_objects()
        _set_up_frozen = True


def collect_after_shutdown() -> None:
    """The set-up's objects are let go of: their cycles freed (a model's, a gloo group's, whose
    threads poll until it is), the rest of the process frozen. After the first set-up, whose
    objects were frozen with everything else, one full pass (unfreeze, collect, freeze); after a
    later one, a pass over the objects made since."""
    global _set_up_frozen
    if _set_up_frozen:
        freeze_startup_objects()
        _set_up_frozen = False
    else:
        gc.collect()


def in_ray_actor() -> bool:
    """Whether this code runs inside a Ray actor's own process (not a driver, not a test)."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
