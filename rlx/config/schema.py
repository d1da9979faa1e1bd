"""The `run` section and the root schema that Hydra composes into (`train` is `rlx.trainer.config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from rlx.algo.config import AlgoConfig
from rlx.cluster import ClusterConfig
from rlx.config.rules import NON_NEGATIVE, UNIT_OPEN_LOW, Rule
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
    # write checkpoints (Megatron's: model, optimizer; the loop's: data position, buffer, version)
    # at the end, every save_interval steps, and when SIGTERM/SIGINT stops the run after a step
    save: bool = False
    save_interval: int = 0  # with save: checkpoint every N steps as well as at the end (0: end only)
    keep_checkpoints: int = 0  # keep the newest N checkpoints, delete older ones (0: keep all)
    # a run directory (or its checkpoints/): continue from its latest checkpoint, or one checkpoint
    # (RUN/checkpoints/step_NNNNNN); auto: this run's own directory (run.output_dir) if it has one,
    # else start fresh (jobs that SLURM requeues). A checkpoint is unpickled, so code: rlx loads one
    # only from a directory with rlx's run record (config.yaml, run_info.json); load only your own
    resume_from: str | None = None
    # at the end, write the trained policy as an HF directory under hf/ (LoRA: merged, and its
    # adapters in PEFT's format under hf_adapter/)
    save_hf: bool = False
    # evaluate the data.eval sets every N steps, before the first and after the last (0: never)
    eval_interval: int = 0
    # stop the run (with the first failure's reason) when at least this fraction of a round's samples
    # failed (engine errors, reward functions that raise or time out), rather than train on nothing
    max_failed_frac: float = 1.0
    dump_rollouts: bool = True  # rollouts/step_NNNNNN.jsonl
    # where each step's metrics go (rlx.tracking.sinks): jsonl (metrics.jsonl), tensorboard, wandb,
    # mlflow (the last two: pip install 'rlx[trackers]')
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    name: str | None = None  # the run's name in W&B and MLflow; None: the run directory's name
    project: str = "rlx"  # the W&B project, the MLflow experiment
    tags: list[str] = field(default_factory=list)  # the run's tags in W&B and MLflow
    progress: bool = True  # progress bar on the console
    # print the memory plan (each GPU's predicted peak, term by term: rlx.memory) and exit, starting
    # nothing; a GPU run logs the same plan as its first lines
    plan_only: bool = False

    RULES: ClassVar[dict[str, Rule]] = {
        "num_rollout": NON_NEGATIVE,
        "save_interval": NON_NEGATIVE,
        "eval_interval": NON_NEGATIVE,
        "keep_checkpoints": NON_NEGATIVE,
        "max_failed_frac": UNIT_OPEN_LOW,
    }


@dataclass
class DebugConfig:
    """Run one half of the loop alone (slime's --debug-rollout-only / --debug-train-only)."""

    rollout_only: bool = False  # generate, score and dump rollouts; no trainer, no weight updates
    train_only: bool = False  # no engines: train on the batches dumped by a run (debug.load_rollouts)
    load_rollouts: str | None = None  # train_only: a run directory (or its rollouts/) to read batches from
    # steps whose trainer call (log-probs and optimizer steps) runs under torch.profiler: a trace
    # per rank and a table of the ops taking most time, in <run dir>/profile/
    profile_train_steps: list[int] = field(default_factory=list)


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
    debug: DebugConfig = field(default_factory=DebugConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
