"""The training loop: generate, prepare, train, update weights, log, save."""

from __future__ import annotations

import dataclasses
import gc
import logging
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from omegaconf import DictConfig
from tqdm import tqdm

from rlx import checkpoint
from rlx.colocation import GpuTurns
from rlx.config import build
from rlx.config.compose import to_object
from rlx.config.layout import check_gpus
from rlx.config.memory_check import decide_memory
from rlx.config.record import run_dir_summary, write_run_config
from rlx.config.schema import RlxConfig
from rlx.config.validate import run_max_prompt_len, validate_once
from rlx.errors import ConfigError, Stopped, StoppedNow
from rlx.eval import build_eval_sets
from rlx.eval.runner import Evaluator
from rlx.gc_freeze import freeze_startup_objects
from rlx.launcher import ray_start
from rlx.memory import report
from rlx.models.checkpoint_checks import check_checkpoint
from rlx.models.tokenizer import load_tokenizer
from rlx.placement import plan
from rlx.rollout.buffer import RolloutBuffer
from rlx.rollout.engines import EarlyEngines
from rlx.rollout.launchers import checkpoint_errors, for_run
from rlx.rollout.pool import RolloutPool
from rlx.rollout.producer import Producer
from rlx.rollout.replay import DumpReplay
from rlx.tracking import Tracker
from rlx.trainer.config import PRECISION_DTYPES
from rlx.weight_sync.publisher import WeightPublisher, choose_method

if TYPE_CHECKING:  # imported by _start: a config error is reported before Megatron loads (seconds)
    from rlx.trainer.group import TrainerGroup

log = logging.getLogger(__name__)

# model keys that fix the shapes of the saved tensors: a resume that changes one is refused
SHAPE_KEYS = ("_target_", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
              "num_query_groups", "kv_channels", "vocab_size", "tie_word_embeddings", "qk_layernorm",
              "add_qkv_bias", "num_moe_experts", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
              "moe_first_dense_layers", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
              "v_head_dim")  # fmt: skip


def run(cfg: DictConfig) -> list[dict[str, float]]:
    """Run `cfg.run.num_rollout` RL steps (rollout.mode: sync or async); return the per-step metrics.
    SIGTERM or SIGINT ends the run after the step in progress, checkpointed (with run.save), by
    raising `Stopped`; a second signal stops at once."""
    job = _prepare(cfg)
    rc = job.cfg
    parts, history, stop = _Parts(own_ray=ray_start.connect(rc.cluster)), [], None
    try:
        check_gpus(rc.cluster)
        step, version = _start(job, parts)
        freeze_startup_objects(collect=False)  # rlx.gc_freeze; undone when the run ends
        stop = _StopOnSignal()  # from here on a signal lets the step in progress finish
        bar = tqdm(range(step, rc.run.num_rollout), desc="rlx", unit="step", disable=not rc.run.progress)
        for step in bar:
            step_start = time.perf_counter()
            metrics = parts.evaluator.due(step, version)  # data.eval sets every run.eval_interval steps
            samples, rollout = parts.producer.batch(step, version)  # async: made while earlier steps trained
            metrics |= rollout | parts.train(samples, step)  # old/ref log-probs, advantages, optimizer steps
            version += parts.trainer is not None
            if saved := _should_save(rc.run, step):
                _save(job, parts, step, version)
            if version % rc.rollout.update_weights_interval == 0:
                metrics |= parts.publish(version)
            history.append(_log(parts, bar, step, step_start, samples, metrics | {"version": version}))
            if stop.signum:  # SIGTERM/SIGINT during this step
                if rc.run.save and not saved:
                    _save(job, parts, step, version)
                raise Stopped(stop.signum, _stopped_message(job, stop.signum, step))
        _finish(job, parts, version, history)
    finally:
        if stop is not None:
            stop.closing()  # from here a signal waits for the run's processes to end
        try:
            parts.close()
            gc.unfreeze()
        finally:
            if stop is not None:
                stop.restore()
    log.info(run_dir_summary(job.out))  # what the finished run left, its processes gone
    return history


@dataclass
class _Parts:
    """The processes and sinks of a run; a debug mode leaves one side out."""

    own_ray: bool = True  # False: Ray was up before the run (the caller's): close() leaves it up
    placement: Any = None
    trainer: TrainerGroup | None = None  # None: debug.rollout_only
    turns: GpuTurns | None = None
    pool: RolloutPool | None = None  # None: debug.train_only
    sync: WeightPublisher | None = None
    producer: Any = None  # Producer, or DumpReplay (debug.train_only)
    evaluator: Any = None
    tracker: Tracker | None = None
    closers: list = field(default_factory=list)

    def train(self, samples, step: int) -> dict[str, float]:
        if self.trainer is None:
            return {}
        return self.turns.to_trainer() | self.trainer.train(samples, step)

    def publish(self, version: int) -> dict[str, float]:
        if self.trainer is None or self.pool is None:
            return {}
        return self.turns.publish(self.sync, version) | self.sync.metrics()  # producer: sync.on_served

    def close(self) -> None:
        for close in reversed(self.closers):
            _quietly(close)
        if self.own_ray:
            ray.shutdown()


