"""The memory plan's vocabulary: what the planner reads of a run (`Setup`), and what it predicts,
term by term (`Term`), phase by phase (`Phase`: training, the forward-only passes, generating),
for each kind of GPU of the run (`Role`: a trainer GPU, an engine GPU, a colocated GPU).

Bytes are exact integers of the formulas in `rlx.memory.trainer` and `rlx.memory.engine`; GiB
(2**30 bytes, what torch and nvidia-smi's MiB / 1024 report) only where they are printed.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlx.cluster import ClusterConfig
from rlx.models.config import ModelConfig
from rlx.rollout.config import RolloutConfig
from rlx.trainer.config import TrainConfig

GIB = 2**30
# Each GPU process's CUDA context (driver state, kernel images loaded lazily, cuBLAS workspace),
# outside torch's allocator and so outside `torch.cuda.max_memory_allocated`: about 0.3-0.6 GiB
# with CUDA 12-13 on an H100 or H200. NCCL's buffers are not counted.
CUDA_CONTEXT_BYTES = GIB // 2
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # train.precision -> bytes per weight and activation


@dataclass(frozen=True)
class Setup:
    """What the plan reads of a run: the sections it needs, and what the composer adds from the
    other sections (the data's prompt length, the algorithm's extra models, the checkpoint's dtype)."""

    model: ModelConfig
    train: TrainConfig
    cluster: ClusterConfig
    rollout: RolloutConfig
    # the longest prompt the plan counts: data.max_prompt_len, or 0 when it is unset (prompts are
    # then bounded only by the context, which would plan every micro-batch at the full context)
    prompt_len: int = 0
    needs_ref: bool = False  # the algorithm's reference model (KL)
    needs_critic: bool = False  # the algorithm's value model (PPO)
    checkpoint_dtype: str | None = None  # config.json's dtype ("bfloat16"...); None: fp32 (a tiny model)
    with_trainer: bool = True  # False: debug.rollout_only (engines alone)
    with_engines: bool = True  # False: debug.train_only (a trainer alone)

    @property
    def sample_len(self) -> int:
        """The longest sample the plan counts, prompt + response tokens."""
        return self.prompt_len + self.rollout.max_response_len

    @property
    def data_parallel_size(self) -> int:
        c = self.cluster
        return max(
            c.num_trainer_procs
            // (c.tensor_parallel_size * c.pipeline_parallel_size * c.context_parallel_size),
            1,
        )


@dataclass(frozen=True)
class Term:
    """One named amount of memory, and the keys that shrink it (for the refusal's advice)."""

    name: str
    bytes: int
    knobs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Phase:
    """What one GPU holds at the peak of one part of a step."""

    name: str  # "training", "forward-only passes", "generating"
    terms: tuple[Term, ...]

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.terms)

    def largest(self, n: int) -> list[Term]:
        return sorted(self.terms, key=lambda t: -t.bytes)[:n]


@dataclass(frozen=True)
class Role:
    """A kind of GPU of the run (`num_gpus` alike) and its phases; its peak is the largest phase."""

    name: str  # "trainer GPU", "engine GPU", "colocated GPU (trainer rank + engine)"
    num_gpus: int
    phases: tuple[Phase, ...]
    kind: str = "trainer"  # trainer | engine | colocated: which checks and knobs apply

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.bytes)


@dataclass(frozen=True)
class Plan:
    """Every GPU role of a run, against the memory of one GPU (None: unknown)."""

    roles: tuple[Role, ...]
    gpu_bytes: int | None
    gpu_source: str  # where the GPU's memory came from, for messages: "cluster.gpu_memory_gib=80"
    headline: str  # the run's shape in one line (model, precision, layout, placement)
    notes: tuple[str, ...] = ()  # the assumptions that matter for this run, printed under the tables


def count(n: int | float) -> str:
    """A parameter count for people: 9.40B, 31.2M, 75,136."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{round(n):,}"


def gib(num_bytes: int | float) -> str:
    """`num_bytes` in GiB, one decimal."""
    return f"{num_bytes / GIB:.1f}"
