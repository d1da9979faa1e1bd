"""The `cluster` config group's schema: where processes run and how the trainer is split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from rlx.config.rules import AT_LEAST_1, NON_NEGATIVE, POSITIVE, UNIT_OPEN_HIGH, Rule


@dataclass
class ClusterConfig:
    """Machines, placement and Megatron parallel sizes."""

    num_nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU (gloo); trainer processes = num_trainer_procs
    # trainer ranks: on GPU clusters the trainer's GPUs, one per rank; DP = procs / (TP * PP * CP)
    num_trainer_procs: int = 1
    # GPUs for rollout engines (rollout.num_engines x rollout.gpus_per_engine); 0 on CPU. Split
    # placement: GPUs of their own, beside the trainer's; colocated: the trainer's GPUs, shared.
    num_rollout_gpus: int = 0
    colocate: bool = False  # engines and trainer share GPUs, taking turns (rlx/colocation.py)
    # colocated: while the engines generate, the trainer's weights and optimizer state wait in pinned
    # CPU memory (true), or stay on the GPU (false: no PCIe copies at each turn, and the engines'
    # KV cache gets the memory left beside them). Gradient buffers and cached memory are freed either
    # way. auto (the default): false where the memory plan (rlx.memory) finds that beside the kept
    # state every GPU fits with cluster.memory_margin free and each engine's KV cache holds its share
    # of a step's samples at full length; else true (and true where the GPU's memory is unknown, on
    # a CPU run, or split)
    offload_trainer: Any = "auto"  # true | false | auto
    # colocated, the trainer's state kept (offload_trainer=false): at each hand-over the side that waits
    # releases its GPU memory (true: the engines their weights and KV cache, the trainer its gradient
    # buffers and its allocator's activation memory), or nothing is released (false: trainer and
    # engines stay resident, the weight sync is the whole hand-over; the Qwen3-1.7B shape on 1×H200:
    # the step 3.14 -> 3.01 s). auto (the default): false where the memory plan fits the trainer's
    # training peak beside the engines and a step's samples in their KV caches (offload_trainer's
    # rule); else true (and true whenever the state is offloaded)
    release_memory: Any = "auto"  # true | false | auto
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # context parallelism: each micro-batch's sequence split over this many ranks (load-balanced
    # chunks, keys and values all-gathered in attention), for sequences too long for one rank
    context_parallel_size: int = 1
    # the memory of one GPU in GiB (nvidia-smi's memory.total / 1024; an H100 80GB: 79.6): the memory
    # plan (rlx.memory) refuses, before anything starts, a run whose predicted peak on some GPU is more;
    # null: this machine's GPUs' (nvidia-smi), no refusal where it sees none (the job's node checks again)
    gpu_memory_gib: float | None = None
    # the share of each GPU the memory plan leaves free beside a trainer's predicted peak, for what it
    # does not count (the caching allocator's fragmentation, NCCL's buffers): a run whose trainer
    # leaves less is refused (a Qwen3-30B-A3B slice planned with 9% free ran out of memory with 3.7 GiB
    # fragmented, docs/benchmarks.md). 0: refuse only a peak over the GPU. Engines fill the share
    # `mem_fraction_static` gives them, by design, and are not held to it.
    memory_margin: float = 0.10
    # the memory of the machine in GiB, for a CPU run: every process of it (trainer ranks, engines,
    # the driver) shares it, and a run the host plan (rlx.memory.host) does not fit is refused before
    # it starts (Ray's monitor would kill a process minutes in); null: this machine's (psutil, or a
    # lower cgroup limit)
    host_memory_gib: float | None = None
    ray_address: str | None = None  # None: start a local Ray (on loopback); "auto" or host:port: join one
    # UNSAFE. A run of several nodes needs a Ray that requires Ray's token (RAY_AUTH_MODE=token; SLURM
    # jobs make one per job): without one, anyone who reaches a node can run code on it. true: a
    # cluster.ray_address that runs without authentication is used anyway (docs/resilience.md, Security)
    ray_allow_unauthenticated: bool = False
    ray_num_cpus: int | None = None  # logical CPUs for a local Ray (None: all)
    torch_threads: int = 1  # intra-op threads per trainer process on CPU
    expert_parallel_size: int = 1  # MoE experts split over this many ranks (carved out of TP x DP)
    # multi-node SLURM jobs: how long the first node waits for the others to join its Ray head
    ray_join_timeout_s: float = 300.0
    # the longest any call on the trainer ranks may take (start-up, a train step, a weight push, a
    # checkpoint); past it the run stops naming the ranks that did not answer, instead of hanging
    trainer_call_timeout_s: float = 1800.0

    RULES: ClassVar[dict[str, Rule]] = {
        "num_nodes": AT_LEAST_1,
        "gpus_per_node": NON_NEGATIVE,
        "num_trainer_procs": AT_LEAST_1,
        "num_rollout_gpus": NON_NEGATIVE,
        "tensor_parallel_size": AT_LEAST_1,
        "pipeline_parallel_size": AT_LEAST_1,
        "context_parallel_size": AT_LEAST_1,
        "gpu_memory_gib": POSITIVE,
        "memory_margin": UNIT_OPEN_HIGH,
        "host_memory_gib": POSITIVE,
        "offload_trainer": Rule("true, false or auto", lambda v: v is True or v is False or v == "auto"),
        "release_memory": Rule("true, false or auto", lambda v: v is True or v is False or v == "auto"),
        "expert_parallel_size": AT_LEAST_1,
        "torch_threads": AT_LEAST_1,
        "ray_join_timeout_s": POSITIVE,
        "trainer_call_timeout_s": POSITIVE,
    }
