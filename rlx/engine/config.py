"""Engine arguments, named after SGLang's server arguments wherever SGLang has one."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)

# SGLang's --dtype names; "auto" is the checkpoint's own dtype, as in SGLang.
DTYPES = {"float32": torch.float32, "float": torch.float32}
DTYPES |= {"bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}
# SGLang's --kv-cache-dtype names; fp8 is stored unscaled (SGLang's k/v scales of 1 where a
# checkpoint brings none) and read back into the model's dtype for the attention arithmetic.
KV_CACHE_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES |= {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
# the HF model types the engine runs on its own model code (`rlx.engine.models.FAMILIES`); any
# other runs in transformers' model, whose cache holds the model's dtype
MODEL_TYPES = ("qwen3", "llama", "glm4", "qwen3_moe")
# the engine's switches read from its environment, to compare or rule out a fast path: name ->
# (the values it takes, its default, what they mean); rlx/engine/pdl.py, triton_gemm.py
ENV_SWITCHES = {
    "RLX_ENGINE_PDL": (("0", "1", "2"), "2", "0 (off), 1 (wait) or 2 (wait, then launch the next)"),
    "RLX_ENGINE_SMALL_GEMM": (("0", "1"), "1", "1 (on, where it pays) or 0 (off)"),
}


def env_switch(name: str) -> str:
    """Switch `name` of ENV_SWITCHES as this process's environment sets it (its default where
    unset); a value it does not take is refused, naming the ones it does."""
    values, default, meaning = ENV_SWITCHES[name]
    raw = os.environ.get(name, default)
    if raw not in values:
        raise ValueError(f"{name}={raw!r}: use {meaning}")
    return raw


@dataclass
class EngineArgs:
    """How one engine runs. Unknown (SGLang-only) arguments are accepted and ignored."""

    model_path: str
    tokenizer_path: str | None = None  # default: model_path
    served_model_name: str | None = None  # default: model_path
    dtype: str = "auto"  # "auto": the checkpoint's dtype on CUDA, float32 on CPU
    random_seed: int = 0  # seeds the sampling of requests without a sampling_seed
    device: str | None = None  # None: cuda when this process sees a GPU, else cpu
    context_length: int | None = None  # default: max_position_embeddings
    # SGLang's: cap an HTTP request's max_new_tokens at the context instead of rejecting it
    allow_auto_truncate: bool = False
    mem_fraction_static: float = 0.88  # GPU: weights + KV cache as a fraction of device memory
    max_total_tokens: int | None = None  # KV cache size in tokens (caps what the fraction gives)
    # sequences decoded together at most (in a run on GPUs rlx's launcher sizes this and
    # cuda_graph_max_bs to the engine's share of a step's samples: `LocalLauncher.engine_args_for_batch`)
    max_running_requests: int = 256
    chunked_prefill_size: int = 8192  # tokens per step at most (prefill chunks + decodes)
    # while sequences run, waiting requests join once this many fit (rlx's; `Scheduler`). None:
    # max_running_requests // 8 with decode CUDA graphs (a join costs an eager step), else 1
    admission_group: int | None = None
    page_size: int = 16  # tokens per KV block
    # SGLang's: "auto" stores K/V in the model's dtype; fp8_e4m3 / fp8_e5m2 in one byte an element:
    # twice a 2-byte cache's tokens in the same memory, and a little faster a token on sm90
    # (rlx's decode kernel has launch settings for one-byte tiles: docs/benchmarks.md, Decisions)
    kv_cache_dtype: str = "auto"
    disable_cuda_graph: bool = False
    # SGLang's: keep the weights in CPU memory while released. Off (SGLang's default), released
    # weights are dropped and come back uninitialized: a weight update must fill them before
    # generating (colocated RL does, right after the resume), and the GPU->CPU->GPU copies are saved.
    enable_weights_cpu_backup: bool = False
    # SGLang's: a memory release keeps the addresses of the weights and KV cache (their memory
    # unmapped, the addresses reserved: CUDA virtual memory), so rlx's decode CUDA graphs survive
    # it instead of being captured again each rollout. rlx turns it on for colocated engines
    # (`LocalLauncher.for_run`); off, a release frees through torch's allocator. CUDA only.
    enable_memory_saver: bool = False
    disable_overlap_schedule: bool = False  # CUDA: launch step k+1 (decode graph or prefill) before reading k
    cuda_graph_max_bs: int = 256  # largest decode batch captured in a CUDA graph
    disable_prefix_sharing: bool = False  # SGLang: disable_radix_cache
    num_threads: int = 1  # torch threads on CPU (the CPU machines share cores)
    weight_version: str = "default"
    attn_implementation: str = "sdpa"  # the transformers fallback's attention (generic path)
    cpu_kv_cache_bytes: int = 1 << 30  # CPU: KV cache bytes at most (there is no device to fill)

    @classmethod
    def from_kwargs(cls, model_path: str, **kwargs: Any) -> EngineArgs:
        """Build from SGLang-style keyword arguments; names the engine has no use for are logged."""
        names = {f.name for f in dataclasses.fields(cls)}
        aliases = {"seed": "random_seed", "max_batch_size": "max_running_requests"}
        kwargs = {aliases.get(k, k): v for k, v in kwargs.items()}
        if kwargs.get("disable_radix_cache"):
            kwargs["disable_prefix_sharing"] = True
        ignored = sorted(set(kwargs) - names)
        if ignored:
            logger.info("engine ignores arguments %s", ignored)
        return cls(model_path=str(model_path), **{k: v for k, v in kwargs.items() if k in names})

    def resolved_device(self) -> torch.device:
        if self.device is not None:
            return torch.device(self.device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def torch_dtype(self, checkpoint_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":  # CPU rollouts stay fp32: they must match the fp32 trainer's logprobs
            return (checkpoint_dtype or torch.float32) if device.type == "cuda" else torch.float32
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        return DTYPES[self.dtype]

    def kv_torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's element type for a model computing in `model_dtype`."""
        if self.kv_cache_dtype == "auto":
            return model_dtype
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be auto or one of {sorted(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )
        return KV_CACHE_DTYPES[self.kv_cache_dtype]
