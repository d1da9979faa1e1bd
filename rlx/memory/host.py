"""A CPU run's host memory: its trainer ranks, engines and driver share one machine's memory.

A run on the CPU that does not fit is killed minutes in by Ray's memory monitor (at 95% of the
machine), after start-up and a rollout; this plan refuses it before anything starts, naming the
micro-batch that fits. Per process (bytes):

- a trainer rank: the GPU plan's static terms (weights, fp32 gradient buffer, optimizer state:
  `rlx.memory.trainer`), its activation terms times `ACTIVATION_FACTOR` (the CPU runs megatron's
  unfused layers, which keep more than the fused GPU kernels the terms count), `LOGIT_BYTES` a
  logit of a micro-batch (tokens × vocabulary: the loss's fp32 copies on the CPU), and
  `PROCESS_BYTES`; the training phase only (the forward-only passes keep no activations);
- an engine: its weights in fp32 (CPU engines serve fp32) and its KV cache (`cpu_kv_cache_bytes`,
  capped by its running requests at full context), and `PROCESS_BYTES`;
- the driver: `PROCESS_BYTES`.

Calibrated on this workplace's CPU (2026-11-29) against trainer ranks' peak resident memory
(`perf/trainer_peak_rss_gib`): the default job's model widened to 25.2M parameters (8 layers of
512, fp32) at micro-batch 32 and 256, 2.66 and 8.96 GiB (the growth: 1.55× its activation terms);
SmolLM2-135M-Instruct on arithmetic (bf16, vocabulary 49,152) at 4 and 16, 4.30 and 7.79 GiB (the
growth beyond 1.55× its activations: 29 bytes a logit). Composing counts prompts only where
`data.max_prompt_len` is set, so the figure is low for long prompts: the rule refuses what clearly
does not fit, not every run that would not; `cluster.host_memory_gib` states a larger machine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from rlx.memory.params import model_params
from rlx.memory.terms import GIB, Setup
from rlx.memory.trainer import micro_batch, static_terms, training_terms

ACTIVATION_FACTOR = 1.55
LOGIT_BYTES = 29
PROCESS_BYTES = int(0.9 * GIB)  # torch, megatron, transformers and Ray's worker, before any model
# Ray's memory monitor kills a worker past this share of the machine (RAY_memory_usage_threshold)
RAY_KILL_FRACTION = float(os.environ.get("RAY_memory_usage_threshold", 0.95))


@dataclass(frozen=True)
class HostPlan:
    trainer_rank: int  # bytes, each
    num_trainer_ranks: int
    engine: int  # bytes, each
    num_engines: int

    @property
    def total(self) -> int:
        return self.num_trainer_ranks * self.trainer_rank + self.num_engines * self.engine + PROCESS_BYTES


def trainer_rank_bytes(s: Setup) -> int:
    p = model_params(s.model)
    static = sum(t.bytes for t in static_terms(s, p, 0))
    activations = sum(t.bytes for t in training_terms(s, p, 0) if not t.name.startswith("logits"))
    mb = micro_batch(s)
    logits = mb.rows * mb.seq_len * s.model.vocab_size * LOGIT_BYTES
    return static + round(ACTIVATION_FACTOR * activations) + logits + PROCESS_BYTES


def engine_bytes(s: Setup, cpu_kv_cache_bytes: int) -> int:
    """Weights in fp32 and the KV cache its CPU budget buys (the engine's own arithmetic)."""
    from rlx.memory.engine import kv_cache

    fp32 = replace(s, rollout=replace(s.rollout, engine_args={**s.rollout.engine_args, "dtype": "float32"}))
    return 4 * model_params(s.model).total + kv_cache(fp32, cpu_kv_cache_bytes)[0] + PROCESS_BYTES


def host_plan(s: Setup) -> HostPlan:
    from rlx.engine.config import EngineArgs  # its defaults

    engines = s.rollout.num_engines if s.with_engines else 0
    ranks = s.cluster.num_trainer_procs if s.with_trainer else 0
    kv = s.rollout.engine_args.get("cpu_kv_cache_bytes") or EngineArgs.cpu_kv_cache_bytes
    return HostPlan(trainer_rank_bytes(s), ranks, engine_bytes(s, kv), engines)


def host_bytes() -> int:
    """This machine's memory: psutil's total, or the cgroup's limit where lower (a container)."""
    import psutil

    total = psutil.virtual_memory().total
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            total = min(total, int(limit))
    except (OSError, ValueError):
        pass
    return total


def gib(n: int | float) -> str:
    return f"{n / GIB:.1f}"


__all__ = ["HostPlan", "host_bytes", "host_plan"]
