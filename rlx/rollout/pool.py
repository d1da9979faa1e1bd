"""The pool of rollout engines the loop talks to: generation, rewards, weight updates.

Engines run as Ray actors (each serving SGLang's HTTP API); with two or more, requests go
through the real sglang-router. The pool only speaks HTTP to them, so local and SGLang
engines are driven by the same code. With `rollout.fault_tolerance=true` a health monitor
(`rlx.rollout.health`) restarts dead or hung engines and the pool sends their failed requests
again; over 400 lines because generation, weights and the engines' lifecycle share its state.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import hashlib
import itertools
import logging
import threading
import time

import ray

from rlx import kept, ports
from rlx.reward import load_scorer
from rlx.reward.config import RewardConfig
from rlx.rollout.client import EngineClient
from rlx.rollout.config import RolloutConfig
from rlx.rollout.engine_actor import EngineActor
from rlx.rollout.generate import GenerateContext, load_generate_fn, read_output
from rlx.rollout.health import HealthMonitor, is_engine_failure
from rlx.rollout.router import Router
from rlx.sample import Sample, Status
from rlx.sglang_api import MEMORY_TAGS

log = logging.getLogger(__name__)


class RolloutPool:
    """Engines, the router and the driver's HTTP side: `generate_group` fills one group's responses,
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
        self.model_path = model_path
        self.api_key = ports.api_key()  # the run's (`rlx.placement.plan`): engines and router require it
        self.actor_options = actor_options or [{"num_cpus": 0}] * cfg.num_engines
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlx-rollout", daemon=True)
        self._thread.start()
        self.actors = [self.launch_engine(i) for i in range(len(self.actor_options))]
        self.router: Router | None = None
        try:
            self.engine_urls = ray.get(
                [a.url.remote() for a in self.actors], timeout=cfg.engine_start_timeout_s
            )
        except BaseException as e:
            for a in self.actors:  # none of them serves this pool; a kept one would idle on
                kept.kill_quietly(a)
            if isinstance(e, ray.exceptions.GetTimeoutError):
                raise RuntimeError(
                    f"the rollout engines did not serve within rollout.engine_start_timeout_s="
                    f"{cfg.engine_start_timeout_s:g} s (each engine's log is in Ray's session logs)"
                ) from None
            raise
        if len(self.engine_urls) >= 2:
            self.router = Router(self.engine_urls, extra_args=dict(cfg.router_args), api_key=self.api_key)
            self.router.start()
        self.url = self.router.url if self.router else self.engine_urls[0]
        self.client = self.new_client(self.url)
        self.engine_clients = [self.new_client(u) for u in self.engine_urls]
        self.sampling_params = cfg.sampling_params()
        self._semaphore: asyncio.Semaphore | None = None
        self._queued: set[str] = set()  # request ids waiting for a concurrency slot
        self._retrying: set[str] = set()  # request ids waiting to be sent again (fault tolerance)
        self._cancelled: set[str] = set()  # of the queued or retrying, aborted before they were sent
        self._num_retries = 0  # requests sent again since the last `metrics()`
        self._released: set[str] = set()  # memory the engines released and have not resumed
        self._retired: list[EngineClient] = []  # clients of engines that were replaced
        self.health: HealthMonitor | None = None
        if cfg.fault_tolerance:
            self.health = HealthMonitor(self)
            self.health.start()

    def launch_engine(self, i: int):
        """An actor for engine `i` (its Ray options and seed), its server starting in the
        background: a new process, or inside `rlx.kept.keep_actors` one an earlier pool handed back."""
        options = self.actor_options[i]
        taken = kept.take("engine", [options])
        args = (self.cfg, self.model_path)
        if taken:  # its `setup` runs before any later call on it (`url` raises a set-up's error)
            taken[0].setup.remote(*args, seed=self.seed + i, api_key=self.api_key)
            return taken[0]
        actor_cls = ray.remote(EngineActor).options(**options)
        return actor_cls.remote(*args, seed=self.seed + i, api_key=self.api_key)

    def new_client(self, url: str) -> EngineClient:
        """A client of the engine or router at `url`, sending the run's key."""
        return EngineClient(url, timeout=self.cfg.request_timeout_s, api_key=self.api_key)

    def install_engine(self, i: int, actor, client: EngineClient, *, serving: bool) -> None:
        """Engine `i` is now `actor`, reached through `client` (a restart: rlx.rollout.health).
        `serving`: it takes requests now (a single engine is addressed directly from now on);
        else only weight updates reach it."""
        # old clients are closed at shutdown: a request still retrying on one would reopen it
        if self.engine_clients[i] is not client:
            self._retired.append(self.engine_clients[i])
            self.actors[i], self.engine_urls[i], self.engine_clients[i] = actor, client.base_url, client
        if serving and self.router is None:
            self._retired.append(self.client)
            self.url, self.client = client.base_url, self.new_client(client.base_url)

    def metrics(self) -> dict[str, float]:
        """`rollout/engine_restarts` and `rollout/request_retries` since the last call ({} without
        `rollout.fault_tolerance`); call from the driver's thread."""
        if self.health is None:
            return {}

        async def take() -> dict[str, float]:
            counts = {
                "rollout/engine_restarts": self.health.num_restarts,
                "rollout/request_retries": self._num_retries,
            }
            self.health.num_restarts = self._num_retries = 0
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
        Request ids are `rid(sample)`, so `abort` can stop them."""
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
                    saved = _snapshot(s) if self.health else None
                    ctx = GenerateContext(self.client, self.tokenizer, self.cfg, version)
                    try:
                        out = await self.generate_fn(ctx, s, params)
                        break
                    except Exception as e:  # a failed sample, not a failed run
                        reason = f"generate_fn raised {type(e).__name__}: {e}"
                        if not await self._retry(e, attempt, [rid(s)], reason, [s]):
                            return [s]
                        _restore(s, saved)  # the engine failed: start the sample over
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
        if self.router is None or any(n != max_new for n in budget):
            params = [
                sampling | {"max_new_tokens": n} | self._seeded(step, s)
                for s, n in zip(todo, budget, strict=True)
            ]
        if self._semaphore is None:  # made on the loop it guards
            self._semaphore = asyncio.Semaphore(self.cfg.max_concurrency)
        rids = [rid(s) for s in todo]
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
            self._fill(s, out, version)

    async def _send(self, todo: list[Sample], params: dict | list[dict], rids: list[str]) -> list[dict]:
        if isinstance(params, list) and self.router is not None:  # the router takes one params
            outs = await asyncio.gather(
                *(
                    self.client.generate(s.tokens, p, rid=r)
                    for s, p, r in zip(todo, params, rids, strict=True)
                ),
                return_exceptions=True,  # all settled before any is sent again
            )
            if errors := [o for o in outs if isinstance(o, BaseException)]:
                raise errors[0]
            return outs
        # sglang-router 0.3.2 takes no list of request ids: behind it, `abort` aborts all
        batch_rids = rids if self.router is None else None
        return await self.client.generate_batch([s.tokens for s in todo], params, rids=batch_rids)

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
        """A 63-bit sampling seed from (run seed, step, group, index[, tokens so far]), distinct per
        sample, step and continuation; none behind the router (see `generate_group`)."""
        if self.router is not None:
            return {}
        key = f"{self.seed}/{step}/{s.group}/{s.index}" + (f"/{s.response_len}" if s.response_len else "")
        seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1
        return {"sampling_seed": seed}

    def _fill(self, s: Sample, out: dict, version: int) -> None:
        """Append one SGLang /generate response to the sample (a continuation extends what it has)."""
        answer = read_output(out, version)
        new = len(answer.ids)
        s.response_ids = s.response_ids + answer.ids
        s.rollout_logprobs = s.rollout_logprobs + answer.logprobs
        s.loss_mask = (s.loss_mask or [1] * (s.response_len - new)) + [1] * new
        s.token_versions = (s.token_versions or [answer.version] * (s.response_len - new)) + [
            answer.version
        ] * new
        s.version = min(s.token_versions, default=answer.version)
        s.response_text = self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
        s.status, s.status_reason = answer.status, ""
        if s.status is Status.ABORTED or not s.response_ids:
            s.status = Status.ABORTED if s.status is Status.ABORTED else Status.FAILED
            s.status_reason = answer.message or "empty response"

    async def abort(self, samples: list[Sample]) -> None:
        """Abort the requests of `samples` on every engine (they come back ABORTED with what they
        generated so far; SGLang aborts a live request by its exact id). Requests still waiting
        for a slot under `rollout.max_concurrency` are never sent. Behind the router every running
        request is aborted (as slime does): the others come back aborted too and are carried over
        or restarted like any unfinished group."""
        rids = {rid(s) for s in samples}
        self._cancelled.update(rids & (self._queued | self._retrying))
        clients, tolerant = self._live_clients(), self.health is not None  # a dead engine: nothing to abort
        if self.router is not None:  # no request ids behind the router (see `_request`): all of them
            await asyncio.gather(*(c.abort(abort_all=True) for c in clients), return_exceptions=tolerant)
            return
        sent = rids - self._queued - self._retrying
        await asyncio.gather(*(c.abort(r) for r in sent for c in clients), return_exceptions=tolerant)

    def _live_clients(self) -> list[EngineClient]:
        """The clients of the engines in rotation (all of them without fault tolerance)."""
        if self.health is None:
            return list(self.engine_clients)
        return [self.engine_clients[i] for i in sorted(self.health.serving)]

    # ---- weights and lifecycle ---------------------------------------------------------------

    def update_weights(self, path: str, version: int) -> None:
        """Every engine loads the HF weight shards at `path` and then serves `version` (with fault
        tolerance: every engine in rotation; one being restarted loads `path` when it is back)."""
        self.run(self._update_weights(path, version))

    def update_weights_in_background(self, path: str, version: int) -> concurrent.futures.Future:
        """`update_weights` started on the pool's loop; its future (the caller goes on meanwhile)."""
        return self.submit(self._update_weights(path, version))

    async def _update_weights(self, path: str, version: int) -> None:
        if self.health is not None:
            await self.health.update_from_disk(path, version)
        else:
            await self._on_engines("update_weights_from_disk", path, weight_version=str(version))
        await self._check_version(version)

    def check_version(self, version: int) -> None:
        """RuntimeError unless every engine now serves `version` (with fault tolerance: every
        engine in rotation; restarted engines waiting for this version rejoin)."""
        self.run(self._check_version(version))

    async def _check_version(self, version: int) -> None:
        if self.health is not None:
            await self.health.confirm_version(version)
            return
        served = await self._on_engines("get_weight_version")
        if any(v != str(version) for v in served):
            raise RuntimeError(f"engines serve versions {served} after updating to {version}")

    def weight_targets(self) -> list[int]:
        """The engines a pushed weight update must reach: all of them, or with fault tolerance those
        in rotation and those restarted and waiting for it (one still restarting is left out)."""
        if self.health is None:
            return list(range(len(self.engine_clients)))

        async def targets() -> list[int]:  # read on the loop, where the monitor changes them
            return sorted(self.health.serving | self.health.behind)

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
        engines = list(range(len(self.engine_clients))) if engines is None else engines
        world_size = 1 + len(engines)
        joins = [
            self.engine_clients[i].init_weights_update_group(
                master_address, master_port, 1 + k, world_size, backend
            )
            for k, i in enumerate(engines)
        ]

        async def all_join():
            await asyncio.gather(*joins)

        self.run(all_join())

    def leave_weight_group(self, engines: list[int]) -> None:
        """`engines` leave the broadcast group they joined (before it is formed again without the
        ones that failed); with fault tolerance one that fails to answer is left to the monitor."""
        self.run(self._on_engines("destroy_weights_update_group", engines=engines))

    def release_memory(self, tags: list[str] | None = None) -> None:
        """Every engine frees `tags` ("weights", "kv_cache"; all when None): a colocated trainer's turn."""
        self._released |= set(tags or MEMORY_TAGS)
        if self.health is not None:
            self.health.paused = True  # until everything released is resumed
        self.run(self._on_engines("release_memory_occupation", tags))

    def resume_memory(self, tags: list[str] | None = None) -> None:
        """Every engine allocates `tags` again (all when None)."""
        self.run(self._on_engines("resume_memory_occupation", tags))
        self._released -= set(tags or MEMORY_TAGS)
        if self.health is not None and not self._released:  # no probe sees a half-resumed engine
            self.health.paused = False

    async def _on_engines(self, method: str, *args, engines: list[int] | None = None, **kwargs) -> list:
        """Call one client method on every engine at once, or on `engines` (with fault tolerance:
        every engine in rotation; one that fails to answer is left to the health monitor)."""
        clients = self._live_clients() if engines is None else [self.engine_clients[i] for i in engines]
        calls = (getattr(c, method)(*args, **kwargs) for c in clients)
        results = await asyncio.gather(*calls, return_exceptions=self.health is not None)
        for r in results:
            if isinstance(r, BaseException) and not is_engine_failure(r):
                raise r
        return results

    def shutdown(self) -> None:
        """Stop the engines and end their processes (inside `rlx.kept.keep_actors`, hand them back
        when every server stopped cleanly and none was ever replaced: no fault tolerance)."""
        stopped = []
        try:
            if self.health is not None:
                self.run(self.health.stop())
            self.run(self.scorer.aclose())
            if self.router:
                self.router.stop()
            for c in [self.client, *self.engine_clients, *self._retired]:
                self.run(c.aclose())
            stops = [a.shutdown.remote() for a in self.actors]
            if self.health is None:
                ray.get(stops, timeout=30)
                stopped = self.actors  # each process is idle now, for another pool to set up again
            else:  # an engine that died meanwhile has nothing to stop
                ray.wait(stops, num_returns=len(stops), timeout=30)
        finally:
            if stopped and kept.keeping(self.actor_options):
                kept.hand_back("engine", self.actor_options, stopped)
            else:
                for a in self.actors:
                    ray.kill(a)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()


