"""The pool of rollout engines the loop talks to: generation, rewards, weight updates.

Engines run as Ray actors (each serving SGLang's HTTP API); with two or more, requests go
through the real sglang-router. The pool only speaks HTTP to them, so local and SGLang
engines are driven by the same code. The engines themselves, where they listen and which of them
serve, are an `EngineSet` (`rlx.rollout.engines`); with `rollout.fault_tolerance=true` a health
monitor (`rlx.rollout.health`) restarts dead or hung ones there and the pool's requests
(`rlx.rollout.requests`) are sent again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

from rlx import ports
from rlx.agent.sandbox import close_sandboxes
from rlx.reward import load_scorer
from rlx.reward.config import RewardConfig
from rlx.rollout.config import RolloutConfig
from rlx.rollout.engines import EarlyEngines, EngineSet
from rlx.rollout.generate import load_generate_fn, stop_ids
from rlx.rollout.group import expand, rollout_metrics
from rlx.rollout.health import HealthMonitor
from rlx.rollout.loop_watch import LoopWatch
from rlx.rollout.requests import RequestSender
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
        early: EarlyEngines | None = None,
    ):
        """`reward`: the `reward` section (which function or server scores, and how; `rlx.reward`).
        `actor_options`: Ray options per engine (`rlx.placement.plan(...).engines`); default: CPU.
        `early`: the engines' processes, started ahead (`rlx.rollout.engines.EarlyEngines`)."""
        self.cfg = cfg
        self.seed = seed
        self.tokenizer = tokenizer
        # before any engine starts: a reward function that does not import, or a reward server that
        # does not answer, fails here
        self.scorer = load_scorer(reward, rollout=cfg, tokenizer=tokenizer)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlx-rollout", daemon=True)
        self._thread.start()
        self.watch = LoopWatch(self._loop, self._thread)  # a callback that never yields ends the run
        self.engines = EngineSet(
            cfg, model_path, seed=seed, api_key=ports.api_key(),  # the run's (`rlx.placement.plan`)
            actor_options=actor_options or [{"num_cpus": 0}] * cfg.num_engines, early=early,
        ).start()  # fmt: skip
        self.sampling_params = cfg.sampling_params()
        self.health: HealthMonitor | None = None
        if cfg.fault_tolerance:
            self.health = HealthMonitor(self.engines, cfg)
            self.run(self.health.start())
        generate_fn = load_generate_fn(cfg.generate_fn) if cfg.generate_fn else None
        self.requests = RequestSender(
            cfg, self.engines, tokenizer, seed=seed, health=self.health, generate_fn=generate_fn,
            stop_ids=stop_ids(cfg, tokenizer, model_path),
        )  # fmt: skip
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
                "rollout/request_retries": self.requests.num_retries,
            }
            self.engines.num_restarts = self.requests.num_retries = 0
            return {k: float(v) for k, v in counts.items()}

        return self.run(take())

    def run(self, coro):
        """Run `coro` on the pool's loop and return its result (call from any other thread);
        RolloutLoopBlocked, naming where, once the loop has been stuck in one callback too long."""
        return self.watch.wait(self.submit(coro))

    def wait(self, future: concurrent.futures.Future):
        """The result of a coroutine `submit` started, as `run` waits for it."""
        return self.watch.wait(future)

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
        if todo:
            await self.requests.send(group, todo, step, version, self.sampling_params | (sampling or {}))
        if not any(s.status is Status.ABORTED for s in group):
            await self.scorer.score_group(group)

    async def abort(self, samples: list[Sample]) -> None:
        """Abort the requests of `samples` (`RequestSender.abort`)."""
        await self.requests.abort(samples)

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
        """Stop the engines and end their processes (inside `rlx.actor_reuse.keep_actors`, hand them back
        when every server stopped cleanly and none was ever replaced: no fault tolerance)."""
        stopped = False
        stuck = self.watch.stuck() is not None  # nothing more runs on the loop: what needs none still stops
        try:
            if not stuck:
                if self.health is not None:
                    self.run(self.health.stop())
                self.run(self.scorer.aclose())
                self.run(close_sandboxes())  # the tools' fork servers, before their loop closes
            if self.engines.router:
                self.engines.router.stop()
            if not stuck:
                self.run(self.engines.close_clients())
            stopped = self.engines.stop_servers()
        finally:
            self.engines.end_actors(stopped)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=0 if stuck else 10)
            if not self._thread.is_alive():  # a stuck loop's thread is a daemon: it ends with the process
                self._loop.close()
