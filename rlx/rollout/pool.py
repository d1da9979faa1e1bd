"""The pool of rollout engines the loop talks to: generation, rewards, weight updates.

Engines run as Ray actors (each serving SGLang's HTTP API); with two or more, requests go
through the real sglang-router. The pool only speaks HTTP to them, so local and SGLang
engines are driven by the same code. The engines themselves, where they listen and which of them
serve, are an `EngineSet` (`rlx.rollout.engines`); with `rollout.fault_tolerance=true` a health
monitor (`rlx.rollout.health`) restarts dead or hung ones there and the pool sends their failed
requests again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time

from rlx import ports
from rlx.reward import load_scorer
from rlx.reward.config import RewardConfig
from rlx.rollout.client import is_engine_failure
from rlx.rollout.config import RolloutConfig
from rlx.rollout.engines import EngineSet
from rlx.rollout.generate import GenerateContext, load_generate_fn
from rlx.rollout.group import (
    append_answer,
    expand,
    request_id,
    restore,
    rollout_metrics,
    sampling_seed,
    snapshot,
)
from rlx.rollout.health import HealthMonitor
from rlx.sample import Sample, Status

log = logging.getLogger(__name__)


class RolloutPool:
    """The driver's HTTP side of the engines: `generate_group` fills one group's responses,
    logprobs, versions, status and rewards; `rlx.rollout.producer` makes batches out of groups.

    Every coroutine runs on the pool's own event loop, in a thread of its own, so a batch can be
    generating (async mode) while the driver's thread trains and publishes weights: `run(coro)`
    waits for a coroutine from any other thread, `submit(coro)` does not."""

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        tokenizer,
        *,
        seed: int,
        reward: RewardConfig,
        actor_options: list[dict] | None = None,
    ):
        """`reward`: the `reward` section (which function or server scores, and how; `rlx.reward`).
        `actor_options`: Ray options per engine (`rlx.placement.plan(...).engines`); default: CPU."""
        self.cfg = cfg
        self.seed = seed
        self.tokenizer = tokenizer
        self.generate_fn = load_generate_fn(cfg.generate_fn) if cfg.generate_fn else None
        # before any engine starts: a reward function that does not import, or a reward server that
        # does not answer, fails here
        self.scorer = load_scorer(reward, rollout=cfg, tokenizer=tokenizer)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlx-rollout", daemon=True)
        self._thread.start()
        self.engines = EngineSet(
            cfg, model_path, seed=seed, api_key=ports.api_key(),  # the run's (`rlx.placement.plan`)
            actor_options=actor_options or [{"num_cpus": 0}] * cfg.num_engines,
        ).start()  # fmt: skip
        self.sampling_params = cfg.sampling_params()
        self._semaphore: asyncio.Semaphore | None = None
        self._queued: set[str] = set()  # request ids waiting for a concurrency slot
        self._retrying: set[str] = set()  # request ids waiting to be sent again (fault tolerance)
        self._cancelled: set[str] = set()  # of the queued or retrying, aborted before they were sent
        self._num_retries = 0  # requests sent again since the last `metrics()`
        self.health: HealthMonitor | None = None
        if cfg.fault_tolerance:
            self.health = HealthMonitor(self.engines, cfg)
            self.run(self.health.start())
        # who brings the engines to new weights: the monitor with fault tolerance (an engine that
        # fails to answer is restarted with them), else the engine set itself
        self._weights = self.health or self.engines

    def metrics(self) -> dict[str, float]:
        """`rollout/engine_restarts` and `rollout/request_retries` since the last call ({} without
        `rollout.fault_tolerance`); call from the driver's thread."""
        if self.health is None:
            return {}

        async def take() -> dict[str, float]:
            counts = {
                "rollout/engine_restarts": self.engines.num_restarts,
                "rollout/request_retries": self._num_retries,
            }
            self.engines.num_restarts = self._num_retries = 0
            return {k: float(v) for k, v in counts.items()}

        return self.run(take())

    def run(self, coro):
        """Run `coro` on the pool's loop and return its result (call from any other thread)."""
        return self.submit(coro).result()

    def submit(self, coro) -> concurrent.futures.Future:
        """Start `coro` on the pool's loop; its future."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    # ---- generation --------------------------------------------------------------------------

    def generate(
        self, prompts: list[Sample], version: int, step: int = 0
    ) -> tuple[list[Sample], dict[str, float]]:
        """n_samples_per_prompt responses per prompt, ordered by (group, index), with rewards, and
        their metrics: one batch with no filter, over-sampling or carry-over (benchmarks, tests).

        Raises RuntimeError naming the first failure when every request failed."""
        start = time.perf_counter()
        groups = [expand(prompt, g, self.cfg.n_samples_per_prompt) for g, prompt in enumerate(prompts)]

        async def all_groups():
            await asyncio.gather(*(self.generate_group(group, step, version) for group in groups))

        self.run(all_groups())
        samples = [s for group in groups for s in group]
        if all(s.status is Status.FAILED for s in samples):
            raise RuntimeError(
                f"every rollout request of step {step} failed; the first: {samples[0].status_reason}"
            )
        return samples, rollout_metrics(samples, time.perf_counter() - start)

    async def generate_group(
        self, group: list[Sample], step: int, version: int, sampling: dict | None = None
    ) -> None:
        """Generate each sample's response, or the rest of it (a partial rollout carried over), in
        one request per group; then reward the group unless it was aborted.

        With one engine (addressed directly), each sample is drawn with its own sampling seed, a
        function of (run seed, `step`, group, index, tokens it already has), so what a sample gets
        does not depend on how the engine batched requests and a seeded run repeats exactly.
        sglang-router 0.3.2 accepts only one `sampling_params` object per batch request, so behind
        the router a group shares the engines' own random streams instead (one seed for all would
        repeat one sample n times). `version`: the engines' version if they do not report one.
        `sampling`: SGLang sampling parameters overriding the run's (evaluation's own settings).
        Request ids are `request_id(sample)`, so `abort` can stop them."""
        todo = [s for s in group if s.status in (Status.PENDING, Status.ABORTED)]
        params = self.sampling_params | (sampling or {})
        if todo and self.generate_fn is not None:
            await self._custom(group, todo, step, version, params)
        elif todo:
            await self._request(todo, step, version, params)
        if not any(s.status is Status.ABORTED for s in group):
            await self.scorer.score_group(group)

    async def _custom(
        self, group: list[Sample], todo: list[Sample], step: int, version: int, sampling: dict
    ) -> None:
        """`rollout.generate_fn` on each sample to generate; fan-out grows the group in place."""

        async def one(s: Sample) -> list[Sample]:
            params = sampling | self._seeded(step, s)
            async with self._semaphore:
                for attempt in itertools.count():
                    saved = snapshot(s) if self.health else None
                    ctx = GenerateContext(self.engines.client, self.tokenizer, self.cfg, version)
                    try:
                        out = await self.generate_fn(ctx, s, params)
                        break
                    except Exception as e:  # a failed sample, not a failed run
                        reason = f"generate_fn raised {type(e).__name__}: {e}"
                        if not await self._retry(e, attempt, [request_id(s)], reason, [s]):
                            return [s]
                        restore(s, saved)  # the engine failed: start the sample over
            return out if isinstance(out, list) else [out]

        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.cfg.max_concurrency)
        results = dict(zip(map(id, todo), await asyncio.gather(*(one(s) for s in todo)), strict=True))
        group[:] = [r for s in group for r in results.get(id(s), [s])]
        for i, s in enumerate(group):
            s.index = i
            if s.status is Status.PENDING:
                s.status, s.status_reason = (
                    Status.FAILED,
                    "generate_fn returned the sample without generating",
                )

    async def _request(self, todo: list[Sample], step: int, version: int, sampling: dict) -> None:
        params: dict | list[dict] = sampling
        max_new = sampling["max_new_tokens"]
        budget = [max_new - s.response_len for s in todo]
        if self.engines.router is None or any(n != max_new for n in budget):
            params = [
                sampling | {"max_new_tokens": n} | self._seeded(step, s)
                for s, n in zip(todo, budget, strict=True)
            ]
        if self._semaphore is None:  # made on the loop it guards
            self._semaphore = asyncio.Semaphore(self.cfg.max_concurrency)
        rids = [request_id(s) for s in todo]
        self._queued.update(rids)
        async with self._semaphore:
            self._queued.difference_update(rids)
            if self._aborted_unsent(rids, todo):
                return
            for attempt in itertools.count():
                try:
                    outs = await self._send(todo, params, rids)
                    break
                except Exception as e:  # a failed request fails its group, not the run
                    if not await self._retry(e, attempt, rids, f"{type(e).__name__}: {e}", todo):
                        return
        for s, out in zip(todo, outs, strict=True):
            append_answer(s, out, version, self.tokenizer)

    async def _send(self, todo: list[Sample], params: dict | list[dict], rids: list[str]) -> list[dict]:
        if isinstance(params, list) and self.engines.router is not None:  # the router takes one params
            outs = await asyncio.gather(
                *(
                    self.engines.client.generate(s.tokens, p, rid=r)
                    for s, p, r in zip(todo, params, rids, strict=True)
                ),
                return_exceptions=True,  # all settled before any is sent again
            )
            if errors := [o for o in outs if isinstance(o, BaseException)]:
                raise errors[0]
            return outs
        # sglang-router 0.3.2 takes no list of request ids: behind it, `abort` aborts all
        batch_rids = rids if self.engines.router is None else None
        return await self.engines.client.generate_batch([s.tokens for s in todo], params, rids=batch_rids)

    async def _retry(
        self, error: Exception, attempt: int, rids: list[str], reason: str, todo: list[Sample]
    ) -> bool:
        """After `error` on attempt `attempt` (from 0): True to send the request again, once an
        engine serves (fault tolerance, an engine failure, `rollout.max_request_retries` not spent);
        else False, with `todo` marked FAILED (or ABORTED if aborted while it waited)."""
        if self.health is None or attempt >= self.cfg.max_request_retries or not is_engine_failure(error):
            for s in todo:
                s.status, s.status_reason = Status.FAILED, reason
            return False
        self._num_retries += 1
        log.warning("request %s failed (%s); sending it again (retry %d)", rids[0], reason, attempt + 1)
        self._retrying.update(rids)
        try:
            await self.health.recover()
        except TimeoutError as e:
            for s in todo:
                s.status, s.status_reason = Status.FAILED, f"{reason}; not sent again: {e}"
            return False
        finally:
            self._retrying.difference_update(rids)
        return not self._aborted_unsent(rids, todo)

    def _aborted_unsent(self, rids: list[str], todo: list[Sample]) -> bool:
        """True (and `todo` marked ABORTED) if `abort` came while these requests waited."""
        if not self._cancelled.intersection(rids):
            return False
        self._cancelled.difference_update(rids)
        for s in todo:
            s.status, s.status_reason = Status.ABORTED, "aborted before it was sent"
        return True

    def _seeded(self, step: int, s: Sample) -> dict:
        """The sample's own sampling seed (`sampling_seed`); none behind the router (see `generate_group`)."""
        return {} if self.engines.router is not None else {"sampling_seed": sampling_seed(self.seed, step, s)}

    async def abort(self, samples: list[Sample]) -> None:
        """Abort the requests of `samples` on every engine (they come back ABORTED with what they
        generated so far; SGLang aborts a live request by its exact id). Requests still waiting
        for a slot under `rollout.max_concurrency` are never sent. Behind the router every running
        request is aborted (as slime does): the others come back aborted too and are carried over
        or restarted like any unfinished group."""
        rids = {request_id(s) for s in samples}
        self._cancelled.update(rids & (self._queued | self._retrying))
        clients = self.engines.live_clients()  # a dead engine: nothing to abort
        tolerant = self.health is not None
        if self.engines.router is not None:  # no request ids behind the router (see `_request`): all of them
            await asyncio.gather(*(c.abort(abort_all=True) for c in clients), return_exceptions=tolerant)
            return
        sent = rids - self._queued - self._retrying
        await asyncio.gather(*(c.abort(r) for r in sent for c in clients), return_exceptions=tolerant)

    # ---- weights, memory and shutdown ---------------------------------------------------------

    def update_weights(self, path: str, version: int) -> None:
        """Every engine loads the HF weight shards at `path` and then serves `version` (with fault
        tolerance: every engine in rotation; one being restarted loads `path` when it is back)."""
        self.run(self._update_weights(path, version))

    def update_weights_in_background(self, path: str, version: int) -> concurrent.futures.Future:
        """`update_weights` started on the pool's loop; its future (the caller goes on meanwhile)."""
        return self.submit(self._update_weights(path, version))

    async def _update_weights(self, path: str, version: int) -> None:
        await self._weights.update_from_disk(path, version)
        await self._weights.confirm_version(version)

    def check_version(self, version: int) -> None:
        """RuntimeError unless every engine now serves `version` (with fault tolerance: every
        engine in rotation; restarted engines waiting for this version rejoin)."""
        self.run(self._weights.confirm_version(version))

    def weight_targets(self) -> list[int]:
        """The engines a pushed weight update must reach (`EngineSet.weight_targets`)."""

        async def targets() -> list[int]:  # read on the loop, where the monitor changes them
            return self.engines.weight_targets()

        return self.run(targets())

    def probe_engines(self) -> None:
        """Fault tolerance: ping every engine now (after a weight push failed), so that a dead one
        is out of `weight_targets()` when the push is tried again."""
        self.run(self.health.probe_now())

    def join_weight_group(
        self, master_address: str, master_port: int, backend: str, engines: list[int] | None = None
    ) -> None:
        """`engines` (default all) join the trainer's broadcast group as ranks 1..N in that order
        (the trainer is rank 0); returns once the group has formed, so the trainer must be joining
        at the same time."""
        self.run(self.engines.join_weight_group(master_address, master_port, backend, engines))

    def leave_weight_group(self, engines: list[int]) -> None:
        """`engines` leave the broadcast group they joined (before it is formed again without the
        ones that failed); with fault tolerance one that fails to answer is left to the monitor."""
        self.run(self.engines.call("destroy_weights_update_group", engines=engines))

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Every engine frees `tags` ("weights", "kv_cache"; all when None): a colocated trainer's
        turn. The health monitor pings none until everything released is resumed."""
        self.run(self.engines.release_memory(tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Every engine allocates `tags` again (all when None)."""
        self.run(self.engines.resume_memory(tags))

    def shutdown(self) -> None:
        """Stop the engines and end their processes (inside `rlx.kept.keep_actors`, hand them back
        when every server stopped cleanly and none was ever replaced: no fault tolerance)."""
        stopped = False
        try:
            if self.health is not None:
                self.run(self.health.stop())
            self.run(self.scorer.aclose())
            if self.engines.router:
                self.engines.router.stop()
            self.run(self.engines.close_clients())
            stopped = self.engines.stop_servers()
        finally:
            self.engines.end_actors(stopped)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
