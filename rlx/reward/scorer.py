"""Calling reward functions: every supported form behind one `score_group`, with limits and failures.

`FunctionScorer` adapts a user function (sync or async; per sample or per group; rlx's
`(sample)` or slime's `(args, sample)`), `rlx.reward.remote.RemoteReward` a reward server; both
share `BaseScorer`'s rules for which samples need a reward, what a valid reward is, how a
failure is marked and how it is counted. The contract is written once, in `rlx.reward`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from rlx.errors import ConfigError
from rlx.reward.config import RewardConfig
from rlx.sample import Sample, Status

log = logging.getLogger(__name__)

# Why a reward could not be computed: `sample.metadata["reward_failed"]`, `reward/failed_<reason>`.
FAILURE_REASONS = (
    "raised",  # the function raised
    "timeout",  # the call overran reward.timeout_s
    "not_a_number",  # it returned None, a string, a list, a dict without reward.reward_key, ...
    "not_finite",  # it returned NaN or +-inf
    "wrong_count",  # a group function (or the server) returned a different number of rewards
    "remote_error",  # the reward server refused the request (4xx) or answered something unreadable
    "unavailable",  # the reward server did not answer after reward.max_retries retries
    "no_reward",  # no reward.fn or reward.url, and the generate_fn left sample.reward unset
)
NEVER_TRAINED = ("no_reward",)  # not the model's fault: excluded even with reward.on_failure=zero


class RewardFailure(Exception):
    """A reward that could not be computed; `reason` is one of `FAILURE_REASONS`."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def group_reward(fn: Callable) -> Callable:
    """Declare `fn` a group reward: one call per group, `(samples) -> list[float]` (or slime's
    `(args, samples)`), one reward per sample in order. Same as `reward.scope=group`."""
    fn.__rlx_group_reward__ = True
    return fn


def to_reward(value: Any, reward_key: str | None, sample: Sample) -> float:
    """`value` as a finite float, else RewardFailure. Numbers (bools count as 0/1, numpy scalars and
    one-element tensors as their value) pass; a dict gives `value[reward_key]` and is kept whole in
    `sample.metadata["reward_info"]`."""
    if isinstance(value, dict):
        if reward_key is None or reward_key not in value:
            keys = ", ".join(map(str, list(value)[:8]))
            raise RewardFailure(
                "not_a_number",
                f"returned a dict (keys: {keys}); set reward.reward_key to the key that holds the reward",
            )
        sample.metadata["reward_info"] = value
        value = value[reward_key]
    if value is None or isinstance(value, str | bytes) or not hasattr(value, "__float__"):
        raise RewardFailure("not_a_number", f"returned {_show(value)}, not a number")
    try:
        reward = float(value)
    except (TypeError, ValueError) as e:
        raise RewardFailure("not_a_number", f"returned {_show(value)}, not a number ({e})") from None
    if not math.isfinite(reward):
        raise RewardFailure("not_finite", f"returned {reward}")
    return reward


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


class BaseScorer:
    """Which samples need a reward, setting it, marking failures, counting them per step."""

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg
        self._counts: Counter[str] = Counter()

    async def score_group(self, samples: list[Sample]) -> None:
        """Set `reward` on each sample of one group that needs one (see `rlx.reward`)."""
        todo = [s for s in samples if self._needs_reward(s)]
        if todo:
            await self._score(todo)

    async def _score(self, samples: list[Sample]) -> None:
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        """Counts since the last call (call once per step): `reward/failed_<reason>` for every
        reason, `reward/num_failed`, `reward/num_scored` (got a reward from this scorer),
        `reward/num_preset` (the generate_fn had set it) and what the scorer adds."""
        counts, self._counts = self._counts, Counter()
        out = {f"reward/failed_{r}": float(counts[r]) for r in FAILURE_REASONS}
        out["reward/num_failed"] = float(sum(counts[r] for r in FAILURE_REASONS))
        out |= {f"reward/num_{k}": float(counts[k]) for k in ("scored", "preset", *self._extra_counts)}
        return out

    _extra_counts: tuple[str, ...] = ()

    async def aclose(self) -> None:
        """Release threads and connections; the scorer is not used afterwards."""

    def _needs_reward(self, s: Sample) -> bool:
        if s.status is Status.ABORTED:  # a partial rollout may continue it: scored once it finishes
            return False
        if s.status is Status.FAILED:  # generation failed: nothing to score, keeps its status
            if s.reward is None:
                s.reward = 0.0
            return False
        if s.reward is not None:  # set by the generate_fn
            self._count(s, "preset")
            return False
        return True

    def _set(self, s: Sample, value: Any, source: str) -> None:
        try:
            s.reward = to_reward(value, self.cfg.reward_key, s)
        except RewardFailure as f:
            self._fail(s, RewardFailure(f.reason, f"{source} {f}"))
        else:
            self._count(s, "scored")

    def _fail(self, s: Sample, failure: RewardFailure) -> None:
        """Reward 0, status FAILED with the reason; `exclude` (or `NEVER_TRAINED`) zeroes the loss mask."""
        s.reward = 0.0
        s.status = Status.FAILED
        s.status_reason = f"reward {failure.reason}: {failure}"
        s.metadata["reward_failed"] = failure.reason
        if self.cfg.on_failure == "exclude" or failure.reason in NEVER_TRAINED:
            s.loss_mask = [0] * s.response_len
        self._count(s, failure.reason)

    def _count(self, s: Sample, key: str) -> None:
        """Count for the step's `reward/*`: the rollout's samples; an eval set's are its own
        (`eval/NAME/num_failed`), though the scorer is shared and async rollouts run beside them."""
        if "eval_set" not in s.metadata:
            self._counts[key] += 1


