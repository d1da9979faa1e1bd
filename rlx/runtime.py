"""The training loop: generate, prepare, train, update weights, log, save."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from omegaconf import DictConfig
from tqdm import tqdm

from rlx import checkpoint
from rlx.colocation import GpuTurns
from rlx.config import build
from rlx.config.compose import to_object
from rlx.config.layout import check_gpus
from rlx.config.record import write_run_config
from rlx.config.schema import RlxConfig
from rlx.config.validate import max_prompt_len, validate
from rlx.models.checkpoint_checks import check_checkpoint
from rlx.placement import plan
from rlx.rollout.buffer import RolloutBuffer
from rlx.rollout.pool import RolloutPool
from rlx.rollout.producer import Producer
from rlx.sync import WeightPublisher, choose_method
from rlx.tracking import Tracker
from rlx.trainer.group import TrainerGroup

log = logging.getLogger(__name__)


def run(cfg: DictConfig) -> list[dict[str, float]]:
    """Run `cfg.run.num_rollout` RL steps (rollout.mode: sync or async); return the per-step metrics."""
    job = _prepare(cfg)
    rc, out, data = job.cfg, job.out, job.data
    _start_ray(rc.cluster)
    check_gpus(rc.cluster)
    trainer = pool = tracker = placement = sync = producer = None
    history = []
    try:
        placement = plan(rc.cluster, rc.rollout)  # GPUs reserved for the trainer ranks and engines
        trainer = TrainerGroup(rc, placement.trainer)
        turns = GpuTurns(rc.cluster.colocate, trainer)
        state = _load(job.resume, trainer, data) if job.resume else {"step": -1, "version": 0}
        start_step, version = state["step"] + 1, state["version"]
        turns.before_engines_start()
        turns.pool = pool = RolloutPool(
            rc.rollout, str(job.hf_dir), job.tokenizer, seed=rc.run.seed, actor_options=placement.engines,
            reward=rc.reward,
        )  # fmt: skip
        tracker = Tracker(out, tensorboard=rc.run.tensorboard, dump_rollouts=rc.run.dump_rollouts)
        sync = WeightPublisher(
            trainer, pool, method=choose_method(rc.rollout, rc.cluster), disk_root=out / "weight_sync",
            backend="nccl" if rc.cluster.gpus_per_node else "gloo", bucket_bytes=rc.rollout.weight_bucket_mb << 20,
        )  # fmt: skip
        if job.resume:  # engines start from the restored policy
            turns.to_trainer()
            turns.publish(sync, version)
        producer = Producer(
            rc.rollout, pool, data, RolloutBuffer(), version=version, last_step=rc.run.num_rollout - 1
        )
        if "rollout" in state:
            producer.load_state_dict(state["rollout"])
        bar = tqdm(
            range(start_step, rc.run.num_rollout), desc="rlx", unit="step", disable=not rc.run.progress
        )
        for step in bar:
            step_start = time.perf_counter()
            samples, metrics = producer.batch(step, version)  # async: made while earlier steps trained
            metrics |= turns.to_trainer()
            metrics |= trainer.train(samples)  # old/ref log-probs, advantages, optimizer steps
            version += 1
            if _should_save(rc.run, step):
                _save(trainer, producer, data, out, step, version)
            if version % rc.rollout.update_weights_interval == 0:
                metrics |= turns.publish(sync, version)
                producer.published(version)

            metrics["time/step_s"] = time.perf_counter() - step_start
            metrics["perf/tokens_per_s"] = sum(len(s.tokens) for s in samples) / metrics["time/step_s"]
            metrics["version"] = version
            tracker.write_rollouts(step, samples)
            line = tracker.log(step, metrics)
            bar.write(line) if rc.run.progress else log.info(line)
            history.append({"step": step, **metrics})
        if rc.run.save_hf:
            turns.to_trainer()
            checkpoint.export_hf(trainer, out / "hf", job.hf_dir)
    finally:
        for part in (producer, pool, trainer):
            if part is not None:
                _quietly(part.close if part is producer else part.shutdown)
        if placement is not None:
            _quietly(placement.remove)
        if tracker is not None:
            tracker.close()
        ray.shutdown()
        if sync is not None:
            sync.close()
    return history


@dataclass
class _Job:
    """What `_prepare` checked and built before any process starts."""

    cfg: RlxConfig
    out: Path  # the run directory
    hf_dir: Path  # the policy's HF checkpoint (engines load it; the tiny one is written here)
    tokenizer: Any
    data: Any  # the DataSource
    resume: Path | None  # the checkpoint to continue from


def _prepare(cfg: DictConfig) -> _Job:
    """Everything a user can get wrong, checked before Ray or any model starts."""
    validate(cfg)
    rc = to_object(cfg)
    out = Path(rc.run.output_dir or ".").resolve()  # Ray workers do not share the driver's working directory
    out.mkdir(parents=True, exist_ok=True)
    family = build(rc.model)
    hf_dir = family.checkpoint_dir()
    tokenizer = _load_tokenizer(hf_dir)
    check_checkpoint(family, hf_dir, tokenizer)
    write_run_config(cfg, out, hf_dir)  # config.yaml (what was used) and run_info.json (versions)
    prompt_len = rc.data.max_prompt_len or max_prompt_len(
        rc.model.max_position_embeddings, rc.rollout.max_response_len
    )
    data = build(rc.data, tokenizer, seed=rc.run.seed, max_prompt_len=prompt_len)
    build(rc.algo)  # an algorithm that rejects its options does so here
    resume = checkpoint.find_latest(rc.run.resume_from) if rc.run.resume_from else None
    return _Job(rc, out, hf_dir, tokenizer, data, resume)


def _load(path: Path, trainer: TrainerGroup, data) -> dict:
    """Restore trainer and data position from a checkpoint; its loop state (step, version, rollout)."""
    state = checkpoint.load_state(path)
    trainer.load(str(path / "megatron"))
    data.load_state_dict(state["data"])
    log.info("resumed from %s at step %d (policy version %d)", path, state["step"] + 1, state["version"])
    return state


def _save(trainer: TrainerGroup, producer: Producer, data, out: Path, step: int, version: int) -> None:
    """A checkpoint after `step`: the trainer, and (generation paused) the data position and buffer."""
    producer.pause()
    state = {"step": step, "version": version, "data": data.state_dict(), "rollout": producer.state_dict()}
    checkpoint.save(trainer, out, step, state)
    producer.resume()


def _should_save(run, step: int) -> bool:
    last = step == run.num_rollout - 1
    return run.save and (last or (run.save_interval > 0 and (step + 1) % run.save_interval == 0))


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
        # "local": a Ray of this run's own, never one some other process started on this machine
        ray.init(
            address="local",
            num_cpus=cluster.ray_num_cpus,
            include_dashboard=False,
            logging_level=logging.WARNING,
        )


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as e:  # teardown must go on; the original error (if any) is what matters
        log.warning("teardown: %s: %s", type(e).__name__, e)
