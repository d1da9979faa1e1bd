"""The `rollout` config group's schema."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from rlx.config.rules import AT_LEAST_1, NON_NEGATIVE, POSITIVE, TOP_K, UNIT_OPEN_LOW, Rule, one_of

WEIGHT_SYNC_METHODS = ("auto", "tensor", "distributed", "disk")  # rollout.weight_sync
MODES = ("sync", "async")  # rollout.mode
STALENESS_POLICIES = ("pace", "drop")  # rollout.staleness_policy
STOP_STRINGS = Rule(  # rollout.stop
    "a list of non-empty strings (an empty one would end every response at its first token)",
    lambda v: all(isinstance(s, str) and s for s in v),
    fix="remove the empty string",
)


@dataclass
class RolloutConfig:
    """Rollout engines, sampling, batch and group sizes (the reward is the task's: `reward.fn`)."""

    _target_: str = "rlx.rollout.launchers.LocalLauncher"  # engine launcher run by each engine actor
    num_engines: int = 1  # >= 2 puts the engines behind sglang-router
    # GPUs each engine spans (SGLang's tp_size; rlx's own engine runs on one); GPU clusters only
    gpus_per_engine: int = 1
    batch_size: int = 32  # prompts per rollout step
    n_samples_per_prompt: int = 8  # group size
    # max new tokens per sample; a task preset sets its own (conf/data/: the toy tasks 4, data=math 1024)
    max_response_len: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's EOS
    # strings that end a response (SGLang's `stop`, slime's --rollout-stop), kept in it as generated
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False  # generate max_response_len tokens whatever is sampled (benchmarks)
    # _target_ path of an async (ctx, sample, sampling_params) -> Sample | list[Sample] that generates
    # each sample itself (multi-turn, tools; rlx.rollout.generate); null: one request per group
    generate_fn: str | None = None
    max_concurrency: int = 512  # in-flight HTTP requests from the driver
    # the longest one sample's generate_fn may take (its turns, tools, retries); past it the sample
    # is cancelled and fails, and the run goes on (one that blocks the loop instead ends the run)
    generate_timeout_s: float = 1800.0
    # the longest one request to an engine or the router may take (a hung engine then fails it,
    # naming the engine, instead of stalling the run)
    request_timeout_s: float = 600.0
    engine_start_timeout_s: float = 900.0  # engines must serve within this (model load, CUDA graphs)
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
    # --- evaluation (rlx.eval.runner; data.eval names the sets, run.eval_interval when) ---
    n_samples_per_eval_prompt: int = 1  # responses per eval prompt (pass@k for k up to this)
    eval_temperature: float | None = None  # null: rollout.temperature
    eval_top_p: float | None = None  # null: rollout.top_p
    eval_max_response_len: int | None = None  # null: rollout.max_response_len
    # --- how batches are produced (rlx.rollout.producer) ---
    # sync: generate step k's batch, then train on it; async: later steps' batches are generated
    # while step k trains (split placement only), no sample older than max_staleness versions
    mode: str = "sync"
    update_weights_interval: int = 1  # push the trainer's weights to the engines every N steps
    # async: how many policy versions a trained sample may lag the trainer (trainer version minus
    # the sample's oldest token version); must be >= update_weights_interval - 1
    max_staleness: int = 1
    # async: pace: a batch's generation waits until the engines serve a version recent enough that
    # none of it can exceed max_staleness; drop: generate ahead freely (up to max_staleness + 1
    # batches queued) and drop groups that grew too old before training
    staleness_policy: str = "pace"
    # a group filter run on each group as it completes (dynamic sampling): a `_target_` path of
    # `(group: list[Sample]) -> bool` (True keeps it), e.g. rlx.rollout.filters.reward_varies
    # (DAPO's: drop groups whose rewards are all equal); null keeps every group
    filter_fn: str | None = None
    # groups launched at once per batch (>= batch_size; null: batch_size); generation stops when
    # batch_size groups passed the filter and the rest are aborted; another round starts if too few did
    over_sampling_batch_size: int | None = None
    # groups aborted once the batch was full keep their tokens and continue next batch (else dropped)
    partial_rollout: bool = False
    # partial rollout: tokens generated by an older policy than the sample's newest are not trained on
    mask_old_policy_tokens: bool = False
    # async with a PPO-family algorithm and no off-policy correction (algo.use_tis) is refused;
    # true allows it anyway
    allow_uncorrected_async: bool = False
    # --- engine fault tolerance (rlx.rollout.health; docs/resilience.md) ---
    # true: a monitor pings every engine; a dead or hung one is taken out of the router, restarted
    # with the last published weights and put back, and requests that failed on it are sent again
    fault_tolerance: bool = False
    health_check_interval_s: float = 10.0  # seconds between two pings of every engine
    # a ping (GET /health_generate: one token through the engine's scheduler) unanswered for this
    # long fails; a refused connection (the process is gone) restarts the engine at once
    health_check_timeout_s: float = 30.0
    health_check_failures: int = 3  # failed pings in a row that make an engine hung (restarted)
    max_request_retries: int = 3  # times one group's failed request is sent again before it fails
    # the longest an engine restart may take (new actor, model loaded, weights, back in the router);
    # requests wait at most this long for an engine to serve again
    engine_restart_timeout_s: float = 900.0

    def sampling_params(self) -> dict[str, Any]:
        """SGLang's sampling parameters of every rollout request (before per-sample seeds and budgets)."""
        params = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_response_len,
            "stop_token_ids": list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": True,
        }
        if self.stop:
            params["stop"] = list(self.stop)
        return params

    RULES: ClassVar[dict[str, Rule]] = {
        "temperature": NON_NEGATIVE,
        "top_p": UNIT_OPEN_LOW,
        "top_k": TOP_K,
        "stop": STOP_STRINGS,
        "batch_size": AT_LEAST_1,
        "max_response_len": AT_LEAST_1,
        "num_engines": AT_LEAST_1,
        "gpus_per_engine": AT_LEAST_1,
        "max_concurrency": AT_LEAST_1,
        "engine_threads": AT_LEAST_1,
        "weight_sync": one_of(WEIGHT_SYNC_METHODS),
        "weight_bucket_mb": AT_LEAST_1,
        "n_samples_per_eval_prompt": AT_LEAST_1,
        "eval_temperature": NON_NEGATIVE,
        "eval_top_p": UNIT_OPEN_LOW,
        "eval_max_response_len": AT_LEAST_1,
        "mode": one_of(MODES),
        "update_weights_interval": AT_LEAST_1,
        "max_staleness": NON_NEGATIVE,
        "staleness_policy": one_of(STALENESS_POLICIES),
        "over_sampling_batch_size": AT_LEAST_1,
        "request_timeout_s": POSITIVE,
        "generate_timeout_s": POSITIVE,
        "engine_start_timeout_s": POSITIVE,
        "health_check_interval_s": POSITIVE,
        "health_check_timeout_s": POSITIVE,
        "health_check_failures": AT_LEAST_1,
        "max_request_retries": NON_NEGATIVE,
        "engine_restart_timeout_s": POSITIVE,
    }