class SlimeArgs(SimpleNamespace):
    """The `args` that a slime-style `reward(args, sample)` receives: the slime argument names
    whose rlx equivalents exist (`rlx.reward.slime_args` lists them); reading any other name
    raises an AttributeError that lists the ones there are."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"args.{name}: rlx passes slime-style reward functions only "
            f"{', '.join(sorted(vars(self)))}; read other settings from sample.metadata or your own config"
        )


def slime_args(path: str, cfg: RewardConfig, rollout: Any = None, *, group: bool = False) -> SlimeArgs:
    """slime's argument names for the composed config values they mean in rlx."""
    values: dict[str, Any] = {
        "custom_rm_path": path,  # reward.fn
        "rm_url": cfg.url,  # reward.url
        "reward_key": cfg.reward_key,  # reward.reward_key
        "group_rm": group,  # reward.scope == group (or @group_reward)
    }
    if rollout is not None:
        values |= {
            "rollout_batch_size": rollout.batch_size,
            "n_samples_per_prompt": rollout.n_samples_per_prompt,
            "rollout_max_response_len": rollout.max_response_len,
            "rollout_temperature": rollout.temperature,
            "rollout_top_p": rollout.top_p,
            "rollout_top_k": rollout.top_k,
        }
    return SlimeArgs(**values)


class FunctionScorer(BaseScorer):
    """A user reward function in any supported form (`rlx.reward` lists them)."""

    def __init__(self, fn: Callable, path: str, cfg: RewardConfig, rollout: Any = None):
        super().__init__(cfg)
        self.fn, self.path = fn, path
        self.group = cfg.scope == "group" or getattr(fn, "__rlx_group_reward__", False)
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004  (an object whose __call__ is async)
        )
        self.args = slime_args(path, cfg, rollout, group=self.group) if _arity(fn, path) == 2 else None
        self._workers = None if self.is_async else _Workers(cfg.num_workers)
        self._slots: asyncio.Semaphore | None = None
        self._slots_loop: asyncio.AbstractEventLoop | None = None

    async def _score(self, samples: list[Sample]) -> None:
        if not self.group:
            await asyncio.gather(*(self._score_one(s) for s in samples))
            return
        try:
            values = await self._call(samples)
            if hasattr(values, "__len__") and not isinstance(values, str | bytes | dict):
                values = list(values)  # a list, tuple, numpy array or tensor of rewards
            if not isinstance(values, list) or len(values) != len(samples):
                got = f"{len(values)} values" if isinstance(values, list) else _show(values)
                raise RewardFailure(
                    "wrong_count", f"{self.path} returned {got} for a group of {len(samples)} samples"
                )
        except RewardFailure as f:
            for s in samples:
                self._fail(s, f)
            return
        for s, value in zip(samples, values, strict=True):
            self._set(s, value, self.path)

    async def _score_one(self, s: Sample) -> None:
        try:
            value = await self._call(s)
        except RewardFailure as f:
            self._fail(s, f)
        else:
            self._set(s, value, self.path)

    async def _call(self, arg: Sample | list[Sample]) -> Any:
        """One call under the concurrency and time limits; RewardFailure if it raises or overruns."""
        args = (arg,) if self.args is None else (self.args, arg)
        try:
            if self.is_async:
                async with self._semaphore():
                    return await asyncio.wait_for(self._guarded(self.fn(*args)), self.cfg.timeout_s)
            # the worker threads bound the calls running at once; the rest wait in their queue
            return await self._workers.run(self.fn, args, self.cfg.timeout_s, self.path)
        except TimeoutError:
            raise RewardFailure(
                "timeout", f"{self.path} took longer than reward.timeout_s={self.cfg.timeout_s}"
            ) from None

    async def _guarded(self, awaitable: Any) -> Any:
        """The function's own exceptions (its own TimeoutError too) as RewardFailure("raised")."""
        try:
            return await awaitable
        except Exception as e:
            raise RewardFailure("raised", f"{self.path} raised {type(e).__name__}: {e}") from e

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._slots_loop is not loop:
            self._slots, self._slots_loop = asyncio.Semaphore(self.cfg.num_workers), loop
        return self._slots

    async def aclose(self) -> None:
        if self._workers is not None:
            self._workers.close()


