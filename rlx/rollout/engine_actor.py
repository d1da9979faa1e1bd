"""Thin Ray-actor shell around one rollout engine server (local or SGLang).

`rollout._target_` names a launcher class (contract: `rlx.rollout.launchers`) that starts an engine
serving SGLang's HTTP API and exposes `url` and `shutdown()`. Where it binds comes from this
process's environment (`rlx.ports.engine_host`: loopback, or its node's address across nodes); the
API key it requires is the run's, given to `setup` (a kept process serves each run with that run's).
"""

from __future__ import annotations

import logging
import time

from hydra.utils import get_class

from rlx import ports, process_clock
from rlx.gc_freeze import collect_after_shutdown, freeze_after_set_up, in_ray_actor
from rlx.rollout.config import RolloutConfig

log = logging.getLogger(__name__)
LOADED = time.time()  # this module loaded: an engine's process is ready for its calls


class EngineActor:
    """Starts the configured engine server in this (actor) process; tests use it in-process. A
    process whose server was shut down may be set up again (`setup`) for another run's engine
    (`rlx.actor_reuse.keep_actors`)."""

    def __init__(
        self,
        cfg: RolloutConfig | None = None,
        model_path: str | None = None,
        *,
        seed: int = 0,
        api_key: str | None = None,
    ):
        self.server = self._setup_error = None
        self.times: dict[str, float | None] = {"warm_up_s": None, "setup_s": None}
        if cfg is not None:
            self.setup(cfg, model_path, seed=seed, api_key=api_key)

    def setup(self, cfg: RolloutConfig, model_path: str, *, seed: int, api_key: str | None = None) -> None:
        """Start the server; `api_key`: the run's, required on every route but /health (None: none)."""
        self._setup_error = None
        launcher = get_class(cfg._target_)
        host = ports.engine_host()
        ports.pin_collectives(host)  # one node: the server's gloo and NCCL (weight sync, TP) on loopback
        began = time.perf_counter()
        try:
            self.server = launcher(cfg, model_path, seed=seed, host=host, api_key=api_key)
        except BaseException as e:  # `url` raises it: the caller of a set-up again waits on `url`
            self._setup_error = e
            raise
        self.times["setup_s"] = time.perf_counter() - began
        if in_ray_actor():  # its own process: the model and server are here for good (rlx.gc_freeze)
            freeze_after_set_up()

    def warm_up(self, target: str, model_path: str, tokenizer_path: str | None = None) -> None:
        """Before `setup`: what the launcher `target` (a `rollout._target_`) can do ahead of it
        for `model_path` (`EngineLauncher.warm_up`: its imports, its device's context). A
        failure here is only logged: `setup` meets it again and raises it to the run."""
        warm_up = getattr(get_class(target), "warm_up", None)
        if warm_up is None:
            return
        began = time.perf_counter()
        try:
            warm_up(model_path, tokenizer_path)
        except Exception as e:  # a checkpoint that cannot be read: the set-up's error to report
            log.warning("the engine's warm-up for %s failed (its set-up will say why): %s", model_path, e)
        self.times["warm_up_s"] = time.perf_counter() - began

    def startup(self) -> dict[str, float | None]:
        """When (seconds since the epoch) this process `started` (None where the kernel cannot
        say) and had `loaded` this module, and the seconds of its last `warm_up_s` and `setup_s`
        (None: not run): the pool's start-up log splits an engine's start with them."""
        return {"started": process_clock.started_at(), "loaded": LOADED, **self.times}

    def url(self) -> str:
        if self.server is None and self._setup_error is not None:
            raise self._setup_error
        return self.server.url

    def shutdown(self) -> None:
        """Stop the server and let go of its model: a process kept for another run idles without it."""
        self.server.shutdown()
        self.server = self._setup_error = None
        if in_ray_actor():
            collect_after_shutdown()  # the set-up's objects freed (rlx.gc_freeze)
