"""The `run` section and the root schema that Hydra composes into (`train` is `rlx.trainer.config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rlx.algo.config import AlgoConfig
from rlx.cluster import ClusterConfig
from rlx.config.rules import NON_NEGATIVE, Rule
from rlx.data.config import DataConfig
from rlx.models.config import ModelConfig
from rlx.reward.config import RewardConfig
from rlx.rollout.config import RolloutConfig
from rlx.trainer.config import TrainConfig


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

    RULES: ClassVar[dict[str, Rule]] = {"num_rollout": NON_NEGATIVE, "save_interval": NON_NEGATIVE}


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
    reward: RewardConfig = field(default_factory=RewardConfig)
