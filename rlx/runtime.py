"""The training loop: generate, prepare, train, update weights, log, save."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import ray
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from rlx.config import build, to_object
from rlx.config.validate import validate
from rlx.rollout.pool import RolloutPool
from rlx.tracking import Tracker
from rlx.trainer.group import TrainerGroup

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> list[dict[str, float]]:
    """Run `cfg.run.num_rollout` synchronous RL steps; return the per-step metrics."""
    validate(cfg)
    rc = to_object(cfg)
    out = Path(rc.run.output_dir or ".").resolve()  # Ray workers do not share the driver's working directory
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / "config.yaml", resolve=True)

    # Everything a user can get wrong is checked here, before Ray or any model starts.
    family = build(rc.model)
    hf_dir = family.checkpoint_dir()
    family.check_hf_config(hf_dir)
    tokenizer = _load_tokenizer(hf_dir)
    max_prompt_len = rc.data.max_prompt_len or rc.model.max_position_embeddings - rc.rollout.max_response_len
    data = build(rc.data, tokenizer, seed=rc.run.seed, max_prompt_len=max_prompt_len)
    build(rc.algo)  # an algorithm that rejects its options does so here, before Ray starts

    _start_ray(rc.cluster)
    trainer = pool = tracker = None
    history = []
    try:
        trainer = TrainerGroup(rc, num_procs=rc.cluster.num_trainer_procs)
        pool = RolloutPool(rc.rollout, str(hf_dir), tokenizer, seed=rc.run.seed)
        tracker = Tracker(out, tensorboard=rc.run.tensorboard, dump_rollouts=rc.run.dump_rollouts)
        sync_dir = out / "weight_sync"
        version = 0
        bar = tqdm(
            range(rc.run.num_rollout),
            desc="rlx",
            unit="step",
            disable=not rc.run.progress,
            dynamic_ncols=True,
        )
        for step in bar:
            step_start = time.perf_counter()
            samples, metrics = pool.generate(data.take(rc.rollout.batch_size), version)
            metrics |= trainer.train(samples)  # log-probs, advantages, optimizer steps

            sync_start = time.perf_counter()
            version += 1
            path = trainer.export_weights(str(sync_dir / f"v{version:06d}"))
            pool.update_weights(path, version)
            shutil.rmtree(sync_dir / f"v{version - 1:06d}", ignore_errors=True)
            metrics["time/weight_sync_s"] = time.perf_counter() - sync_start

            metrics["time/step_s"] = time.perf_counter() - step_start
            metrics["perf/tokens_per_s"] = sum(len(s.tokens) for s in samples) / metrics["time/step_s"]
            metrics["version"] = version
            tracker.write_rollouts(step, samples)
            line = tracker.log(step, metrics)
            bar.write(line) if rc.run.progress else log.info(line)
            history.append({"step": step, **metrics})
    finally:
        for part in (pool, trainer):
            if part is not None:
                _quietly(part.shutdown)
        if tracker is not None:
            tracker.close()
        ray.shutdown()
        shutil.rmtree(out / "weight_sync", ignore_errors=True)  # transient: only engines read it
    return history


def _load_tokenizer(hf_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(hf_dir))


def _start_ray(cluster) -> None:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        return
    if cluster.ray_address:
        ray.init(address=cluster.ray_address, logging_level=logging.WARNING)
    else:
        ray.init(num_cpus=cluster.ray_num_cpus, include_dashboard=False, logging_level=logging.WARNING)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as e:  # teardown must go on; the original error (if any) is what matters
        log.warning("teardown: %s: %s", type(e).__name__, e)
