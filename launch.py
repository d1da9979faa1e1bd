"""Train a model with RL: `python launch.py` runs the embedded default (tiny Qwen3, GRPO, CPU).

python launch.py                                   # tiny model, toy task, ~2 minutes on 2 CPU cores
python launch.py run.num_rollout=20 rollout.num_engines=2
python launch.py -m algo=grpo,gspo rollout.n_samples_per_prompt=4,8   # sweep: multirun/.../sweep_summary.jsonl
python launch.py -m hydra/launcher=slurm cluster=2x8 ...              # each job through sbatch, one task per node
"""

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

import rlx.config.store  # noqa: F401  (registers the config schemas)
from rlx.config.keys import moved_overrides
from rlx.errors import Stopped, StoppedNow, UserError
from rlx.launcher import preflight


@hydra.main(version_base=None, config_path="conf", config_name="config")
def main(cfg: DictConfig) -> dict | None:
    from rlx.launcher.job import run_job

    try:
        return run_job(cfg)  # in a sweep (-m): the job's outcome, never an exception
    except UserError as e:
        sys.exit(f"error: {e}")
    except (Stopped, StoppedNow) as e:  # SIGTERM/SIGINT: after a finished (checkpointed) step, or at once
        print(e, file=sys.stderr)
        sys.exit(128 + e.signum)
    except Exception as e:  # a failure mid-run (a rank died, an engine failed): one message
        where = _log_traceback(e)
        sys.exit(f"error: {type(e).__name__}: {e}" + (f"\n(traceback in {where})" if where else ""))


def _log_traceback(e: Exception) -> str | None:
    """`e`'s traceback into the job's log file (Hydra's file handler), not onto the console; its path."""
    files = [h for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    record = logging.LogRecord(
        "launch", logging.ERROR, __file__, 0, "the run failed", None, (type(e), e, e.__traceback__)
    )
    for handler in files:
        handler.handle(record)
    return files[0].baseFilename if files else None


if __name__ == "__main__":
    preflight.import_from(os.getcwd(), os.environ, sys.path)  # before Hydra may change directory
    if moved := moved_overrides(sys.argv[1:]):  # Hydra itself would say only "Could not override"
        sys.exit("error: " + "\n".join(moved))
    preflight.main_guard(sys.argv[1:])  # the command line composed by rlx first: rlx's errors, not Hydra's
    main()
