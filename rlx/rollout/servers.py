"""Engine launchers named by `rollout._target_`: each starts one server speaking SGLang's HTTP API.

Contract (what `EngineActor` relies on): `Launcher(cfg: RolloutConfig, model_path: str, *, seed: int)`
starts the server and returns once it answers `/health`; `url`; `shutdown()`.
"""

from __future__ import annotations

from rlx.rollout.config import RolloutConfig


class LocalServer:
    """rlx's own engine (HF weights, batched sampling) served in this process on 127.0.0.1."""

    def __init__(self, cfg: RolloutConfig, model_path: str, *, seed: int):
        from rlx.rollout.http_server import EngineServer
        from rlx.rollout.local import LocalEngine

        engine = LocalEngine(model_path, seed=seed, num_threads=cfg.engine_threads, **dict(cfg.engine_args))
        self._server = EngineServer(engine)
        self._server.start()

    @property
    def url(self) -> str:
        return self._server.url

    def shutdown(self) -> None:
        self._server.stop()


class SGLangServer:
    """A real `sglang.launch_server` child process; `rollout.engine_args` become its flags."""

    module = "sglang.launch_server"

    def __init__(self, cfg: RolloutConfig, model_path: str, *, seed: int):
        from rlx.rollout.sglang import ServerProcess

        args = {"random_seed": seed, **dict(cfg.engine_args)}
        self._process = ServerProcess(model_path, engine_args=args, module=self.module)
        self._process.start()

    @property
    def url(self) -> str:
        return self._process.url

    def shutdown(self) -> None:
        self._process.stop()
