"""Actor processes kept between the runs of one process (a test session, a notebook).

Within `keep_actors()`, a run that ends cleanly hands its trainer rank and engine processes back
instead of ending them, and a later run on the same Ray takes the ones started with the same Ray
options and sets them up again. A new process spends seconds of CPU on imports before it does
anything (a trainer rank 5.7 s, Megatron; an engine 6.3 s, torch, the HTTP stack and its model):
more than a short CPU run's whole work. Only processes placed without GPUs, placement groups or
an environment of their run's are kept, at most `MAX_KEPT` of each kind (an idle one costs about
1% of a core); those left over are ended when the block ends.

The kinds' own modules decide what "set up again" means: `rlx.trainer.rank` (TrainerRank.setup)
and `rlx.rollout.engines` (EngineActor.setup); tests check that a kept process then computes exactly
what a new one does (a CPU engine's one process-wide setting, torch's thread count, is set anew
from `rollout.engine_threads`, at least 1).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

MAX_KEPT = 4  # of each kind

# kind -> [(Ray node id, Ray options, actor)]; None outside `keep_actors`
_kept: dict[str, list[tuple[str, dict, Any]]] | None = None


@contextlib.contextmanager
def keep_actors() -> Iterator[None]:
    """Keep the clean-ending runs' trainer ranks and engines for the next runs within the block."""
    global _kept
    outer, _kept = _kept, {}
    try:
        yield
    finally:
        left, _kept = _kept, outer
        if ray.is_initialized():  # else they ended with their Ray
            node = ray.get_runtime_context().get_node_id()
            for kept in left.values():
                for _, _, actor in (k for k in kept if k[0] == node):
                    kill_quietly(actor)


def keeping(options: list[dict]) -> bool:
    """Inside `keep_actors`, and every process of `options` may be kept."""
    return _kept is not None and all(keepable(o) for o in options)


def keepable(options: dict) -> bool:
    """Placed without GPUs, placement groups or a run's own environment (a multi-node run's)."""
    return not ({"scheduling_strategy", "runtime_env"} & options.keys() or options.get("num_gpus"))


def take(kind: str, options: list[dict]) -> list:
    """Kept processes of `kind` for the first of `options`, while they match (same Ray, same Ray
    options); the caller starts new processes for the rest."""
    if not _kept or not _kept.get(kind):
        return []
    node = ray.get_runtime_context().get_node_id()
    kept = _kept[kind] = [k for k in _kept[kind] if k[0] == node]  # a Ray started since: gone
    taken = []
    for o in options:
        match = next((k for k in kept if k[1] == o), None)  # only keepable options are kept
        if match is None:
            break
        kept.remove(match)
        taken.append(match[2])
    return taken


def hand_back(kind: str, options: list[dict], actors: list) -> None:
    """`actors` (started with `options`, set up no longer) for later runs to take; the oldest
    beyond `MAX_KEPT` are ended. Call only where `keeping(options)`."""
    node = ray.get_runtime_context().get_node_id()
    kept = _kept.setdefault(kind, [])
    kept.extend((node, o, a) for o, a in zip(options, actors, strict=True))
    while len(kept) > MAX_KEPT:
        kill_quietly(kept.pop(0)[2])


def kill_quietly(actor) -> None:
    try:
        ray.kill(actor)
    except (RayActorError, GetTimeoutError, ValueError):
        pass  # already gone
