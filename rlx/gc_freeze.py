"""Keep Python's cyclic garbage collector off the objects a process made at start-up.

A full (oldest-generation) collection walks every tracked object: in a process that imported
torch, transformers, FastAPI and Ray and built a model, half a million of them or more, 0.15 s
a pass on the CPU machine and more on the GPU hosts. The rollout and training steps allocate
enough to trigger one every few steps, so a step now and then took 0.3-0.5 s longer (the
bimodal rollout times in docs/benchmarks.md). `gc.freeze()` moves everything alive now to a
permanent generation the collector skips; objects made later are collected as before, and
reference counting still frees frozen objects when their last reference goes. vLLM and SGLang
freeze their engine processes after start-up for the same reason.
"""

from __future__ import annotations

import gc


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


def in_ray_actor() -> bool:
    """Whether this code runs inside a Ray actor's own process (not a driver, not a test)."""
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
