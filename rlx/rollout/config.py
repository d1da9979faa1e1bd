"""The `rollout` config group's schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlx.config.rules import AT_LEAST_1, NON_NEGATIVE, TOP_K, UNIT_OPEN_LOW, Rule, one_of

WEIGHT_SYNC_METHODS = ("auto", "tensor", "distributed", "disk")  # rollout.weight_sync


@dataclass
class RolloutConfig:
    """Rollout engines, sampling, batch and group sizes, reward."""

    _target_: str = "rlx.rollout.servers.LocalServer"  # engine launcher run by each engine actor
    num_engines: int = 1  # >= 2 puts the engines behind sglang-router
    # GPUs each engine spans (SGLang's tp_size; rlx's own engine runs on one); GPU clusters only
    gpus_per_engine: int = 1
    batch_size: int = 32  # prompts per rollout step
    n_samples_per_prompt: int = 8  # group size
    max_response_len: int = 4  # max new tokens per sample
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    ignore_eos: bool = False  # generate max_response_len tokens whatever is sampled (benchmarks)
    reward_fn: str = "rlx.reward.toy.position_match"  # _target_ path: (sample) -> float
    max_concurrency: int = 512  # in-flight HTTP requests from the driver
    engine_threads: int = 1  # torch threads per local engine process
    engine_args: dict[str, Any] = field(default_factory=dict)  # passed to the engine unchanged
    # how new weights reach the engines: tensor (colocated: CUDA IPC, or shared memory on CPU),
    # distributed (a NCCL broadcast from trainer rank 0; gloo on CPU), disk (safetensors shards);
    # auto: tensor when colocated, distributed on split GPUs, disk on CPU
    weight_sync: str = "auto"
    weight_bucket_mb: int = 512  # the most weight bytes one transfer holds at once (each path)
    server_module: str = (
        "sglang.launch_server"  # rollout=sglang: `python -m` this (a fork's entry point, say)
    )
    router_args: dict[str, Any] = field(default_factory=dict)  # passed to sglang-router unchanged

    RULES: ClassVar[dict[str, Rule]] = {
        "temperature": NON_NEGATIVE,
        "top_p": UNIT_OPEN_LOW,
        "top_k": TOP_K,
        "batch_size": AT_LEAST_1,
        "max_response_len": AT_LEAST_1,
        "num_engines": AT_LEAST_1,
        "gpus_per_engine": AT_LEAST_1,
        "max_concurrency": AT_LEAST_1,
        "engine_threads": AT_LEAST_1,
        "weight_sync": one_of(WEIGHT_SYNC_METHODS),
        "weight_bucket_mb": AT_LEAST_1,
    }
