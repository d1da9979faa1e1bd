"""The places a run's numbers go (`run.loggers`): each sink takes the run's config once, then each
step's metrics, and is closed at the end.

  jsonl        metrics.jsonl in the run directory, a line per step (the local record)
  tensorboard  tensorboard/ in the run directory
  wandb        Weights & Biases (`pip install 'rlx[trackers]'`; offline with WANDB_MODE=offline,
               the run then in the run directory's wandb/)
  mlflow       MLflow (`pip install 'rlx[trackers]'`; where MLFLOW_TRACKING_URI points, MLflow's
               default otherwise)

W&B and MLflow get the run's name (`run.name`, else the run directory's name), `run.project` (the
W&B project, the MLflow experiment) and `run.tags`. A sink that fails (a server that cannot be
reached, a package that breaks) is dropped by the `Tracker` with one warning; the others go on.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path
from typing import Any

LOGGERS = ("jsonl", "tensorboard", "wandb", "mlflow")
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}  # logger -> the package it needs (extra: trackers)


def logger_errors(loggers: list[str]) -> list[str]:
    """`run.loggers` checked when composing: known names, each one's package installed."""
    errors = []
    for name in loggers:
        if name not in LOGGERS:
            errors.append(f"run.loggers: {name!r} is not a logger; choose from {', '.join(LOGGERS)}")
        elif (package := PACKAGES.get(name)) and importlib.util.find_spec(package) is None:
            errors.append(
                f"run.loggers: {name} needs the {package} package, which is not installed; "
                "pip install 'rlx[trackers]' (or remove it from run.loggers)"
            )
    if len(set(loggers)) != len(loggers):
        errors.append(f"run.loggers={list(loggers)} names a logger twice; list each once")
    return errors


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as dotted keys ("algo.eps_clip")."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def numbers(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of `metrics` (lists, strings and NaN are the JSON record's only)."""
    return {
        k: float(v)
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }


class JsonlSink:
    def __init__(self, run_dir: Path, **_):
        self._file = open(run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115 (line-buffered: a crash loses no step)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, run_dir: Path, **_):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for key, value in numbers(metrics).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, *, config: dict, name: str, project: str, tags: list[str]):
        import wandb

        self._run = wandb.init(
            project=project, name=name, tags=list(tags), config=config, dir=str(run_dir),
            settings=wandb.Settings(init_timeout=30, silent=True),
            reinit="create_new",
        )  # fmt: skip

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._run.log(numbers(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


_MLFLOW_NAME = re.compile(r"[^\w\-. /:]")  # MLflow's metric and parameter names allow these only


class MlflowSink:
    PARAM_CHARS = 6000  # MLflow's limit on a parameter's value

    def __init__(self, run_dir: Path, *, config: dict, name: str, project: str, tags: list[str]):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient()
        experiment = client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(project)
        run = client.create_run(experiment_id, run_name=name, tags={tag: "" for tag in tags})
        self._run_id = run.info.run_id
        params = [
            Param(_MLFLOW_NAME.sub("_", k), str(v)[: self.PARAM_CHARS]) for k, v in flat(config).items()
        ]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            client.log_batch(self._run_id, params=params[i : i + 100])

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(_MLFLOW_NAME.sub("_", k), v, now, step) for k, v in numbers(metrics).items()]
        for i in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics a batch
            self._client.log_batch(self._run_id, metrics=batch[i : i + 1000])

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


SINKS = {"jsonl": JsonlSink, "tensorboard": TensorBoardSink, "wandb": WandbSink, "mlflow": MlflowSink}
