"""Thin Ray-actor shell around one rollout engine server (local or SGLang).

`rollout._target_` names a launcher class (contract: `rlx.rollout.servers`) that starts an engine
serving SGLang's HTTP API and exposes `url` and `shutdown()`. Where it binds and which API key it
requires come from this process's environment (`rlx.ports`; set per run by `rlx.placement.plan`).
"""

from __future__ import annotations

from hydra.utils import get_class

from rlx import ports
from rlx.gc_freeze import freeze_startup_objects, in_ray_actor
from rlx.rollout.config import RolloutConfig


class EngineActor:
    """Starts the configured engine server in this (actor) process; tests use it in-process."""

    def __init__(self, cfg: RolloutConfig, model_path: str, *, seed: int):
        launcher = get_class(cfg._target_)
        self.server = launcher(cfg, model_path, seed=seed, host=ports.engine_host(), api_key=ports.api_key())
        if in_ray_actor():  # its own process: the model and server are here for good (rlx.gc_freeze)
            freeze_startup_objects()

    def url(self) -> str:
        return self.server.url

    def shutdown(self) -> None:
        self.server.shutdown()
