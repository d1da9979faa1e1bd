"""`hydra/launcher=slurm` (hydra-submitit-launcher) checked before anything reaches `sbatch`.

`SubmitCheck` is a Hydra callback (conf/config.yaml, `hydra.callbacks`). When a sweep goes to
a launcher that requests an allocation (submitit's: `nodes`, `gpus_per_node`, `tasks_per_node`),
it composes every job of the sweep with its overrides and checks rlx's config rules and that the
allocation holds the job's cluster. A queued job that could only fail is never submitted; one
message lists every problem. (Inside a job, `rlx.launcher.nodes.check_allocation` checks what
SLURM actually granted, for jobs submitted by other means.)
"""

from __future__ import annotations

from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from rlx.config.compose import compose
from rlx.errors import ConfigError


class SubmitCheck(Callback):
    """Refuses a sweep (exit status 1, before submission) with a job its allocation cannot run."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        launcher = config.hydra.launcher
        if "nodes" not in launcher:  # a launcher that runs jobs where it is (basic): nothing to hold
            return
        params = OmegaConf.to_container(launcher, resolve=True)
        problems = []
        for num, overrides in enumerate(job_overrides(config)):
            app_overrides = [o for o in overrides if not o.lstrip("+~").startswith(("hydra.", "hydra/"))]
            try:
                errors = allocation_errors(params, compose(app_overrides).cluster)
            except ConfigError as e:
                errors = [str(e)]
            if errors:
                problems.append(f"job #{num} ({' '.join(overrides)}):\n  " + "\n  ".join(errors))
        if problems:  # a callback's exceptions are only warned about; SystemExit stops the sweep
            raise SystemExit("error: nothing was submitted:\n" + "\n".join(problems))


def job_overrides(config: DictConfig) -> list[list[str]]:
    """Each job's overrides, in the order Hydra's basic sweeper numbers the jobs."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    arguments = list(OmegaConf.to_container(config.hydra.overrides.task))
    sweeper_params = config.hydra.sweeper.get("params") or {}
    arguments = [f"{k}={v}" for k, v in sweeper_params.items()] + arguments
    parsed = OverridesParser.create().parse_overrides(arguments)
    return BasicSweeper.split_arguments(parsed, None)[0]


def allocation_errors(params: dict[str, Any], cluster: Any) -> list[str]:
    """What the allocation `params` (the launcher's keys) lacks for `cluster`, naming the keys."""
    errors = []
    nodes, gpus, tasks = params.get("nodes"), params.get("gpus_per_node"), params.get("tasks_per_node")
    if nodes is not None and nodes < cluster.num_nodes:
        errors.append(
            f"hydra.launcher.nodes={nodes} is less than cluster.num_nodes={cluster.num_nodes}; "
            f"set hydra.launcher.nodes={cluster.num_nodes} (its default follows cluster.num_nodes)"
        )
    if gpus is not None and gpus < cluster.gpus_per_node:
        errors.append(
            f"hydra.launcher.gpus_per_node={gpus} is less than cluster.gpus_per_node={cluster.gpus_per_node}; "
            f"set hydra.launcher.gpus_per_node={cluster.gpus_per_node} (its default follows cluster.gpus_per_node)"
        )
    if tasks is not None and tasks != 1:
        errors.append(
            f"hydra.launcher.tasks_per_node={tasks}: rlx runs one task per node (Ray places the "
            "processes on it); set hydra.launcher.tasks_per_node=1"
        )
    return errors
