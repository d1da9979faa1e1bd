"""The rollout engines as one set: the one owner of their state.

`EngineSet` holds each engine's Ray actor (`EngineActor`), URL and client; sglang-router in front
of two or more (`url` and `client` are the front door: the router, or the one engine); which
engines are in rotation, restarting, restarted and waiting for the next publish (`behind`), or
given up; the weights last published (a directory, or pushed by the trainer) and the version;
the memory the engines released; how many restarts finished. The pool (`rlx.rollout.pool`) sends
requests and weight updates through it; the health monitor (`rlx.rollout.health`) pings the
engines it lists and records its restarts in it. Without `rollout.fault_tolerance` every engine
stays in rotation for good. Its coroutines run on the pool's event loop, where the monitor runs.
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from rlx import actor_reuse, process_clock
from rlx.rollout.client import EngineClient, is_engine_failure
from rlx.rollout.config import RolloutConfig
from rlx.rollout.engine_actor import EngineActor
from rlx.rollout.router import Router, finish_import_check, start_import_check
from rlx.sglang_api import MEMORY_TAGS

log = logging.getLogger(__name__)


def _slowest_start(starts: list[dict], asked: float) -> str:
    """The start-up log's account of the engine whose set-up took longest, from its
    `EngineActor.startup` times and `asked`, when the pool started the engines."""
    s = max(starts, key=lambda s: s["loaded"] + (s["setup_s"] or 0.0))
    setup = f"its set-up (imports, the model, the server) {s['setup_s'] or 0.0:.1f} s"
    how = process_clock.origin(s["started"], s["loaded"], asked)
    if how == "kept":  # started before the pool: early (warmed up), or kept from a run
        ahead = (
            "" if s["warm_up_s"] is None else f", after a warm-up of {s['warm_up_s']:.1f} s before the pool"
        )
        return f" (the slowest engine: {setup}{ahead})"
    first = "an idle Ray worker taking it" if how == "pooled" else "a new process, Python and Ray"
    return f" (the slowest engine: {first} {s['loaded'] - asked:.1f} s, then {setup})"


class EarlyEngines:
    """Engine processes started before their set-up, each warming up meanwhile (its launcher's
    imports and device context: `EngineLauncher.warm_up`): a colocated run's engines, while the
    trainer sets up on their GPUs. The pool's `EngineSet` takes them (`take`) and sets them up;
    `kill()` ends those never taken (a run that failed before its pool started)."""

    def __init__(self, cfg: RolloutConfig, actor_options: list[dict], model_path: str):
        self.options = actor_options
        taken = actor_reuse.take("engine", actor_options)  # kept processes are warm already
        started = [ray.remote(EngineActor).options(**o).remote() for o in actor_options[len(taken) :]]
        for a in started:
            a.warm_up.remote(cfg._target_, model_path, cfg.engine_args.get("tokenizer_path"))
        self.actors: list | None = taken + started

    def take(self, options: list[dict]) -> list:
        """The processes, once, for engines placed as `options` (the ones they were started for)."""
        if self.actors is None or options != self.options:
            return []
        actors, self.actors = self.actors, None
        return actors

    def kill(self) -> None:
        for a in self.take(self.options):
            actor_reuse.kill_quietly(a)


class EngineSet:
    """The engines of one pool: `start()` launches them (and the router), `shutdown` ends them.

    Engine `i` is `actors[i]` serving at `urls[i]`, reached through `clients[i]`; a restart
    replaces all three (`install`). `serving`: the engines in rotation (behind the router, or the
    one engine); `behind`: restarted, waiting for the next publish (tensor/distributed weights);
    `restarting`: being restarted; `given_up`: engine -> why its restarts failed."""

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        *,
        seed: int,
        api_key: str | None,
        actor_options: list[dict],
        early: EarlyEngines | None = None,
    ):
        """`api_key`: the run's, which the engines and the router require; `actor_options`: Ray
        options per engine (`rlx.placement.plan(...).engines`); `early`: processes already started
        for them, which `start` sets up."""
        self.cfg, self.model_path, self.seed, self.api_key = cfg, model_path, seed, api_key
        self.actor_options = actor_options
        self._early = early.take(actor_options) if early is not None else []
        self.tolerant = cfg.fault_tolerance  # an engine that fails to answer is left to the monitor
        self.actors: list = []
        self.urls: list[str] = []
        self.clients: list[EngineClient] = []
        self.router: Router | None = None
        self.url = ""  # the front door: the router's, or the one engine's
        self.client: EngineClient | None = None
        self._retired: list[EngineClient] = []  # clients of engines that were replaced
        num = len(actor_options)
        self.serving: set[int] = set(range(num))
        self.behind: set[int] = set()
        self.restarting: set[int] = set()
        self.given_up: dict[int, str] = {}
        self.failed_pings = [0] * num  # in a row
        self.num_restarts = 0  # finished restarts, read and reset by the pool's metrics()
        self.weights_path: str | None = None  # the directory the published version was loaded from
        self.version: int | None = None  # the published version; None: none since the engines started
        self.released: set[str] = set()  # memory the engines released and have not resumed

    def start(self) -> EngineSet:
        """Launch every engine, wait until each serves, start the router in front of two or more."""
        began = time.perf_counter()
        router_check = start_import_check() if len(self.actor_options) >= 2 else None
        self.actors = [self.launch(i) for i in range(len(self.actor_options))]
        self._early = []  # a restart (`launch` again) starts a new process
        try:
            if router_check is not None:  # before the engines' minutes of loading, not after
                finish_import_check(router_check)
            self.urls = ray.get(
                [a.url.remote() for a in self.actors], timeout=self.cfg.engine_start_timeout_s
            )
        except BaseException as e:
            for a in self.actors:  # none of them serves this pool; a kept one would idle on
                actor_reuse.kill_quietly(a)
            if isinstance(e, ray.exceptions.GetTimeoutError):
                raise RuntimeError(
                    f"the rollout engines did not serve within rollout.engine_start_timeout_s="
                    f"{self.cfg.engine_start_timeout_s:g} s (each engine's log is in Ray's session logs)"
                ) from None
            raise
        took = time.perf_counter() - began
        starts = ray.get([a.startup.remote() for a in self.actors], timeout=self.cfg.engine_start_timeout_s)
        log.info("%d engine%s serving in %.1f s%s", len(self.urls), "s" * (len(self.urls) > 1), took,
                 _slowest_start(starts, time.time() - took))  # fmt: skip
        if len(self.urls) >= 2:
            self.router = Router(self.urls, extra_args=dict(self.cfg.router_args), api_key=self.api_key)
            self.router.start()
        self.url = self.router.url if self.router else self.urls[0]
        self.client = self.new_client(self.url)
        self.clients = [self.new_client(u) for u in self.urls]
        return self

    def launch(self, i: int):
        """An actor for engine `i` (its Ray options and seed), its server starting in the
        background: a new process, one started early (`EarlyEngines`), or inside
        `rlx.actor_reuse.keep_actors` one an earlier pool handed back."""
        options = self.actor_options[i]
        taken = [self._early[i]] if i < len(self._early) else actor_reuse.take("engine", [options])
        args = (self.cfg, self.model_path)
        if taken:  # its `setup` runs before any later call on it (`url` raises a set-up's error)
            taken[0].setup.remote(*args, seed=self.seed + i, api_key=self.api_key)
            return taken[0]
        actor_cls = ray.remote(EngineActor).options(**options)
        return actor_cls.remote(*args, seed=self.seed + i, api_key=self.api_key)

    def new_client(self, url: str) -> EngineClient:
        """A client of the engine or router at `url`, sending the run's key."""
        return EngineClient(url, timeout=self.cfg.request_timeout_s, api_key=self.api_key)

    def install(self, i: int, actor, client: EngineClient, *, serving: bool) -> None:
        """Engine `i` is now `actor`, reached through `client` (a restart: rlx.rollout.health).
        `serving`: it takes requests now (a single engine is addressed directly from now on);
        else only weight updates reach it."""
        # old clients are closed at shutdown: a request still retrying on one would reopen it
        if self.clients[i] is not client:
            self._retired.append(self.clients[i])
            self.actors[i], self.urls[i], self.clients[i] = actor, client.base_url, client
        if serving and self.router is None:
            self._retired.append(self.client)
            self.url, self.client = client.base_url, self.new_client(client.base_url)

    # ---- which engines -----------------------------------------------------------------------

    def live_clients(self) -> list[EngineClient]:
        """The clients of the engines in rotation (all of them without fault tolerance)."""
        return [self.clients[i] for i in sorted(self.serving)]

    def weight_targets(self) -> list[int]:
        """The engines a pushed weight update must reach: those in rotation and those restarted and
        waiting for it (one still restarting is left out); all of them without fault tolerance."""
        return sorted(self.serving | self.behind)

    @property
    def memory_released(self) -> bool:
        """Whether some memory the engines released is not resumed yet (a colocated trainer's
        turn): they cannot generate then, and the health monitor does not ping them."""
        return bool(self.released)

    def describe(self) -> str:
        """Each engine's state, for error messages."""
        states = []
        for i in range(len(self.actors)):
            if i in self.given_up:
                states.append(f"engine {i} given up ({self.given_up[i]})")
            elif i in self.behind:
                states.append(
                    f"engine {i} restarted, waiting for the next weight publish (the tensor and "
                    "distributed paths cannot resend the last weights; rollout.weight_sync=disk can)"
                )
            elif i in self.restarting:
                states.append(f"engine {i} restarting")
            else:
                states.append(f"engine {i} serving")
        return "; ".join(states)

    # ---- calls on every engine ---------------------------------------------------------------

    async def call(self, method: str, *args, engines: list[int] | None = None, **kwargs) -> list:
        """Call one client method on every engine at once, or on `engines` (with fault tolerance:
        every engine in rotation; one that fails to answer is left to the health monitor)."""
        clients = self.live_clients() if engines is None else [self.clients[i] for i in engines]
        calls = (getattr(c, method)(*args, **kwargs) for c in clients)
        results = await asyncio.gather(*calls, return_exceptions=self.tolerant)
        for r in results:
            if isinstance(r, BaseException) and not is_engine_failure(r):
                raise r
        return results

    async def update_from_disk(self, path: str, version: int) -> None:
        """Every engine loads the HF weight shards at `path` as `version` (no fault tolerance: the
        health monitor's `update_from_disk` does it with)."""
        await self.call("update_weights_from_disk", path, weight_version=str(version))

    async def confirm_version(self, version: int) -> None:
        """RuntimeError unless every engine serves `version` (no fault tolerance; see above)."""
        served = await self.call("get_weight_version")
        if any(v != str(version) for v in served):
            raise RuntimeError(f"engines serve versions {served} after updating to {version}")

    async def join_weight_group(
        self, master_address: str, master_port: int, backend: str, engines: list[int] | None
    ) -> None:
        """`engines` (default all) join the trainer's broadcast group as ranks 1..N in that order."""
        engines = list(range(len(self.clients))) if engines is None else engines
        world_size = 1 + len(engines)
        await asyncio.gather(
            *(
                self.clients[i].init_weights_update_group(
                    master_address, master_port, 1 + k, world_size, backend
                )
                for k, i in enumerate(engines)
            )
        )

    async def release_memory(self, tags: list[str] | None) -> None:
        self.released |= set(tags or MEMORY_TAGS)  # first: no ping meets an engine releasing it
        await self.call("release_memory_occupation", tags)

    async def resume_memory(self, tags: list[str] | None) -> None:
        await self.call("resume_memory_occupation", tags)
        self.released -= set(tags or MEMORY_TAGS)  # last: no ping meets a half-resumed engine

    # ---- shutting down -----------------------------------------------------------------------

    async def close_clients(self) -> None:
        for c in [self.client, *self.clients, *self._retired]:
            await c.aclose()

    def stop_servers(self) -> bool:
        """Ask every engine to stop its server; True when each did (without fault tolerance: an
        engine never replaced, each process idle now, for another pool to set up again)."""
        stops = [a.shutdown.remote() for a in self.actors]
        if not self.tolerant:
            ray.get(stops, timeout=30)
            return True
        ray.wait(stops, num_returns=len(stops), timeout=30)  # one that died meanwhile has nothing to stop
        return False

    def end_actors(self, stopped: bool) -> None:
        """Inside `rlx.actor_reuse.keep_actors` hand the actors back when they `stopped` cleanly; else end
        their processes."""
        if stopped and actor_reuse.keeping(self.actor_options):
            actor_reuse.hand_back("engine", self.actor_options, self.actors)
        else:
            for a in self.actors:
                ray.kill(a)
