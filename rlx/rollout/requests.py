"""Sending samples' generation requests to the engines: one batch request per group (or the
user's `rollout.generate_fn` per sample) under `rollout.max_concurrency`, sent again after an
engine failure with fault tolerance, and aborted by request id. The pool (`rlx.rollout.pool`)
owns the engines, the loop and the rewards; this is what travels between them."""

from __future__ import annotations

import asyncio
import itertools
import logging
import reprlib
from collections.abc import Collection

from rlx.rollout.client import is_engine_failure
from rlx.rollout.config import RolloutConfig
from rlx.rollout.engines import EngineSet
from rlx.rollout.generate import GenerateContext
from rlx.rollout.group import append_answer, request_id, restore, sampling_seed, snapshot
from rlx.rollout.health import HealthMonitor
from rlx.sample import Sample, Status

log = logging.getLogger(__name__)


class RequestSender:
    """Runs on the pool's event loop. `send` fills a group's responses; `abort` stops them."""

    def __init__(
        self,
        cfg: RolloutConfig,
        engines: EngineSet,
        tokenizer,
        *,
        seed: int,
        health: HealthMonitor | None,
        generate_fn=None,
        stop_ids: Collection[int] = frozenset(),
    ):
        self.cfg, self.engines, self.tokenizer, self.seed = cfg, engines, tokenizer, seed
        self.stop_ids = frozenset(stop_ids)  # what ends a response (`rlx.rollout.generate.stop_ids`)
        self.health = health  # None without rollout.fault_tolerance: a failed request fails its group
        self.generate_fn = generate_fn
        self._semaphore: asyncio.Semaphore | None = None  # made on the loop it guards
        self._queued: set[str] = set()  # request ids waiting for a concurrency slot
        self._retrying: set[str] = set()  # request ids waiting to be sent again (fault tolerance)
        self._cancelled: set[str] = set()  # of the queued or retrying, aborted before they were sent
        self.num_retries = 0  # requests sent again since the pool's last `metrics()`

    async def send(
        self, group: list[Sample], todo: list[Sample], step: int, version: int, sampling: dict
    ) -> None:
        """Generate `todo` (samples of `group`) with SGLang `sampling` parameters: through
        `rollout.generate_fn` when set (its fan-out grows `group` in place), else as one request."""
        if self.generate_fn is not None:
            await self._custom(group, todo, step, version, sampling)
        else:
            await self._request(todo, step, version, sampling)

    async def _custom(
        self, group: list[Sample], todo: list[Sample], step: int, version: int, sampling: dict
    ) -> None:
        """`rollout.generate_fn` on each sample to generate; fan-out grows the group in place."""

        async def one(s: Sample) -> list[Sample]:
            params = sampling | self._seeded(step, s)
            async with self._semaphore:
                for attempt in itertools.count():
                    saved = snapshot(s) if self.health else None
                    ctx = GenerateContext(
                        self.engines.client, self.tokenizer, self.cfg, version, self.stop_ids
                    )
                    limit = self.cfg.generate_timeout_s
                    try:
                        async with asyncio.timeout(limit) as deadline:
                            out = await self.generate_fn(ctx, s, params)
                        break
                    except Exception as e:  # a failed sample, not a failed run
                        if isinstance(e, TimeoutError) and deadline.expired():  # not retried
                            s.status = Status.FAILED
                            s.status_reason = (
                                f"generate_fn did not finish within rollout.generate_timeout_s={limit:g} s "
                                "(cancelled)"
                            )
                            return [s]
                        reason = f"generate_fn raised {type(e).__name__}: {e}"
                        if not await self._retry(e, attempt, [request_id(s)], reason, [s]):
                            return [s]
                        restore(s, saved)  # the engine failed: start the sample over
            outs = out if isinstance(out, list) else [out]
            if not outs or not all(isinstance(o, Sample) for o in outs):
                s.status = Status.FAILED
                s.status_reason = f"generate_fn returned {_shown(out)}, not the sample or a list of samples"
                return [s]
            for o in outs:
                if (reason := _misaligned(o)) is not None:
                    o.status, o.status_reason = Status.FAILED, reason
            return outs

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
            append_answer(s, out, version, self.tokenizer, self.stop_ids, self.cfg.stop)

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
        self.num_retries += 1
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


def _misaligned(s: Sample) -> str | None:
    """Why a generate_fn's sample cannot be trained as it is: a per-token list (loss mask, logprobs,
    versions) that is set but not one entry a response token; None when none is."""
    for name in ("loss_mask", "rollout_logprobs", "token_versions"):
        if (values := getattr(s, name)) and len(values) != s.response_len:
            return (
                f"generate_fn left sample.{name} with {len(values)} entries for {s.response_len} response "
                "tokens; append tokens with ctx.append_output / ctx.append_tokens, which keep them aligned"
            )
    return None


def _shown(value) -> str:
    """A returned value named for a message: its type and a short repr."""
    return "an empty list" if value == [] else f"{type(value).__name__} {reprlib.repr(value)}"
