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
     publisher (`rlx.sync`) forms the broadcast group again with the engines it now reaches;
  4. puts it back into the router (`POST /workers`) and into rotation.

Weight updates and restarts take turns on one lock, so a restarted engine never rejoins with an
older version than the others serve. Requests that failed on a dead engine are sent again by the
pool (`rollout.max_request_retries`) once `recover()` has checked the engines and at least one
serves. Restarts are counted in `RolloutPool.metrics()` as `rollout/engine_restarts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from typing import TYPE_CHECKING

import aiohttp
import ray

from rlx import ports
from rlx.rollout.client import EngineClient, EngineError

if TYPE_CHECKING:
    from rlx.rollout.pool import RolloutPool

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # at most, a polite shutdown of a failed engine's actor before it is killed
MAX_RESTART_ATTEMPTS = 3  # restarts in a row that fail before an engine is given up


class Verdict(enum.Enum):
    OK = "ok"
    FAILED = "failed"  # no answer in time, or an error status: counted towards hung
    DEAD = "dead"  # connection refused: nothing listens there any more


def is_engine_failure(exc: BaseException | None) -> bool:
    """True when `exc` (or what caused it) says the engine failed rather than the request being
    bad: a lost connection, a timeout, a 5xx answer (the router's own when no engine is left)."""
    for _ in range(5):  # a generate_fn may wrap the client's error
        if exc is None:
            return False
        if isinstance(exc, EngineError):
            return exc.status_code >= 500
        if isinstance(exc, aiohttp.ClientError | TimeoutError):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class RouterWorkers:
    """sglang-router 0.3.2's worker API: `GET /workers` lists them, `POST /workers {"url"}` adds
    one, `DELETE /workers/{id}` removes one. Both changes answer 202 and happen in the background,
    so each call here waits until the list shows the change."""

    def __init__(self, session: aiohttp.ClientSession, router_url: str, timeout_s: float):
        self.session, self.base, self.timeout_s = session, router_url.rstrip("/"), timeout_s

    async def workers(self) -> list[dict]:
        async with self.session.get(self.base + "/workers") as r:
            r.raise_for_status()
            return (await r.json())["workers"]

    async def remove(self, url: str) -> None:
        for w in await self.workers():
            if w["url"] == url:
                async with self.session.delete(f"{self.base}/workers/{w['id']}") as r:
                    if r.status >= 400:
                        raise EngineError(r.status, await r.text(), self.base + "/workers")
        await self._until(lambda ws: url not in [w["url"] for w in ws], f"remove {url}")

    async def add(self, url: str) -> None:
        async with self.session.post(self.base + "/workers", json={"url": url}) as r:
            if r.status >= 400:
                raise EngineError(r.status, await r.text(), self.base + "/workers")
        healthy = lambda ws: any(w["url"] == url and w.get("is_healthy", True) for w in ws)  # noqa: E731
        await self._until(healthy, f"add {url}")

    async def _until(self, done, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not done(await self.workers()):
            if time.monotonic() > deadline:
                raise TimeoutError(f"sglang-router at {self.base} did not {what} within {self.timeout_s:g} s")
            await asyncio.sleep(0.1)


class HealthMonitor:
    """Pings, restarts and re-admits the pool's engines; every coroutine runs on the pool's loop.

    `serving`: indices of the engines in rotation (behind the router, or the one engine).
    `update_from_disk` and `confirm_version` record the weights a restarted engine must serve."""

    def __init__(self, pool: RolloutPool):
        self.pool, self.cfg = pool, pool.cfg
        n = len(pool.actors)
        self.serving: set[int] = set(range(n))
        self.behind: set[int] = set()  # restarted, waiting for the next publish (tensor/distributed)
        self.given_up: dict[int, str] = {}  # engine -> why its restarts failed
        self.failures = [0] * n  # failed pings in a row
        self.num_restarts = 0  # completed restarts, read and reset by the pool's metrics()
        self.weights_path: str | None = None
        self.version: int | None = None  # None: nothing published since the engines started
        self._restarts: dict[int, asyncio.Task | None] = {}  # engine -> its restart
        self._rounds = 0  # probe rounds begun
        self._session: aiohttp.ClientSession | None = None
        self._weights_lock: asyncio.Lock | None = None
        self._probe_lock: asyncio.Lock | None = None
        self._changed: asyncio.Event | None = None  # set whenever an engine rejoins or is given up
        self._task: asyncio.Task | None = None
        # no pings while the engines' memory is released (a colocated trainer's turn): they cannot
        # generate then, and that is not a failure
        self.paused = False

    def start(self) -> None:
        """Begin pinging (from any thread but the pool's)."""
        self.pool.run(self._start())

    async def _start(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.cfg.health_check_timeout_s)
        self._session = aiohttp.ClientSession(
            timeout=timeout, headers=ports.auth_headers(self.pool.api_key), trust_env=False
        )
        self._weights_lock, self._probe_lock, self._changed = asyncio.Lock(), asyncio.Lock(), asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_check_interval_s)
            if self.paused:
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
            self._ping(self.pool.engine_urls[i]), self._actor_alive(self.pool.actors[i])
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
        checked = [
            i for i in range(len(self.pool.actors)) if i not in self._restarts and i not in self.given_up
        ]
        verdicts = await asyncio.gather(*(self._probe(i) for i in checked))
        for i, verdict in zip(checked, verdicts, strict=True):
            self.failures[i] = 0 if verdict is Verdict.OK else self.failures[i] + 1
            if verdict is Verdict.DEAD or self.failures[i] >= self.cfg.health_check_failures:
                why = "refuses connections" if verdict is Verdict.DEAD else f"failed {self.failures[i]} pings"
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
        while not self.serving:
            if len(self.given_up) == len(self.pool.actors) or time.monotonic() > deadline:
                raise TimeoutError(f"no engine serves: {self.describe()}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), 1.0)

    def describe(self) -> str:
        """Each engine's state, for error messages."""
        states = []
        for i in range(len(self.pool.actors)):
            if i in self.given_up:
                states.append(f"engine {i} given up ({self.given_up[i]})")
            elif i in self.behind:
                states.append(
                    f"engine {i} restarted, waiting for the next weight publish (the tensor and "
                    "distributed paths cannot resend the last weights; rollout.weight_sync=disk can)"
                )
            elif i in self._restarts:
                states.append(f"engine {i} restarting")
            else:
                states.append(f"engine {i} serving")
        return "; ".join(states)

    # ---- restarting ----------------------------------------------------------------------------

    async def _take_out(self, i: int, why: str) -> None:
        """Out of rotation and out of the router; the restart goes on in the background."""
        if i in self._restarts or i in self.given_up:
            return
        url = self.pool.engine_urls[i]
        log.warning("engine %d (%s) %s: restarting it", i, url, why)
        self._restarts[i] = None  # claimed: no other caller takes it out meanwhile
        self.serving.discard(i)
        self.behind.discard(i)
        if self.pool.router is not None:
            try:
                await RouterWorkers(self._session, self.pool.url, self.cfg.engine_restart_timeout_s).remove(
                    url
                )
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
            self.given_up[i] = reason
            log.error("engine %d given up after %d failed restarts: %s", i, MAX_RESTART_ATTEMPTS, reason)
            self._changed.set()
        finally:
            self._restarts.pop(i, None)

    async def _restart_once(self, i: int) -> None:
        actor, url = await asyncio.to_thread(self._replace_actor, i)
        client = self.pool.new_client(url)
        try:
            await self._bring_back(i, actor, client)
        except BaseException:  # not installed: the next attempt starts another
            await client.aclose()
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise

    async def _bring_back(self, i: int, actor, client: EngineClient) -> None:
        async with self._weights_lock:
            if self.version is not None and self.weights_path is None:
                self.pool.install_engine(i, actor, client, serving=False)  # the next publish reaches it
                self.behind.add(i)
                log.warning(
                    "engine %d restarted at %s; it rejoins at the next weight publish", i, client.base_url
                )
            else:
                if self.version is not None:
                    await self._load(client, self.weights_path, self.version)
                await self._admit(i, actor, client)
            self.num_restarts += 1
        self._changed.set()

    def _replace_actor(self, i: int):
        """(new actor, its URL) in place of engine i's actor (blocking: run in a thread)."""
        old = self.pool.actors[i]
        with contextlib.suppress(Exception):  # dead or hung: it is killed next anyway
            ray.get(old.shutdown.remote(), timeout=min(STOP_TIMEOUT_S, self.cfg.health_check_timeout_s))
        with contextlib.suppress(Exception):
            ray.kill(old, no_restart=True)
        actor = self.pool.launch_engine(i)
        return actor, ray.get(actor.url.remote(), timeout=self.cfg.engine_restart_timeout_s)

    async def _load(self, client: EngineClient, path: str, version: int) -> None:
        await client.update_weights_from_disk(path, weight_version=str(version))
        served = await client.get_weight_version()
        if served != str(version):
            raise RuntimeError(f"{client.base_url} serves version {served} after loading {version}")

    async def _admit(self, i: int, actor, client: EngineClient) -> None:
        """Engine i (at the current weights) back into the router and into rotation."""
        if self.pool.router is not None:
            await RouterWorkers(self._session, self.pool.url, self.cfg.engine_restart_timeout_s).add(
                client.base_url
            )
        self.pool.install_engine(i, actor, client, serving=True)
        self.serving.add(i)
        self.behind.discard(i)
        self.failures[i] = 0
        log.warning("engine %d serves again at %s (version %s)", i, client.base_url, self.version)

    # ---- weights -------------------------------------------------------------------------------

    async def update_from_disk(self, path: str, version: int) -> None:
        """Every engine in rotation loads `path` as `version`; one that fails to answer is
        restarted (and loads it then). RuntimeError if an engine answers with an error, or if none
        took the update."""
        async with self._weights_lock:
            todo = sorted(self.serving)
            clients = [self.pool.engine_clients[i] for i in todo]
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
            self.weights_path, self.version = path, version
        for i in lost:  # it restarts with `path`, after the lock is released
            await self._take_out(i, f"did not answer the weight update to version {version}")
        if len(lost) == len(todo):
            raise RuntimeError(f"no engine took the weight update to version {version}: {self.describe()}")

    async def confirm_version(self, version: int) -> None:
        """Every engine in rotation serves `version` (RuntimeError otherwise; one that does not
        answer is left to the pings), and restarted engines waiting for it rejoin. `version` is
        now the published one; unless `update_from_disk` loaded it, there is no directory to
        reload it from (the trainer pushed it)."""
        async with self._weights_lock:
            if version != self.version:
                self.weights_path = None
            self.version = version
            todo = sorted(self.serving | self.behind)
            served = await asyncio.gather(
                *(self.pool.engine_clients[i].get_weight_version() for i in todo), return_exceptions=True
            )
            wrong = {}
            for i, v in zip(todo, served, strict=True):
                if isinstance(v, BaseException):
                    if not is_engine_failure(v):
                        raise v
                elif v == str(version) and i in self.behind:
                    await self._admit(i, self.pool.actors[i], self.pool.engine_clients[i])
                elif v != str(version) and i in self.serving:
                    wrong[self.pool.engine_urls[i]] = v
            if wrong:
                raise RuntimeError(f"engines serve versions {wrong} after updating to {version}")
        self._changed.set()