def _arity(fn: Callable, path: str) -> int:
    """1 for `(sample)` / `(samples)`, 2 for slime's `(args, sample)`; ConfigError otherwise."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called with one argument
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in sig.parameters.values() if p.kind in kinds]
    required = [p for p in positional if p.default is p.empty]
    required_kw = [p for p in sig.parameters.values() if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    takes_varargs = any(p.kind is p.VAR_POSITIONAL for p in sig.parameters.values())
    if not required_kw:
        if len(required) in (1, 2):
            return len(required)
        if not required and (positional or takes_varargs):
            return 1
    raise ConfigError(
        f"reward.fn={path!r} has the signature {sig}; a reward function takes (sample), "
        "slime's (args, sample), or for a group reward (samples) / (args, samples)\n"
        "fix: change the function's parameters to one of these"
    )


class _Job:
    __slots__ = ("loop", "future", "fn", "args", "lock", "started_at", "done", "abandoned")

    def __init__(self, loop, future, fn, args):
        self.loop, self.future, self.fn, self.args = loop, future, fn, args
        self.lock = threading.Lock()
        self.started_at: float | None = None  # time.monotonic() when a worker took it
        self.done = self.abandoned = False


class _Workers:
    """`num_workers` daemon threads running sync reward calls off the event loop.

    Python cannot stop a thread, so a call that overruns its limit keeps running: its thread is
    written off (it exits once the call returns) and a fresh one takes its place, so hung calls
    neither starve the pool nor, being daemon threads, block the interpreter's exit (a
    `ThreadPoolExecutor` would do both).
    """

    def __init__(self, num_workers: int):
        self._jobs: deque[_Job | None] = deque()
        self._ready = threading.Condition()
        self.num_workers = num_workers
        # finished jobs not yet resolved on their loops: a loop is woken once for all of them
        # (one call_soon_threadsafe per burst, not per call: each costs a wake-up of the loop)
        self._finished: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future, tuple]]] = {}
        self._finished_lock = threading.Lock()
        for _ in range(num_workers):
            self._spawn()

    def _spawn(self) -> None:
        threading.Thread(target=self._work, name="rlx-reward", daemon=True).start()

    async def run(self, fn: Callable, args: tuple, timeout_s: float, path: str) -> Any:
        """`fn(*args)` in a worker; TimeoutError once it has run `timeout_s` (time in the queue does
        not count), RewardFailure if it raises."""
        loop = asyncio.get_running_loop()
        job = _Job(loop, loop.create_future(), fn, args)
        with self._ready:
            self._jobs.append(job)
            self._ready.notify()
        try:
            outcome, value = await self._result(job, timeout_s)
        except (TimeoutError, asyncio.CancelledError) as e:  # cancelled: the pool gave up on the group
            with job.lock:
                running = job.started_at is not None and not job.done
                job.abandoned = True  # a worker that has not taken it yet skips it
            if running:  # its thread is stuck in the call: written off, replaced
                if isinstance(e, TimeoutError):
                    log.warning("%s overran reward.timeout_s=%s; its thread is written off", path, timeout_s)
                    self._spawn()
                else:  # after the rest of a cancelled group has been given up (their handlers are
                    # queued before this callback), so that the new thread does not start them
                    loop.call_soon(self._spawn)
            raise
        if outcome == "raised":
            raise RewardFailure("raised", f"{path} raised {type(value).__name__}: {value}") from value
        return value

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._jobs:
                    self._ready.wait()
                job = self._jobs.popleft()
            if job is None:
                return
            with job.lock:
                if job.abandoned:  # given up before it started: nobody waits for it
                    continue
                job.started_at = time.monotonic()
            try:
                result = ("value", job.fn(*job.args))
            except Exception as e:
                result = ("raised", e)
            with job.lock:
                job.done = True
                abandoned = job.abandoned
            if abandoned:
                return
            self._post(job.loop, job.future, result)

    @staticmethod
    async def _result(job: _Job, timeout_s: float) -> tuple:
        """`job`'s result; TimeoutError once it has run longer than `timeout_s` since a worker
        took it (while it waits in the queue, its clock has not started)."""
        wait_s = timeout_s
        while True:
            done, _ = await asyncio.wait((job.future,), timeout=wait_s)
            if done:
                return job.future.result()
            with job.lock:
                started_at = job.started_at
            wait_s = timeout_s if started_at is None else started_at + timeout_s - time.monotonic()
            if wait_s <= 0:
                raise TimeoutError

    def _post(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: tuple) -> None:
        """Hand `result` to `loop`; only the first of a burst wakes it (`_resolve_finished`)."""
        with self._finished_lock:
            waiting = self._finished.setdefault(loop, [])
            waiting.append((future, result))
            wake = len(waiting) == 1
        if wake:
            try:
                loop.call_soon_threadsafe(self._resolve_finished, loop)
            except RuntimeError:  # the loop is closed: nobody waits for these results
                with self._finished_lock:
                    self._finished.pop(loop, None)

    def _resolve_finished(self, loop: asyncio.AbstractEventLoop) -> None:
        with self._finished_lock:
            finished = self._finished.pop(loop, [])
        for future, result in finished:
            _resolve(future, result)

    def close(self) -> None:
        with self._ready:
            self._jobs.extend([None] * self.num_workers)
            self._ready.notify_all()


def _resolve(future: asyncio.Future, result: tuple[str, Any]) -> None:
    if not future.done():
        future.set_result(result)
