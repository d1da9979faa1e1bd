"""Engine launchers named by `rollout._target_`: each starts one server speaking SGLang's HTTP API.

Contract (what `EngineActor` relies on): `Launcher(cfg: RolloutConfig, model_path: str, *, seed: int,
host: str, api_key: str | None)` starts the server bound to `host` (loopback on one node, the node's
address across nodes) requiring `Authorization: Bearer api_key` on every route but `/health` when a
key is given (a run always gives its own), and returns once it answers `/health`; `url` (the
address others reach it by); `shutdown()`.

What a launcher declares about itself (all optional: a launcher of the user's own may subclass
`EngineLauncher` or define only what it needs; the composer and the loop read these, never the
class's name):
  * `max_gpus_per_engine`: the most GPUs one engine may take (None: any, the engine's own tensor
    parallelism); more is refused when composing;
  * `config_errors(cfg)`: its own rules about `rollout.*`, checked when composing;
  * `checkpoint_errors(cfg, hf_dir)`: what it cannot serve of the run's checkpoint, checked in the
    driver before any process starts;
  * `placement_errors(cfg, colocated)`: what it needs of the placement (checked when composing);
  * `for_run(cfg, *, colocated, precision_dtype, hf_dir, gpus)`: the `rollout` config its engines
    are started with in this run (arguments it adds for the placement or the trainer's precision);
  * `engine_args_for_batch(cfg)`: engine arguments sized to a step's batch, for the keys
    `rollout.engine_args` leaves unset (applied on GPUs; the memory plan counts them);
  * `flat_tensor_buckets`: its engine reads a colocated weight bucket as one flat buffer (rlx's
    `rlx.weight_sync.tensor.serialize_bucket` payload: one CUDA IPC handle a bucket); else one
    handle a tensor, SGLang's form, is sent;
  * `warm_up(model_path, tokenizer_path)`: run in an engine's process before it is set up (a
    colocated run's engines while the trainer sets up on their GPUs): the imports, file reads and
    device start-up its set-up would pay.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from rlx.config.build import locate
from rlx.ports import LOOPBACK
from rlx.rollout.config import RolloutConfig


def for_run(cfg: RolloutConfig, **run) -> RolloutConfig:
    """`cfg` as the launcher `cfg._target_` starts this run's engines (`EngineLauncher.for_run`)."""
    prepare = getattr(locate(cfg._target_), "for_run", None)
    return prepare(cfg, **run) if prepare is not None else cfg


def checkpoint_errors(cfg: RolloutConfig, hf_dir: Path) -> list[str]:
    """What launcher `cfg._target_` cannot serve of the checkpoint (`EngineLauncher.checkpoint_errors`)."""
    check = getattr(locate(cfg._target_), "checkpoint_errors", None)
    return check(cfg, hf_dir) if check is not None else []


def engine_args_for_batch(cfg: RolloutConfig) -> dict[str, Any]:
    """What launcher `cfg._target_` sizes to the batch (`EngineLauncher.engine_args_for_batch`)."""
    sized = getattr(locate(cfg._target_), "engine_args_for_batch", None)
    return sized(cfg) if sized is not None else {}


def flat_tensor_buckets(cfg: RolloutConfig) -> bool:
    """Whether the engines of launcher `cfg._target_` read a colocated weight bucket as one flat
    buffer (`EngineLauncher.flat_tensor_buckets`)."""
    return bool(getattr(locate(cfg._target_), "flat_tensor_buckets", False))


class EngineLauncher:
    """The declarations every launcher may make, with the defaults of a launcher that makes none."""

    max_gpus_per_engine: int | None = None
    flat_tensor_buckets: bool = False

    @classmethod
    def config_errors(cls, cfg: RolloutConfig) -> list[str]:
        return []

    @classmethod
    def placement_errors(cls, cfg: RolloutConfig, colocated: bool) -> list[str]:
        return []

    @classmethod
    def checkpoint_errors(cls, cfg: RolloutConfig, hf_dir: Path) -> list[str]:
        return []

    @classmethod
    def for_run(
        cls, cfg: RolloutConfig, *, colocated: bool, precision_dtype: str, hf_dir: Path, gpus: bool
    ) -> RolloutConfig:
        return cfg

    @classmethod
    def engine_args_for_batch(cls, cfg: RolloutConfig) -> dict[str, Any]:
        return {}

    @classmethod
    def warm_up(cls, model_path: str, tokenizer_path: str | None = None) -> None:
        pass


