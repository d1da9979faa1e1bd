"""Engine launchers named by `rollout._target_`: each starts one server speaking SGLang's HTTP API.

Contract (what `EngineActor` relies on): `Launcher(cfg: RolloutConfig, model_path: str, *, seed: int,
host: str, api_key: str | None)` starts the server bound to `host` (loopback on one node, the node's
address across nodes) requiring `Authorization: Bearer api_key` on every route but `/health` when a
key is given (a run always gives its own), and returns once it answers `/health`; `url` (the
address others reach it by); `shutdown()`.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from rlx.ports import LOOPBACK
from rlx.rollout.config import RolloutConfig


def with_engine_dtype(cfg: RolloutConfig, precision_dtype: str, hf_dir: Path, gpus: bool) -> RolloutConfig:
    """rlx's engine on GPUs serves an fp32 checkpoint (the tiny models', a random init's) in the
    trainer's precision (`precision_dtype`, a torch dtype name), so a bf16 run rolls out in bf16
    as its trainer computes it (and on bf16 GEMMs and flash attention, not fp32's; launch-bound
    tiny models gain nothing: docs/benchmarks.md, "One short rollout batch"). `engine_args.dtype` when
    set, any other checkpoint dtype (the engine's `auto`: a bf16 checkpoint stays bf16), CPU
    engines (fp32 always) and SGLang (its own `--dtype` rule) are left as they are."""
    if (
        cfg._target_ != f"{LocalServer.__module__}.{LocalServer.__qualname__}"
        or not gpus
        or "dtype" in cfg.engine_args
        or precision_dtype == "float32"
    ):
        return cfg
    config = json.loads((Path(hf_dir) / "config.json").read_text())
    if (config.get("dtype") or config.get("torch_dtype") or "float32") != "float32":  # no dtype: fp32
        return cfg
    return replace(cfg, engine_args={**cfg.engine_args, "dtype": precision_dtype})


def with_memory_saver(cfg: RolloutConfig, colocated: bool) -> RolloutConfig:
    """Colocated SGLang engines give their GPU memory back on `/release_memory_occupation` only
    with SGLang's memory saver (`--enable-memory-saver`; without it the call frees nothing and the
    trainer finds its GPU full), so it is turned on unless `rollout.engine_args` sets it (false is
    refused when composing). rlx's own engine releases its memory without it."""
    sglang = f"{SGLangServer.__module__}.{SGLangServer.__qualname__}"
    if not colocated or cfg._target_ != sglang or "enable_memory_saver" in cfg.engine_args:
        return cfg
    return replace(cfg, engine_args={**cfg.engine_args, "enable_memory_saver": True})


class LocalServer:
    """rlx's own engine (HF weights, batched sampling) served in this process (`rlx.engine.serve`)."""

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        *,
        seed: int,
        host: str = LOOPBACK,
        api_key: str | None = None,
    ):
        from rlx.engine.serve import start_server  # the engine's code loads in the engine's process only

        self.server = start_server(  # an `EngineServer`: its `engine` too (benches read both)
            model_path, cfg.engine_args, seed=seed, num_threads=cfg.engine_threads, host=host, api_key=api_key
        )

    @property
    def url(self) -> str:
        return self.server.url

    def shutdown(self) -> None:
        self.server.stop()


class SGLangServer:
    """A `python -m <rollout.server_module>` child process (SGLang's launch_server by default);
    `rollout.engine_args` become its flags."""

    @classmethod
    def config_errors(cls, cfg: RolloutConfig) -> list[str]:
        """The server module must be installed here (checked before any process starts)."""
        import importlib.util

        try:
            found = importlib.util.find_spec(cfg.server_module) is not None
        except ModuleNotFoundError:
            found = False
        if found:
            return []
        return [
            f"rollout.server_module={cfg.server_module} is not installed; install SGLang "
            "(pip install '.[sglang]') or use rollout=local"
        ]

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        *,
        seed: int,
        host: str = LOOPBACK,
        api_key: str | None = None,
    ):
        from rlx.rollout.sglang import ServerProcess

        # an engine over several GPUs is SGLang's tensor parallelism (the actor holds them all)
        spread = {"tp_size": cfg.gpus_per_engine} if cfg.gpus_per_engine > 1 else {}
        args = {"random_seed": seed, **spread, **dict(cfg.engine_args)}
        self._process = ServerProcess(
            model_path, engine_args=args, module=cfg.server_module, host=host, api_key=api_key
        )  # SGLang's --api-key, handed over in its environment
        self._process.start()

    @property
    def url(self) -> str:
        return self._process.url

    def shutdown(self) -> None:
        self._process.stop()
