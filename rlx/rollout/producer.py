"""Rollout batches for the loop: prompts become groups, groups are generated through the pool,
filtered (dynamic sampling), over-sampled, and carried over when unfinished; in async mode the
next batches are generated while the trainer trains.

One batch is made in rounds. A round launches `rollout.over_sampling_batch_size` groups (or
`batch_size`), carried-over groups first, then new prompts. Each group is judged as it finishes:
kept, dropped by `rollout.filter_fn`, or (every sample failed) dropped as failed. Once
`batch_size` groups are kept the rest of the round is aborted; each aborted group is carried
over to the next batch with its tokens (`rollout.partial_rollout`) or restarted from its prompt,
so no prompt is lost. Too few kept: another round.

`rollout.mode=sync` makes each batch when the loop asks for it. `rollout.mode=async` makes them
ahead, in the pool's thread, while the loop trains; the trainer trains batch k at policy version
k, and no sample older than `rollout.max_staleness` versions is trained on. With
`staleness_policy=pace`, batch k starts only once the engines serve version >= k -
max_staleness, so none can be too old (the wait is counted); with `drop`, up to max_staleness +
1 batches are generated ahead and too-old groups are dropped when taken (counted). Weight updates
queue behind the requests already running on an engine (SGLang's order), so every response
(or continuation) comes from one version; the versions are per token.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import threading
import time
from collections import Counter

from rlx.config.build import verdict
from rlx.rollout.buffer import RolloutBuffer
from rlx.rollout.config import RolloutConfig
from rlx.rollout.filters import load_filter
from rlx.rollout.group import expand, rollout_metrics
from rlx.rollout.loop_watch import RolloutLoopBlocked
from rlx.rollout.pool import RolloutPool
from rlx.sample import Sample, Status

log = logging.getLogger(__name__)

MAX_BARREN_ROUNDS = 20  # rounds in a row that keep no group before the run stops with the reason


class Producer:
    """`batch(step, train_version)` -> (samples, metrics); `published(version)` after each weight push."""

    def __init__(
        self,
        cfg: RolloutConfig,
        pool: RolloutPool,
        data,
        buffer: RolloutBuffer,
        *,
        version: int,
        last_step: int,
        max_failed_frac: float = 1.0,
    ):
        """`version`: what the engines serve now; `last_step`: the run's last step (async stops there);
        `max_failed_frac`: a round in which at least this fraction of samples failed stops the run."""
        self.cfg, self.pool, self.data, self.buffer = cfg, pool, data, buffer
        self.max_failed_frac = max_failed_frac
        self.filter = load_filter(cfg.filter_fn) if cfg.filter_fn else None
        self.last_step = last_step
        self._served = version
        self._counts: Counter = Counter()  # since the last batch
        self._lock = threading.Lock()
        self._busy_s = 0.0  # generation time since the last batch
        self._window_start = time.perf_counter()
        self._stop = threading.Event()
        self._interrupt: asyncio.Event | None = None  # set: the running batch aborts what is left
        self._version_event: asyncio.Event | None = None
        self._ahead = None  # async: the future of the run-ahead loop

    # ---- the loop's side -------------------------------------------------------------------

    def batch(self, step: int, train_version: int) -> tuple[list[Sample], dict[str, float]]:
        """The `batch_size` groups to train on at `train_version`, flattened in group order."""
        start = time.perf_counter()
        cfg = self.cfg
        if cfg.mode == "sync":
            self.pool.run(self._make(step, cfg.batch_size - self.buffer.num_ready()))
            groups, dropped = self.buffer.take(cfg.batch_size, train_version, None)
        else:
            if self._ahead is None:
                self._ahead = self.pool.submit(self._run_ahead())
            groups, dropped = self._take_async(train_version)
        wait = time.perf_counter() - start
        samples = []
        for g, group in enumerate(groups):
            for s in group:
                s.group = g
                samples.append(s)
        return samples, self._metrics(samples, train_version, dropped, wait)

    def published(self, version: int) -> None:
        """The engines serve `version` now (async batches waiting for it may start)."""
        self._served = version
        if self._version_event is not None:
            self.pool._loop.call_soon_threadsafe(self._version_event.set)

    def pause(self) -> None:
        """Async: stop making batches, abort the one in the making (its groups carried over) and
        wait until nothing is in flight, so the buffer and data position can be saved exactly."""
        if self._ahead is None:
            return
        if self.pool.watch.stuck() is not None:  # nothing on the loop can end now: the run is ending
            self._ahead = None
            return
        self._stop.set()
        if self._interrupt is not None:
            self.pool._loop.call_soon_threadsafe(self._interrupt.set)
        self.pool.wait(self._ahead)
        self._ahead = None

    def resume(self) -> None:
        """Async: make batches again (after `pause`)."""
        self._stop.clear()

    def close(self) -> None:
        self.pause()

    def state_dict(self) -> dict:
        """The buffer's content (call between `pause` and `resume` in async mode)."""
        return self.buffer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.buffer.load_state_dict(state)

    # ---- async -----------------------------------------------------------------------------

    def _take_async(self, train_version: int) -> tuple[list[list[Sample]], int]:
        while True:
            try:
                return self.buffer.take(
                    self.cfg.batch_size, train_version, self.cfg.max_staleness, timeout_s=1.0
                )
            except TimeoutError:
                if self._ahead is not None and self._ahead.done():
                    self._ahead.result()  # the run-ahead loop died: its error is the run's
                    raise RuntimeError("async rollout stopped before the batch was full") from None
                if (stuck := self.pool.watch.stuck()) is not None:
                    raise RolloutLoopBlocked(stuck) from None

    async def _run_ahead(self) -> None:
        """Make batches until the last step's (pace) or until stopped (drop)."""
        cfg = self.cfg
        self._version_event = asyncio.Event()
        while not self._stop.is_set():
            b, need = divmod(self.buffer.groups_in, cfg.batch_size)
            need = cfg.batch_size - need
            if cfg.staleness_policy == "pace":
                if b > self.last_step:
                    return
                waited = await self._wait_for(lambda b=b: self._served >= b - cfg.max_staleness)
                self._count("rollout/paced_s", waited)
                self._count("rollout/paced_batches", waited > 0)
            else:
                room = (cfg.max_staleness + 1) * cfg.batch_size
                await self._wait_for(lambda room=room: self.buffer.num_ready() < room)
            if self._stop.is_set():
                return
            await self._make(b, need)

    async def _wait_for(self, ready) -> float:
        start = time.perf_counter()
        while not ready() and not self._stop.is_set():
            self._version_event.clear()
            try:
                await asyncio.wait_for(self._version_event.wait(), 0.05)
            except TimeoutError:
                pass
        return time.perf_counter() - start

    # ---- making one batch ------------------------------------------------------------------

    async def _make(self, step: int, need: int) -> None:
        """Put `need` more kept groups into the buffer (fewer if interrupted), seeded by `step`."""
        cfg = self.cfg
        self._interrupt = asyncio.Event()
        start = time.perf_counter()
        kept: list[list[Sample]] = []
        launched = barren = 0
        try:
            while len(kept) < need and not self._interrupt.is_set():
                groups = self._round(cfg.over_sampling_batch_size or cfg.batch_size, launched)
                launched += len(groups)
                before = len(kept)
                await self._generate(groups, step, need, kept)
                barren = barren + 1 if len(kept) == before else 0
                if barren >= MAX_BARREN_ROUNDS:
                    raise RuntimeError(self._barren_message(step))
        finally:
            kept.sort(key=lambda group: group[0].group)  # launch order: the same batch every run
            for group in kept[:need]:
                self.buffer.put(group)
            with self._lock:
                self._busy_s += time.perf_counter() - start

    def _round(self, size: int, first: int) -> list[list[Sample]]:
        """`size` groups: carried-over ones first, then new prompts; numbered from `first`."""
        groups = []
        while len(groups) < size and (group := self.buffer.next_carried()) is not None:
            groups.append(group)
            self._count("rollout/partial_resumed", sum(s.status is Status.ABORTED for s in group))
        prompts = self.data.take(size - len(groups)) if len(groups) < size else []
        groups += [expand(p, 0, self.cfg.n_samples_per_prompt) for p in prompts]
        for g, group in enumerate(groups, start=first):
            for s in group:
                s.group = g
        return groups

    async def _generate(self, groups: list[list[Sample]], step: int, need: int, kept: list) -> None:
        """Generate a round's groups, judging each as it finishes; abort the rest once full."""
        tasks = {asyncio.ensure_future(self.pool.generate_group(g, step, self._served)): g for g in groups}
        pending = set(tasks)
        interrupt = asyncio.ensure_future(self._interrupt.wait())
        failed = judged = 0
        try:
            while pending and len(kept) < need and not self._interrupt.is_set():
                done, pending = await asyncio.wait(pending | {interrupt}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(interrupt)
                for task in sorted(done - {interrupt}, key=lambda t: tasks[t][0].group):
                    group = tasks[task]
                    task.result()
                    failed += sum(s.status is Status.FAILED for s in group)
                    judged += len(group)
                    self._judge(group, kept, need)
        except BaseException:  # cancelled (a run stopping at once: `LoopWatch.wait`) or failed
            for task in pending:
                task.cancel()  # their requests too, before the run closes the engines and sessions
            raise
        finally:
            interrupt.cancel()
        self._count("rollout/generated_samples", judged)
        self._count("rollout/failed_samples", failed)
        if failed:
            first = next(s.status_reason for t in tasks for s in tasks[t] if s.status is Status.FAILED)
            if failed / judged >= self.max_failed_frac:
                raise RuntimeError(
                    f"step {step}: {failed} of {judged} samples failed "
                    f"(run.max_failed_frac={self.max_failed_frac}); the first: {first}"
                )
            log.warning(  # said, not only counted: a reward function that raises on some prompts
                "step %d: %d of %d samples failed; groups whose every sample failed are left out and "
                "replaced by new prompts (run.max_failed_frac=%s stops the run at that fraction); the "
                "first: %s",
                step, failed, judged, self.max_failed_frac, first,
            )  # fmt: skip
        if pending:
            self._count("rollout/aborted_groups", len(pending))
            await self.pool.abort([s for t in pending for s in tasks[t]])
            await asyncio.wait(pending)
            for task in pending:
                task.result()
                self._leave(tasks[task])

    def _judge(self, group: list[Sample], kept: list, need: int) -> None:
        if any(s.status is Status.ABORTED for s in group) or len(kept) >= need:
            self._leave(group)  # aborted by someone else, or finished after the batch was full
        elif all(s.status is Status.FAILED for s in group):
            self._count("rollout/failed_groups")
        elif self.filter is not None and not self._keeps(group):
            self._count("rollout/filter_dropped")
        else:
            kept.append(group)

    def _keeps(self, group: list[Sample]) -> bool:
        """`rollout.filter_fn` on a finished group; RuntimeError naming it, the group and its prompt
        where it raises or answers anything but True or False."""
        what = f"rollout.filter_fn={self.cfg.filter_fn!r} (on group {group[0].group}, prompt {str(group[0].prompt)[:80]!r})"
        return verdict(self.filter, group, what, RuntimeError, " (True keeps the group, False drops it)")

    def _leave(self, group: list[Sample]) -> None:
        """An unfinished group: carried over with its tokens, or restarted from its prompt."""
        if self.cfg.partial_rollout:
            self._count("rollout/partial_carried")
            self.buffer.carry(group)
        else:
            self._count("rollout/restarted_groups")
            self.buffer.carry([_restart(s) for s in group])

    def _barren_message(self, step: int) -> str:
        with self._lock:
            counts = dict(self._counts)
        return (
            f"step {step}: {MAX_BARREN_ROUNDS} rounds of generation in a row kept no group "
            f"(filter_fn={self.cfg.filter_fn!r}; counts so far {counts}); the filter rejects "
            "everything the policy generates: check rollout.filter_fn, or the reward function"
        )

    # ---- metrics ---------------------------------------------------------------------------

    def _count(self, key: str, value: float = 1) -> None:
        with self._lock:
            self._counts[key] += value

    def _metrics(
        self, samples: list[Sample], train_version: int, dropped: int, wait: float
    ) -> dict[str, float]:
        cfg = self.cfg
        with self._lock:
            counts, self._counts = dict(self._counts), Counter()
            busy, self._busy_s = self._busy_s, 0.0
        now = time.perf_counter()
        window, self._window_start = max(now - self._window_start, 1e-9), now
        if cfg.mask_old_policy_tokens:
            counts["rollout/masked_old_tokens"] = sum(_mask_old_tokens(s) for s in samples)
        metrics = rollout_metrics(samples, wait if cfg.mode == "sync" else busy)
        staleness = [train_version - s.version for s in samples]
        metrics["rollout/staleness_mean"] = sum(staleness) / max(len(staleness), 1)
        metrics["rollout/staleness_max"] = float(max(staleness, default=0))
        for k, n in sorted(Counter(staleness).items()):
            metrics[f"rollout/staleness_hist/{k}"] = n / len(samples)
        metrics |= {key: float(v) for key, v in counts.items()}
        if generated := counts.get("rollout/generated_samples"):  # the dropped groups' failures too
            metrics["rollout/failed_frac"] = counts.get("rollout/failed_samples", 0) / generated
        metrics |= self.pool.metrics() | self.pool.scorer.metrics()  # engine restarts, reward failures
        if cfg.mode == "async":
            metrics |= {
                "rollout/stale_dropped": float(dropped),
                "time/rollout_wait_s": wait,
                "async/trainer_idle_frac": min(wait / window, 1.0),
                "async/rollout_idle_frac": max(1.0 - busy / window, 0.0),
                "async/overlap_frac": max(busy - wait, 0.0) / window,
            }
        return metrics


def _restart(s: Sample) -> Sample:
    """The sample as it was before generation (its prompt, label, group and index)."""
    fresh = copy.copy(s)
    fresh.metadata = dict(s.metadata)
    fresh.response_ids, fresh.response_text, fresh.rollout_logprobs = [], "", []
    fresh.loss_mask, fresh.token_versions = [], []
    fresh.reward, fresh.status, fresh.status_reason, fresh.version = None, Status.PENDING, "", -1
    return fresh


def _mask_old_tokens(s: Sample) -> int:
    """Zero the loss mask of tokens an older policy generated than the sample's newest; how many."""
    if not s.token_versions:
        return 0
    newest = max(s.token_versions)
    old = [v < newest for v in s.token_versions]
    s.loss_mask = [0 if o else m for o, m in zip(old, s.loss_mask, strict=True)]
    return sum(old)
