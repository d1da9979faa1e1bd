"""What `launch.py` runs for each Hydra job, on every node the job has.

A plain run (`python launch.py ...`) raises what the run raises. In a sweep (`-m`), a job never
raises: it returns its outcome, so one bad job leaves the others running (Hydra's sweeper
re-raises the first failed job once its batch is done, and a SystemExit from `sys.exit` would end
the whole sweep at once), and `rlx.launcher.sweep.SweepSummary` records it.
"""

from __future__ import annotations

import logging
import os
import traceback
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from rlx.config.compose import to_object
from rlx.config.from_checkpoint import apply_checkpoint
from rlx.config.memory_check import print_plan
from rlx.config.validate import run_max_prompt_len, validate
from rlx.errors import UserError
from rlx.launcher import nodes

log = logging.getLogger(__name__)

COMPLETED, FAILED = "completed", "failed"


def run_job(cfg: DictConfig) -> dict[str, Any] | None:
    """Run one job on this node; in a sweep return {"status": ..., "error": ...} instead of raising."""
    hydra_cfg = HydraConfig.get()
    if cfg.run.output_dir is None:
        cfg.run.output_dir = hydra_cfg.runtime.output_dir
    overrides = list(hydra_cfg.overrides.task)
    if hydra_cfg.mode != RunMode.MULTIRUN:
        run_on_nodes(cfg, overrides)
        return None
    try:
        role = run_on_nodes(cfg, overrides)
    except Exception as e:  # every failure is this job's outcome, not the sweep's
        log.error("job failed: %s", e if isinstance(e, UserError) else traceback.format_exc())
        return {"status": FAILED, "error": f"{type(e).__name__}: {e}"}
    return {"status": COMPLETED if role.writes_results else "worker"}


def run_on_nodes(cfg: DictConfig, overrides: list[str] | None = None) -> nodes.NodeRole:
    """Run `cfg` as this node's part of the job: alone, as the Ray head and driver, or as a worker.
    `overrides`: the job's command-line overrides (which model keys the user set)."""
    apply_checkpoint(cfg, overrides or [])  # the model from model.hf_checkpoint's config.json
    validate(cfg)  # on every node, so a bad config never leaves workers waiting for a head
    if cfg.run.plan_only:  # the memory plan alone: no Ray, no process started
        rc = to_object(cfg)
        print_plan(rc, run_max_prompt_len(rc))
        return nodes.node_role(os.environ)
    from rlx.runtime import run  # ray, torch, transformers: seconds, after validation

    role = nodes.node_role(os.environ)
    nodes.check_allocation(role, cfg.cluster, os.environ)
    timeout_s = cfg.cluster.ray_join_timeout_s
    if role.kind == "single":
        run(cfg)
    elif role.kind == "worker":
        nodes.join(role, cfg.run.output_dir, timeout_s)
    else:
        address, ray_head = nodes.start_head(role, cfg.run.output_dir, timeout_s)
        try:
            cfg.cluster.ray_address = address
            run(cfg)
        finally:
            nodes.stop(ray_head)
    return role