class LocalLauncher(EngineLauncher):
    """rlx's own engine (HF weights, batched sampling) served in this process (`rlx.engine.serve`).
    It runs on one GPU and releases its memory when colocated without being asked to."""

    max_gpus_per_engine = 1
    # a MoE's 1,575 tensors, 6.2 GB: 0.105 s flat against 0.152 s a handle each (1×H100,
    # bench/weight_sync.py --shape qwen3_30b_a3b_4l --device cuda:0 --paths tensor tensor_flat)
    flat_tensor_buckets = True
    RUNNING_RANGE = (256, 1024)  # the running cap sized to the batch: at least the engine's default
    LARGEST_GRAPH = 1024  # decode graphs up to the running cap, up to this (a user's cap may be larger)

    @classmethod
    def config_errors(cls, cfg: RolloutConfig) -> list[str]:
        """A KV cache dtype rlx's engine would refuse as it starts, or a switch of its environment
        (`rlx.engine.config.ENV_SWITCHES`, which its processes inherit), refused when composing."""
        from rlx.engine.config import ENV_SWITCHES, KV_CACHE_DTYPES, env_switch

        errors = []
        for name in ENV_SWITCHES:
            try:
                env_switch(name)
            except ValueError as e:
                errors.append(f"{e}, or unset it (the environment rlx's engines inherit, rollout=local)")
        kv = cfg.engine_args.get("kv_cache_dtype", "auto")
        if kv != "auto" and kv not in KV_CACHE_DTYPES:
            errors.append(
                f"rollout.engine_args.kv_cache_dtype={kv} is no KV cache dtype of rlx's engine (rollout=local); "
                f"set it to auto or one of {', '.join(KV_CACHE_DTYPES)}"
            )
        return errors

    @classmethod
    def checkpoint_errors(cls, cfg: RolloutConfig, hf_dir: Path) -> list[str]:
        """An fp8 KV cache for a model the engine serves through transformers' model (whose cache
        holds the model's dtype): refused before any process starts, as the engine would refuse it."""
        from rlx.engine.config import MODEL_TYPES  # the engine's own model families

        kv = cfg.engine_args.get("kv_cache_dtype", "auto")
        model_type = json.loads((Path(hf_dir) / "config.json").read_text()).get("model_type")
        if kv == "auto" or model_type in MODEL_TYPES:
            return []
        return [
            f"rollout.engine_args.kv_cache_dtype={kv} is for rlx's engine's own model families "
            f"({', '.join(MODEL_TYPES)}); {model_type} ({hf_dir}) runs in transformers' model, whose cache "
            "holds the model's dtype: remove it, or use rollout=sglang"
        ]

    @classmethod
    def engine_args_for_batch(cls, cfg: RolloutConfig) -> dict[str, Any]:
        """An engine's share of a step's samples decodes at once: `max_running_requests` is that
        share (at least 256, the engine's default; at most 1024) and `cuda_graph_max_bs` the
        running cap up to 1024, each where `rollout.engine_args` leaves it unset. At 256 running, 512
        requests of 64-512 tokens queued half of themselves: 1.13× (1.7B) to 1.26× (0.6B) the
        tokens/s at 512 running. Past the largest graph a decode step runs eagerly: 1,024
        requests of 16-256 tokens took 1.2-2.3× as long with graphs up to 512 as up to 1,024,
        which cost up to 1.2 s more of capture and 0.16 GB more of logits buffer (0.6B and 1.7B,
        1×H200, bench/graph_cap.py, docs/benchmarks.md)."""
        groups = cfg.over_sampling_batch_size or cfg.batch_size
        share = -(-groups * cfg.n_samples_per_prompt // cfg.num_engines)
        low, high = cls.RUNNING_RANGE
        chosen = cfg.engine_args.get("max_running_requests") or cfg.engine_args.get("max_batch_size")
        running = chosen or min(max(low, -(-share // 16) * 16), high)
        return {"max_running_requests": running, "cuda_graph_max_bs": min(running, cls.LARGEST_GRAPH)}

    @classmethod
    def for_run(
        cls, cfg: RolloutConfig, *, colocated: bool, precision_dtype: str, hf_dir: Path, gpus: bool
    ) -> RolloutConfig:
        """On GPUs an fp32 checkpoint (the tiny models', a random init's) is served in the trainer's
        precision (`precision_dtype`, a torch dtype name), so a bf16 run rolls out in bf16 as its
        trainer computes it (and on bf16 GEMMs and flash attention, not fp32's; launch-bound tiny
        models gain nothing: docs/benchmarks.md, "One short rollout batch"). `engine_args.dtype`
        when set, any other checkpoint dtype (the engine's `auto`: a bf16 checkpoint stays bf16)
        and CPU engines (fp32 always) are left as they are. On GPUs the running cap and the largest
        decode graph are sized to the batch (`engine_args_for_batch`), and colocated the memory
        saver is turned on, each unless `engine_args` sets it: a release keeps the weights' and
        KV cache's addresses, so the decode CUDA graphs are not captured again every rollout."""
        if not gpus:
            return cfg
        args = cls.engine_args_for_batch(cfg) | dict(cfg.engine_args)
        if colocated:
            args.setdefault("enable_memory_saver", True)
        if "dtype" not in args and precision_dtype != "float32":
            config = json.loads((Path(hf_dir) / "config.json").read_text())
            if (config.get("dtype") or config.get("torch_dtype") or "float32") == "float32":  # no dtype: fp32
                args["dtype"] = precision_dtype
        return cfg if args == dict(cfg.engine_args) else replace(cfg, engine_args=args)

    @classmethod
    def warm_up(cls, model_path: str, tokenizer_path: str | None = None) -> None:
        """The engine's code (torch, the HTTP stack, Triton's kernels), what it loads before the
        weights (transformers' auto classes, the checkpoint's config and tokenizer:
        `rlx.engine.serve.load_ahead`) and, on a GPU, its CUDA context: seconds a new process
        spends before it can load a model (on 1×H100, 5 s of transformers' imports alone)."""
        import torch

        from rlx.engine.serve import load_ahead

        load_ahead(model_path, tokenizer_path)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # creates the device's context

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


class SGLangLauncher(EngineLauncher):
    """A `python -m <rollout.server_module>` child process (SGLang's launch_server by default);
    `rollout.engine_args` become its flags. One engine may span GPUs (SGLang's tensor parallelism).
    Colocated, it gives its GPU memory back only with SGLang's memory saver."""

    # rlx's engine's own arguments, which SGLang's server would refuse as unknown flags after starting
    RLX_ONLY_ARGS = {
        "admission_group": "",
        "num_threads": "",
        "cpu_kv_cache_bytes": "",
        "attn_implementation": " (SGLang's is attention_backend)",
        "disable_prefix_sharing": " (SGLang's is disable_radix_cache)",
    }

    @classmethod
    def config_errors(cls, cfg: RolloutConfig) -> list[str]:
        """The server module must be installed here, and SGLang's takes none of rlx's own engine
        arguments (both checked before any process starts; rlx's own server, `rlx.engine.serve`,
        which the tests run in SGLang's place, takes them)."""
        import importlib.util

        errors = [
            f"rollout.engine_args.{key} is an argument of rlx's engine (rollout=local), which "
            f"{cfg.server_module} does not take{why}; remove it or use rollout=local"
            for key, why in cls.RLX_ONLY_ARGS.items()
            if key in cfg.engine_args and cfg.server_module != "rlx.engine.serve"
        ]
        try:
            found = importlib.util.find_spec(cfg.server_module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            errors.append(
                f"rollout.server_module={cfg.server_module} is not installed; install SGLang "
                "(pip install '.[sglang]') or use rollout=local"
            )
        return errors

    @classmethod
    def placement_errors(cls, cfg: RolloutConfig, colocated: bool) -> list[str]:
        if colocated and cfg.engine_args.get("enable_memory_saver", True) is False:
            return [
                "cluster.colocate=true needs the SGLang engines to free their GPU memory for the trainer, which "
                "SGLang does only with its memory saver, but rollout.engine_args.enable_memory_saver=false; "
                "remove that key (rlx turns the saver on when colocated) or set cluster.colocate=false"
            ]
        return []

    @classmethod
    def for_run(
        cls, cfg: RolloutConfig, *, colocated: bool, precision_dtype: str, hf_dir: Path, gpus: bool
    ) -> RolloutConfig:
        """Colocated, `--enable-memory-saver` is turned on unless `rollout.engine_args` sets it
        (without it `/release_memory_occupation` frees nothing and the trainer finds its GPU full;
        false is refused when composing). The dtype follows SGLang's own `--dtype` rule."""
        if not colocated or "enable_memory_saver" in cfg.engine_args:
            return cfg
        return replace(cfg, engine_args={**cfg.engine_args, "enable_memory_saver": True})

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
