"""megatron-core's method caches that outlive the model they were filled for.

`RotaryEmbedding.forward` (and the YaRN variant's) is wrapped in a class-level
`functools.lru_cache` (32 entries) whose key holds the rotary module itself: every model's
rotary module and the angle tensors it returned ([seq, 1, 1, dim], on the model's device) stay
alive after the model is let go, until 32 newer calls push them out. `clear()` empties those
caches; `rlx.trainer.parallel.destroy_distributed` calls it, so a process that tears megatron down
(a trainer rank kept for another run, `rlx.actor_reuse`; a test process between models) keeps no
GPU memory for a model it dropped.
"""

from __future__ import annotations

import importlib
import inspect

MODULES = (  # the modules whose classes cache `forward`
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
)


def cached_forwards() -> list:
    """The lru-cached `forward` functions of MODULES' classes (a subclass that inherits one shares it)."""
    found = []
    for name in MODULES:
        for _, cls in inspect.getmembers(importlib.import_module(name), inspect.isclass):
            forward = cls.__dict__.get("forward")
            if hasattr(forward, "cache_clear") and forward not in found:
                found.append(forward)
    return found


def clear() -> None:
    """Empty megatron's rotary-embedding caches (no-op where nothing was cached)."""
    for forward in cached_forwards():
        forward.cache_clear()
