"""Thin Ray-actor shell around one rollout engine server (local or SGLang).

`rollout._target_` names a launcher class built as `Launcher(cfg: RolloutConfig, model_path, seed=...)`
that starts an engine serving SGLang's HTTP API and exposes `url` and `shutdown()`.
"""

from __future__ import annotations

from hydra.utils import get_class

from rlx.rollout.config import RolloutConfig


class EngineActor:
    """Starts the configured engine server in this (actor) process; tests use it in-process."""

    def __init__(self, cfg: RolloutConfig, model_path: str, *, seed: int):
        self.server = get_class(cfg._target_)(cfg, model_path, seed=seed)

    def url(self) -> str:
        return self.server.url

    def shutdown(self) -> None:
        self.server.shutdown()