def expand(prompt: Sample, group: int, n: int) -> list[Sample]:
    """The `n` samples of one prompt's group, numbered (group, 0..n-1)."""
    samples = []
    for i in range(n):
        s = copy.copy(prompt)
        s.metadata = dict(prompt.metadata)
        s.group, s.index = group, i
        samples.append(s)
    return samples


def _snapshot(s: Sample) -> dict:
    """A sample's fields (lists and dicts copied), for `_restore` after a failed engine."""
    return {name: copy.copy(getattr(s, name)) for name in Sample.__slots__}


def _restore(s: Sample, saved: dict) -> None:
    for name, value in saved.items():
        setattr(s, name, value)


def rid(s: Sample) -> str:
    """The request id of a sample's next generation request: unique among live requests."""
    return f"rlx-{id(s):x}-{s.group}-{s.index}-{s.response_len}"


def rollout_metrics(samples: list[Sample], elapsed: float) -> dict[str, float]:
    """rollout/* and time/perf figures of one batch's samples."""
    n = max(len(samples), 1)
    num_tokens = sum(s.response_len for s in samples)
    count = {st: sum(s.status == st for s in samples) for st in Status}
    return {
        "rollout/reward_mean": sum(s.reward or 0.0 for s in samples) / n,
        "rollout/response_len_mean": num_tokens / n,
        "rollout/truncated_frac": count[Status.TRUNCATED] / n,
        "rollout/failed_frac": (count[Status.FAILED] + count[Status.ABORTED]) / n,
        "rollout/num_tokens": float(num_tokens),
        "rollout/num_prompt_tokens": float(sum(len(s.prompt_ids) for s in samples)),
        "time/rollout_s": elapsed,
        "perf/rollout_tokens_per_s": num_tokens / max(elapsed, 1e-9),
    }
