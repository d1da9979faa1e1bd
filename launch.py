"""Train a model with RL: `python launch.py` runs the embedded default (tiny Qwen3, GRPO, CPU).

python launch.py                                   # tiny model, toy task, ~2 minutes on 2 CPU cores
python launch.py run.num_rollout=20 rollout.num_engines=2
python launch.py -m algo.eps_clip=0.1,0.2          # multirun sweep
"""

import sys

import hydra
from omegaconf import DictConfig

import rlx.config.store  # noqa: F401  (registers the config schemas)
from rlx.errors import UserError


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from rlx.runtime import run

    if cfg.run.output_dir is None:
        cfg.run.output_dir = HydraConfig.get().runtime.output_dir
    try:
        run(cfg)
    except UserError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