def _start(job: _Job, parts: _Parts) -> tuple[int, int]:
    """Start the trainer, engines and producer (restored from `job.resume`); (first step, version)."""
    from rlx.trainer.group import TrainerGroup

    rc, debug = job.cfg, job.cfg.debug
    engines = replace(rc.rollout, num_engines=0) if debug.train_only else rc.rollout
    parts.placement = plan(rc.cluster, engines)  # GPUs reserved for the trainer ranks and engines
    parts.closers.append(parts.placement.remove)
    state = {"step": -1, "version": 0}
    if not debug.rollout_only:  # its ranks' processes start now, the engines' alongside (unless colocated)
        parts.trainer = TrainerGroup(
            _with_checkpoint_dir(rc, job.hf_dir), parts.placement.trainer, profile_dir=job.out / "profile",
            start=False,
        )  # fmt: skip
        parts.closers.append(parts.trainer.shutdown)
    parts.turns = GpuTurns(
        rc.cluster.colocate and parts.trainer is not None and not debug.train_only,
        parts.trainer,
        rc.cluster.offload_trainer,
        rc.cluster.release_memory,
    )
    parts.tracker = Tracker(
        job.out, loggers=rc.run.loggers, dump_rollouts=rc.run.dump_rollouts, config=dataclasses.asdict(rc),
        name=rc.run.name, project=rc.run.project, tags=rc.run.tags,
    )  # fmt: skip
    parts.closers.append(parts.tracker.close)
    early = None
    if parts.turns.colocated:  # the engines' processes warm up while the trainer sets up on their GPUs
        early = EarlyEngines(rc.rollout, parts.placement.engines, str(job.hf_dir))
        parts.closers.append(early.kill)  # those no pool took
    if debug.train_only or parts.turns.colocated:  # colocated: the trainer sets up before it leaves the GPU
        state = _ready_trainer(job, parts.trainer)
    if debug.train_only:
        parts.producer, parts.evaluator = DumpReplay(debug.load_rollouts), Evaluator(None, {}, rc.rollout, 0)
        return state["step"] + 1, state["version"]
    parts.turns.before_engines_start()
    rollout = for_run(  # the launcher's arguments for this run (rlx.rollout.launchers)
        rc.rollout, colocated=parts.turns.colocated, precision_dtype=PRECISION_DTYPES[rc.train.precision],
        hf_dir=job.hf_dir, gpus=rc.cluster.gpus_per_node > 0,
    )  # fmt: skip
    parts.turns.pool = parts.pool = RolloutPool(
        rollout, str(job.hf_dir), job.tokenizer, seed=rc.run.seed, actor_options=parts.placement.engines,
        reward=rc.reward, early=early,
    )  # fmt: skip
    parts.closers.append(parts.pool.shutdown)
    if parts.trainer is not None and not parts.turns.colocated:
        state = _ready_trainer(job, parts.trainer)
    parts.sync = WeightPublisher(
        parts.trainer, parts.pool, method=choose_method(rc.rollout, rc.cluster), disk_root=job.out / "weight_sync",
        backend="nccl" if rc.cluster.gpus_per_node else "gloo", bucket_bytes=rc.rollout.weight_bucket_mb << 20,
        overlap=rc.rollout.mode == "async",  # disk: engines load while the trainer trains on
    )  # fmt: skip
    parts.closers.append(parts.sync.close)
    if job.resume and parts.trainer is not None:  # engines start from the restored policy
        parts.turns.to_trainer()
        parts.turns.publish(parts.sync, state["version"])
        parts.sync.wait()
    parts.producer = Producer(
        rc.rollout, parts.pool, job.data, RolloutBuffer(), version=state["version"], last_step=rc.run.num_rollout - 1,
        max_failed_frac=rc.run.max_failed_frac,
    )  # fmt: skip
    parts.closers.append(parts.producer.close)
    parts.sync.on_served = parts.producer.published
    if "rollout" in state:
        parts.producer.load_state_dict(state["rollout"])
    parts.evaluator = Evaluator(
        parts.pool,
        job.eval_sets,
        rc.rollout,
        rc.run.eval_interval,
        before=parts.sync.wait,
        set_configs=rc.data.eval,
    )
    return state["step"] + 1, state["version"]


