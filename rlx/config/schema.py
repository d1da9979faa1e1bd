"""Run-level config sections and the root schema that Hydra composes into."""

from __future__ import annotations

from dataclasses import dataclass, field

from rlx.algo.config import AlgoConfig
from rlx.cluster import ClusterConfig
from rlx.data.config import DataConfig
from rlx.models.config import ModelConfig
from rlx.rollout.config import RolloutConfig


@dataclass
class RunConfig:
    """What the run does overall and where it writes."""

    seed: int = 1
    num_rollout: int = 80  # rollout steps (generate -> train -> sync)
    output_dir: str | None = None  # run directory; None: Hydra's run dir under launch.py, else the cwd
    save: bool = False  # write Megatron checkpoints (model, optimizer) + loop and data state
    save_interval: int = 0  # with save: checkpoint every N steps as well as at the end (0: end only)
    resume_from: str | None = (
        None  # a run directory (or its checkpoints/): continue from its latest checkpoint
    )
    save_hf: bool = False  # at the end, write the trained policy as an HF directory under hf/
    dump_rollouts: bool = True  # rollouts/step_NNNNNN.jsonl
    tensorboard: bool = True
    progress: bool = True  # progress bar on the console


@dataclass
class TrainConfig:
    """Optimisation of the policy."""

    global_batch_size: int = 256  # samples per optimizer step
    micro_batch_size: int = 64  # samples per forward/backward
    num_steps_per_rollout: int = 1  # optimizer steps per rollout batch
    lr: float = 2e-3
    min_lr: float = 0.0
    lr_warmup_steps: int = 0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    precision: str = "fp32"  # fp32 | bf16 | fp16


@dataclass
class RlxConfig:
    """The whole run: one field per config group plus `run` and `train`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    run: RunConfig = field(default_factory=RunConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
