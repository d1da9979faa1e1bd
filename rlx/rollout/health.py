"""Engine fault tolerance (`rollout.fault_tolerance=true`): the rollout pool's health monitor.

Every `rollout.health_check_interval_s` the monitor pings each engine with `GET /health_generate`
(one token through the engine's scheduler, so a hung scheduler fails it, not just a dead port).
An engine is restarted when its port refuses connections (its process is gone) or its Ray actor
died, or after `rollout.health_check_failures` pings in a row failed (no answer within
`rollout.health_check_timeout_s`, or an error status). A restart:

  1. takes the engine out of rotation and out of sglang-router (`DELETE /workers/{id}`);
  2. stops its actor (politely first, so an SGLang child process ends too; then `ray.kill`) and
     starts a new `EngineActor` with the same Ray options and seed;
  3. brings it to the last published weights: with `rollout.weight_sync=disk` it loads the last
     weight directory the pool was given (the publisher deletes a directory only once the next one
     is loaded). The tensor and distributed paths push from the trainer, whose weights may already
     be ahead of the published version, so the engine stays out of rotation until the next
     publish reaches it (`check_version` then puts it back). For the distributed path the
     publisher (`rlx.weight_sync.publisher`) forms the broadcast group again with the engines it now reaches;
  4. puts it back into the router (`POST /workers`) and into rotation.

Weight updates and restarts take turns on one lock, so a restarted engine never rejoins with an
older version than the others serve. Requests that failed on a dead engine are sent again by the
pool (`rollout.max_request_retries`) once `recover()` has checked the engines and at least one
serves. Restarts are counted in `RolloutPool.metrics()` as `rollout/engine_restarts`. What the
monitor knows of the engines (where each listens, which serve, the published weights) is the
`EngineSet`'s (`rlx.rollout.engines`), which the pool reads too.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time

import aiohttp
import ray

from rlx import ports
from rlx.rollout.client import EngineClient, is_engine_failure
from rlx.rollout.config import RolloutConfig
from rlx.rollout.engines import EngineSet
from rlx.rollout.router import RouterWorkers

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # at most, a polite shutdown of a failed engine's actor before it is killed
MAX_RESTART_ATTEMPTS = 3  # restarts in a row that fail before an engine is given up


class Verdict(enum.Enum):
    OK = "ok"
    FAILED = "failed"  # no answer in time, or an error status: counted towards hung
    DEAD = "dead"  # connection refused: nothing listens there any more


class HealthMonitor:
    """Pings, restarts and re-admits the engines of an `EngineSet`, whose state it changes (which
    engines serve, which restart, the weights a restarted engine must serve); every coroutine runs
    on the pool's loop. `update_from_disk` and `confirm_version` record the published weights."""

    def __init__(self, engines: EngineSet, cfg: RolloutConfig):
        self.engines, self.cfg = engines, cfg
        self._restarts: dict[int, asyncio.Task] = {}  # engine -> its restart
        self._rounds = 0  # probe rounds begun
        self._session: aiohttp.ClientSession | None = None
        self._weights_lock: asyncio.Lock | None = None
        self._probe_lock: asyncio.Lock | None = None
        self._changed: asyncio.Event | None = None  # set whenever an engine rejoins or is given up
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        """Begin pinging (on the pool's loop)."""
        timeout = aiohttp.ClientTimeout(total=self.cfg.health_check_timeout_s)
        self._session = aiohttp.ClientSession(
            timeout=timeout, headers=ports.auth_headers(self.engines.api_key), trust_env=False
        )
        self._weights_lock, self._probe_lock, self._changed = asyncio.Lock(), asyncio.Lock(), asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_check_interval_s)
            # no pings while the engines' memory is released (a colocated trainer's turn): they
            # cannot generate then, and that is not a failure
            if self.engines.memory_released:
                continue
            try:
                async with self._probe_lock:
                    await self._probe_round()
            except Exception:  # the monitor must outlive whatever one round hit
                log.exception("engine health check failed")

    async def stop(self) -> None:
        for task in [self._task, *self._restarts.values()]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        if self._session is not None:
            await self._session.close()

    # ---- pinging -------------------------------------------------------------------------------

    async def _probe(self, i: int) -> Verdict:
        """Engine i's server pinged, and its actor asked for its URL: an actor that died is dead
        even if a child server of its (SGLang's) still answers."""
        http, actor = await asyncio.gather(
            self._ping(self.engines.urls[i]), self._actor_alive(self.engines.actors[i])
        )
        return http if actor else Verdict.DEAD

    async def _ping(self, url: str) -> Verdict:
        try:
            async with self._session.get(url + "/health_generate") as r:
                return Verdict.OK if r.status == 200 else Verdict.FAILED
        except aiohttp.ClientConnectorError:
            return Verdict.DEAD
        except (aiohttp.ClientError, TimeoutError):
            return Verdict.FAILED

    async def _actor_alive(self, actor) -> bool:
        try:
            await asyncio.wait_for(actor.url.remote(), self.cfg.health_check_timeout_s)
        except ray.exceptions.ActorDiedError:
            return False
        except Exception:  # slow, busy or briefly unreachable: the HTTP ping judges that
            return True
        return True

    async def _probe_round(self) -> None:
        """Ping every engine not being restarted; start the restart of each dead or hung one."""
        self._rounds += 1
        engines = self.engines
        checked = [
            i for i in range(len(engines.actors)) if i not in engines.restarting and i not in engines.given_up
        ]
        verdicts = await asyncio.gather(*(self._probe(i) for i in checked))
        for i, verdict in zip(checked, verdicts, strict=True):
            engines.failed_pings[i] = 0 if verdict is Verdict.OK else engines.failed_pings[i] + 1
            if verdict is Verdict.DEAD or engines.failed_pings[i] >= self.cfg.health_check_failures:
                why = (
                    "refuses connections"
                    if verdict is Verdict.DEAD
                    else f"failed {engines.failed_pings[i]} pings"
                )
                await self._take_out(i, why)

    async def probe_now(self) -> None:
        """One probe round now (after a weight push failed): a dead engine is taken out at once,
        a hung one counts one more failed ping."""
        async with self._probe_lock:
            await self._probe_round()

    async def recover(self) -> None:
        """After a request failed: ping the engines now (unless a round began since), then wait
        until one serves; TimeoutError naming the engines' state after `engine_restart_timeout_s`."""
        asked = self._rounds
        async with self._probe_lock:
            if self._rounds == asked:
                await self._probe_round()
        deadline = time.monotonic() + self.cfg.engine_restart_timeout_s
        while not self.engines.serving:
            if len(self.engines.given_up) == len(self.engines.actors) or time.monotonic() > deadline:
                raise TimeoutError(f"no engine serves: {self.engines.describe()}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 1.0)

    # ---- restarting ----------------------------------------------------------------------------

    def _router_workers(self) -> RouterWorkers:
        return RouterWorkers(self._session, self.engines.router.url, self.cfg.engine_restart_timeout_s)

    async def _take_out(self, i: int, why: str) -> None:
        """Out of rotation and out of the router; the restart goes on in the background."""
        engines = self.engines
        if i in engines.restarting or i in engines.given_up:
            return
        url = engines.urls[i]
        log.warning("engine %d (%s) %s: restarting it", i, url, why)
        engines.restarting.add(i)  # claimed: no other caller takes it out meanwhile
        engines.serving.discard(i)
        engines.behind.discard(i)
        if engines.router is not None:
            try:
                await self._router_workers().remove(url)
            except Exception as e:  # the router marks it unhealthy by itself meanwhile
                log.warning("could not remove engine %d from the router: %r", i, e)
        self._restarts[i] = asyncio.ensure_future(self._restart(i))

    async def _restart(self, i: int) -> None:
        try:
            for attempt in range(1, MAX_RESTART_ATTEMPTS + 1):
                try:
                    await asyncio.wait_for(self._restart_once(i), self.cfg.engine_restart_timeout_s)
                    return
                except Exception as e:
                    log.warning("restart %d of engine %d failed: %r", attempt, i, e)
                    reason = f"{type(e).__name__}: {e}"
            self.engines.given_up[i] = reason
            log.error("engine %d given up after %d failed restarts: %s", i, MAX_RESTART_ATTEMPTS, reason)
            self._changed.set()
        finally:
            self.engines.restarting.discard(i)
            self._restarts.pop(i, None)

    async def _restart_once(self, i: int) -> None:
        actor, url = await asyncio.to_thread(self._replace_actor, i)
        client = self.engines.new_client(url)
        try:
            await self._bring_back(i, actor, client)
        except BaseException:  # not installed: the next attempt starts another
            await client.aclose()
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise

    async def _bring_back(self, i: int, actor, client: EngineClient) -> None:
        engines = self.engines
        async with self._weights_lock:
            if engines.version is not None and engines.weights_path is None:
                engines.install(i, actor, client, serving=False)  # the next publish reaches it
                engines.behind.add(i)
                log.warning(
                    "engine %d restarted at %s; it rejoins at the next weight publish", i, client.base_url
                )
            else:
                if engines.version is not None:
                    await self._load(client, engines.weights_path, engines.version)
                await self._admit(i, actor, client)
            engines.num_restarts += 1
        self._changed.set()

    def _replace_actor(self, i: int):
        """(new actor, its URL) in place of engine i's actor (blocking: run in a thread)."""
        old = self.engines.actors[i]
        with contextlib.suppress(Exception):  # dead or hung: it is killed next anyway
            ray.get(old.shutdown.remote(), timeout=min(STOP_TIMEOUT_S, self.cfg.health_check_timeout_s))
        with contextlib.suppress(Exception):
            ray.kill(old, no_restart=True)
        actor = self.engines.launch(i)
        return actor, ray.get(actor.url.remote(), timeout=self.cfg.engine_restart_timeout_s)

    async def _load(self, client: EngineClient, path: str, version: int) -> None:
        await client.update_weights_from_disk(path, weight_version=str(version))
        served = await client.get_weight_version()
        if served != str(version):
            raise RuntimeError(f"{client.base_url} serves version {served} after loading {version}")

    async def _admit(self, i: int, actor, client: EngineClient) -> None:
        """Engine i (at the current weights) back into the router and into rotation."""
        engines = self.engines
        if engines.router is not None:
            await self._router_workers().add(client.base_url)
        engines.install(i, actor, client, serving=True)
        engines.serving.add(i)
        engines.behind.discard(i)
        engines.failed_pings[i] = 0
        log.warning("engine %d serves again at %s (version %s)", i, client.base_url, engines.version)

    # ---- weights -------------------------------------------------------------------------------

    async def update_from_disk(self, path: str, version: int) -> None:
        """Every engine in rotation loads `path` as `version`; one that fails to answer is
        restarted (and loads it then). RuntimeError if an engine answers with an error, or if none
        took the update."""
        engines = self.engines
        async with self._weights_lock:
            todo = sorted(engines.serving)
            clients = [engines.clients[i] for i in todo]
            results = await asyncio.gather(
                *(c.update_weights_from_disk(path, weight_version=str(version)) for c in clients),
                return_exceptions=True,
            )
            lost = []
            for i, result in zip(todo, results, strict=True):
                if isinstance(result, BaseException):
                    if not is_engine_failure(result):
                        raise result  # the engine answered that it could not load `path`
                    lost.append(i)
            engines.weights_path, engines.version = path, version
        for i in lost:  # it restarts with `path`, after the lock is released
            await self._take_out(i, f"did not answer the weight update to version {version}")
        if len(lost) == len(todo):
            raise RuntimeError(f"no engine took the weight update to version {version}: {engines.describe()}")

    async def confirm_version(self, version: int) -> None:
        """Every engine in rotation serves `version` (RuntimeError otherwise; one that does not
        answer is left to the pings), and restarted engines waiting for it rejoin. `version` is
        now the published one; unless `update_from_disk` loaded it, there is no directory to
        reload it from (the trainer pushed it)."""
        engines = self.engines
        async with self._weights_lock:
            if version != engines.version:
                engines.weights_path = None
            engines.version = version
            todo = engines.weight_targets()
            served = await asyncio.gather(
                *(engines.clients[i].get_weight_version() for i in todo), return_exceptions=True
            )
            wrong = {}
            for i, v in zip(todo, served, strict=True):
                if isinstance(v, BaseException):
                    if not is_engine_failure(v):
                        raise v
                elif v == str(version) and i in engines.behind:
                    await self._admit(i, engines.actors[i], engines.clients[i])
                elif v != str(version) and i in engines.serving:
                    wrong[engines.urls[i]] = v
            if wrong:
                raise RuntimeError(f"engines serve versions {wrong} after updating to {version}")
        self._changed.set()