def _log(parts: _Parts, bar, step: int, step_start: float, samples, metrics: dict) -> dict:
    metrics["time/step_s"] = time.perf_counter() - step_start
    metrics["perf/tokens_per_s"] = sum(len(s.tokens) for s in samples) / metrics["time/step_s"]
    parts.tracker.write_rollouts(step, samples)
    line = parts.tracker.log(step, metrics)
    bar.write(line) if bar.disable is False else log.info(line)
    return {"step": step, **metrics}


def _finish(job: _Job, parts: _Parts, version: int, history: list) -> None:
    """After the last step: evaluate the trained policy, export it."""
    rc = job.cfg
    if parts.sync is not None:
        parts.sync.wait()  # the last version's load, if it went on in the background
    if final := parts.evaluator.due(rc.run.num_rollout, version):
        history.append({"step": rc.run.num_rollout, **final})
        log.info(parts.tracker.log(rc.run.num_rollout, final))
    if rc.run.save_hf and parts.trainer is not None:
        parts.turns.to_trainer()
        adapter = _adapter_dir(rc, job.out)
        checkpoint.export_hf(parts.trainer, job.out / "hf", job.hf_dir, adapter)


def _adapter_dir(rc: RlxConfig, out: Path) -> Path | None:
    """Where a LoRA run's adapters go in PEFT's format beside the merged hf/ (None: not LoRA, or a
    model whose adapters peft would load wrong, said once)."""
    from rlx.lora.peft import unsupported

    if not rc.train.lora.enabled:
        return None
    if reason := unsupported(rc.model, rc.train.lora):
        log.warning("run.save_hf: no hf_adapter/: %s", reason)
        return None
    return out / "hf_adapter"


@dataclass
class _Job:
    """What `_prepare` checked and built before any process starts."""

    cfg: RlxConfig
    out: Path  # the run directory
    hf_dir: Path  # the policy's HF checkpoint (engines load it; the tiny one is written here)
    tokenizer: Any
    data: Any  # the DataSource
    eval_sets: dict[str, list]  # data.eval's prompts by set name ({} without run.eval_interval)
    resume: Path | None  # the checkpoint to continue from


def _prepare(cfg: DictConfig) -> _Job:
    """Everything a user can get wrong, checked before Ray or any model starts."""
    validate_once(cfg)  # composing checked it; again only if changed since
    rc = to_object(cfg)
    out = Path(rc.run.output_dir or ".").resolve()  # Ray workers do not share the driver's working directory
    out.mkdir(parents=True, exist_ok=True)
    resume = _find_resume(rc, out)  # before this run's record is written over an `auto` run's
    family = build(rc.model)
    hf_dir = family.checkpoint_dir()
    tokenizer = load_tokenizer(hf_dir)
    check_checkpoint(family, hf_dir, tokenizer)
    if errors := checkpoint_errors(rc.rollout, hf_dir):  # what the rollout's engines cannot serve of it
        raise ConfigError("\n".join(errors))
    write_run_config(cfg, out, hf_dir)  # config.yaml (what was used) and run_info.json (versions)
    prompt_len = run_max_prompt_len(rc)
    data = build(rc.data, tokenizer, seed=rc.run.seed, max_prompt_len=prompt_len)
    eval_sets = build_eval_sets(rc.data, tokenizer, prompt_len) if rc.run.eval_interval else {}
    build(rc.algo)  # an algorithm that rejects its options does so here
    longest = getattr(data, "longest_prompt", None)  # a source of the user's may not say
    if longest is not None:
        longest = max([longest] + [len(s.prompt_ids) for samples in eval_sets.values() for s in samples])
    _plan_memory(rc, longest, prompt_len)
    return _Job(rc, out, hf_dir, tokenizer, data, eval_sets, resume)


def _plan_memory(rc: RlxConfig, longest_prompt: int | None, prompt_limit: int) -> None:
    """A GPU run's decisions by its memory plan (`decide_memory`: the trainer kept or offloaded,
    released or resident, the engines' KV caches sized), logged with the plan: what each GPU will
    hold. The plan counts the longest prompt the data holds (composing knows only
    `data.max_prompt_len`, often unset); the decisions land in `rc`."""
    planned, lines = decide_memory(rc, longest_prompt, prompt_limit)
    if planned is not None:  # a GPU run's first lines: what each GPU will hold
        log.info("%s", report(planned[1]))
    for line in lines:
        log.info("%s", line)


def _with_checkpoint_dir(rc: RlxConfig, hf_dir: Path) -> RlxConfig:
    """`rc` for the trainer ranks: on one node, `model.hf_checkpoint` is the directory `_prepare`
    found, so a rank reads it instead of working out the tiny model's path again (transformers'
    import: 1.5 s of CPU in each new rank process). Ranks on other nodes find their own."""
    if rc.cluster.num_nodes > 1 or rc.model.hf_checkpoint:
        return rc
    return replace(rc, model=replace(rc.model, hf_checkpoint=str(hf_dir)))


