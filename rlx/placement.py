"""Where every process of a run goes: trainer ranks and rollout engines pinned to GPUs through one
Ray placement group (on CPU, plain fractional actors).

Split placement gives the trainer `cluster.num_trainer_procs` GPUs and the engines
`cluster.num_rollout_gpus` others: one bundle per trainer rank ({"GPU": 1}), then one per engine
({"GPU": rollout.gpus_per_engine}). Colocated placement makes one bundle per trainer GPU and puts
a trainer rank and an engine on each, half a GPU apiece in Ray's accounting (the two take turns:
the engine releases its memory while the trainer works and the reverse).

Every run gets a fresh API key (`rlx.ports.new_api_key`) that its engines and the router require,
on one node too: the driver's environment holds it for its own clients (the router's, the pool's,
the trainer group's, which hands it to the ranks) until `Placement.remove`. Across nodes
(`cluster.num_nodes > 1`) every trainer rank and engine also gets the run's network environment
(`rlx.ports.network_env`: engines bind their node's address) through Ray's `runtime_env`. The key
stays out of `runtime_env`, which Ray's dashboard and state API show to whoever reaches them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from rlx import ports
from rlx.cluster import ClusterConfig
from rlx.rollout.config import RolloutConfig

COLOCATED_SHARE = 0.5  # each of the trainer rank and the engine on a colocated GPU
READY_TIMEOUT_S = 120.0


@dataclass
class Placement:
    """Ray actor options (`.options(**...)`) for each trainer rank and each engine, in order."""

    trainer: list[dict[str, Any]]
    engines: list[dict[str, Any]]
    bundles: list[dict[str, float]] = field(default_factory=list)  # the placement group's; [] on CPU
    group: Any = None  # the Ray placement group (None on CPU)
    env: dict[str, str] = field(default_factory=dict)  # `rlx.ports.network_env`; {} on one node
    api_key: str | None = None  # the run's (`plan` makes one); in the driver's environment until `remove`
    _key_before: str | None = None  # the driver's API_KEY_ENV before `plan`, given back by `remove`

    def remove(self) -> None:
        """Give the reserved GPUs back to Ray, and the driver's environment back as it was."""
        if self.api_key is not None and os.environ.get(ports.API_KEY_ENV) == self.api_key:
            if self._key_before is None:
                os.environ.pop(ports.API_KEY_ENV, None)
            else:
                os.environ[ports.API_KEY_ENV] = self._key_before
        if self.group is not None:
            from ray.util import remove_placement_group

            remove_placement_group(self.group)
            self.group = None


def bundles_for(cluster: ClusterConfig, rollout: RolloutConfig) -> tuple[list[dict], list[int], list[int]]:
    """(bundles, trainer rank -> bundle, engine -> bundle) for a GPU cluster."""
    num_trainer = cluster.num_trainer_procs
    if cluster.colocate:
        return (
            [{"GPU": 1.0, "CPU": 0.0}] * num_trainer,
            list(range(num_trainer)),
            list(range(rollout.num_engines)),
        )
    engine_bundle = {"GPU": float(rollout.gpus_per_engine), "CPU": 0.0}
    bundles = [{"GPU": 1.0, "CPU": 0.0}] * num_trainer + [engine_bundle] * rollout.num_engines
    return bundles, list(range(num_trainer)), [num_trainer + e for e in range(rollout.num_engines)]


def plan(cluster: ClusterConfig, rollout: RolloutConfig) -> Placement:
    """Reserve the run's GPUs (a Ray placement group; Ray must be started) and say where each
    process goes, with the run's network environment (see the module doc). Raises RuntimeError
    naming the counts if the Ray cluster has too few GPUs."""
    placement = _place(cluster, rollout)
    placement.env = ports.network_env(cluster.num_nodes)
    if placement.env:
        for options in [*placement.trainer, *placement.engines]:
            options["runtime_env"] = {"env_vars": dict(placement.env)}
    placement.api_key, placement._key_before = ports.new_api_key(), os.environ.get(ports.API_KEY_ENV)
    os.environ[ports.API_KEY_ENV] = placement.api_key  # the driver's own clients
    return placement


def _place(cluster: ClusterConfig, rollout: RolloutConfig) -> Placement:
    if cluster.gpus_per_node == 0:  # CPU: nothing to pin; zero CPUs so small machines never wait
        return Placement(
            [{"num_cpus": 0} for _ in range(cluster.num_trainer_procs)],
            [{"num_cpus": 0} for _ in range(rollout.num_engines)],
        )
    import ray
    from ray.util import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    bundles, trainer_at, engine_at = bundles_for(cluster, rollout)
    needed = sum(
        b["GPU"] for b in bundles
    )  # = num_trainer_procs (+ num_rollout_gpus, split): compose checks it
    available = ray.cluster_resources().get("GPU", 0.0)
    if needed > available:
        raise RuntimeError(
            f"the run needs {needed:g} GPUs (cluster.num_trainer_procs={cluster.num_trainer_procs}"
            f"{'' if cluster.colocate else f' + cluster.num_rollout_gpus={cluster.num_rollout_gpus}'}) "
            f"but the Ray cluster has {available:g}; lower them or add nodes"
        )
    group = placement_group(bundles, strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=READY_TIMEOUT_S)
    if not ready:
        raise RuntimeError(f"Ray could not place {len(bundles)} GPU bundles within {READY_TIMEOUT_S:.0f} s")

    def at(bundle: int, gpus: float) -> dict[str, Any]:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
        return {"num_cpus": 0, "num_gpus": gpus, "scheduling_strategy": strategy}

    trainer_gpus = COLOCATED_SHARE if cluster.colocate else 1.0
    engine_gpus = COLOCATED_SHARE if cluster.colocate else float(rollout.gpus_per_engine)
    return Placement(
        trainer=[at(b, trainer_gpus) for b in trainer_at],
        engines=[at(b, engine_gpus) for b in engine_at],
        bundles=bundles,
        group=group,
    )