def _find_resume(rc: RlxConfig, out: Path) -> Path | None:
    """The checkpoint `run.resume_from` names (None: a fresh start). Refused when no rlx run wrote
    it (a checkpoint is unpickled: `rlx.checkpoint`) and when it was saved with another model shape."""
    resume = checkpoint.find_latest(rc.run.resume_from, out) if rc.run.resume_from else None
    if resume is not None:
        what = f"run.resume_from={rc.run.resume_from} (the checkpoint {resume})"
        checkpoint.check_written_by_rlx(checkpoint.run_dir_of(resume), what)
        _check_resumable(rc, checkpoint.load_state(resume), resume)
    return resume


def _shape(rc: RlxConfig) -> dict[str, Any]:
    """What a checkpoint's tensors depend on: the model's shape keys, whether there is a critic,
    and the optimizer's layout (megatron's distributed optimizer or not)."""
    return {f"model.{k}": getattr(rc.model, k) for k in SHAPE_KEYS} | {
        "critic": build(rc.algo).needs_critic,
        "train.distributed_optimizer": rc.train.distributed_optimizer,
    }


# what a checkpoint saved before a key was recorded had (none could save a distributed optimizer)
_SHAPE_BEFORE_RECORDED = {"train.distributed_optimizer": False}


def _check_resumable(rc: RlxConfig, state: dict, path: Path) -> None:
    saved = state.get("shape")
    if saved is None:
        return
    now = _shape(rc)
    written = {k: saved.get(k, _SHAPE_BEFORE_RECORDED.get(k)) for k in now}
    changed = [f"{k}: {written[k]!r} in the checkpoint, {v!r} now" for k, v in now.items() if written[k] != v]
    if changed:
        raise ConfigError(
            f"run.resume_from: the checkpoint {path} was saved with another model, algorithm or optimizer layout: "
            + "; ".join(changed)
            + ". Resume with the same values (the checkpoint's config.yaml has them), or start fresh without run.resume_from"
        )


def _ready_trainer(job: _Job, trainer: TrainerGroup) -> dict:
    """Set the trainer ranks up (launched earlier) and restore `job.resume` into them; the loop
    state (step, version, and the checkpoint's rollout state)."""
    trainer.start()
    return _load(job, trainer) if job.resume else {"step": -1, "version": 0}


def _load(job: _Job, trainer: TrainerGroup) -> dict:
    """Restore trainer and data position from a checkpoint; its loop state (step, version, rollout)."""
    state = checkpoint.load_state(job.resume)
    trainer.load(str(job.resume / "megatron"))
    job.data.load_state_dict(state["data"])
    log.info(
        "resumed from %s at step %d (policy version %d)", job.resume, state["step"] + 1, state["version"]
    )
    return state


def _save(job: _Job, parts: _Parts, step: int, version: int) -> None:
    """A checkpoint after `step`: the trainer, and (generation paused) the data position and buffer."""
    if parts.trainer is None:
        return
    parts.producer.pause()
    state = {"step": step, "version": version, "data": job.data.state_dict(),
             "rollout": parts.producer.state_dict(), "shape": _shape(job.cfg)}  # fmt: skip
    checkpoint.save(parts.trainer, job.out, step, state, keep=job.cfg.run.keep_checkpoints)
    parts.producer.resume()


def _should_save(run, step: int) -> bool:
    last = step == run.num_rollout - 1
    return run.save and (last or (run.save_interval > 0 and (step + 1) % run.save_interval == 0))


def _stopped_message(job: _Job, signum: int, step: int) -> str:
    name = signal.Signals(signum).name
    if job.cfg.run.save:
        return f"stopped by {name} after step {step}, checkpointed; continue with run.resume_from={job.out}"
    return f"stopped by {name} after step {step} (run.save=false: no checkpoint)"


class _StopOnSignal:
    """SIGTERM/SIGINT: the run finishes its step, checkpoints and stops; a second one stops at once
    (`StoppedNow`). Once the run is ending its processes (`closing`), a signal waits for them: the
    default handler, restored then, killed the driver midway and left Ray's processes running."""

    def __init__(self):
        self.signum = 0
        self._closing = False
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self._closing:  # ending the processes: stopping "at once" would leave them running
            log.warning("%s: the run is already ending its processes", signal.Signals(signum).name)
            return
        if self.signum:  # the second: no more waiting
            name = signal.Signals(signum).name
            raise StoppedNow(
                signum, f"stopped at once by a second {name}: the step in progress was not finished"
            )
        self.signum = signum
        log.warning(
            "%s: stopping after the step in progress (again to stop now)", signal.Signals(signum).name
        )

    def closing(self) -> None:
        self._closing = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _quietly(fn) -> None:
    try:
        fn()
    except Exception as e:  # teardown must go on; the original error (if any) is what matters
        log.warning("teardown: %s: %s", type(e).__name__, e)
