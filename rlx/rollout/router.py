"""The real sglang-router (`python -m sglang_router.launch_router`) as a child process.

It spreads /generate over the engines' URLs; rlx's local engines and SGLang servers speak the
same API, so the router cannot tell them apart. `rollout.router_args` become its `--flags`
unchanged (see `python -m sglang_router.launch_router --help`).

With an API key (in a run, always the run's: `rlx.ports`), sglang-router 0.3.2's `--api-key` makes it
send `Authorization: Bearer KEY` to the workers and require the same from its own clients on the
routes that drive them (/generate, /flush_cache, ...; /health stays open); the key reaches it in
its environment, not on its command line (`rlx.rollout.keyed_launch`). It binds loopback even
across nodes (its Prometheus metrics too): only the driver, beside it, talks to it.
`RouterWorkers` is its worker API, through which the health monitor (`rlx.rollout.health`) takes
a failed engine out and puts its replacement in.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from typing import Any

import aiohttp
import httpx

from rlx import ports
from rlx.ports import LOOPBACK, free_port
from rlx.rollout.child_process import ChildProcess, ChildService
from rlx.rollout.client import EngineError
from rlx.rollout.sglang import cli_flags, key_env, module_cmd

LAUNCHER = "sglang_router.launch_router"
_imports: set[str] = set()  # modules start_import_check found importable (this environment: once a process)


def start_import_check(module: str = LAUNCHER) -> subprocess.Popen | None:
    """Import the router's launcher in a child process while the engines start (1-2 s), once a
    process: a router that cannot start here (sglang-router or one of its dependencies missing) is
    found in seconds, not after every engine has loaded its model (minutes at 9B) and the router
    exits at once. None: this process found it importable before."""
    if module in _imports:
        return None
    return subprocess.Popen(
        [sys.executable, "-c", f"import {module}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish_import_check(
    check: subprocess.Popen | None, module: str = LAUNCHER, timeout_s: float = 60.0
) -> None:
    """Raise RuntimeError, with the import's last lines and the fix, when `start_import_check`'s
    import of `module` failed; an import slower than `timeout_s` is left to the router's own start."""
    if check is None:
        return
    try:
        output, _ = check.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        check.kill()
        check.communicate()
        return
    if check.returncode == 0:
        _imports.add(module)
        return
    tail = "\n".join(output.strip().splitlines()[-3:])
    raise RuntimeError(
        f"sglang-router, which rlx starts in front of two or more engines, cannot start in this environment: "
        f"`{sys.executable} -c 'import {module}'` failed:\n{tail}\ninstall it with its dependencies "
        "(pip install sglang-router==0.3.2; it needs setproctitle, orjson, aiohttp, fastapi and uvicorn), "
        "or run one engine (rollout.num_engines=1)"
    )


class Router(ChildService):
    """sglang-router over `worker_urls`; `start()` returns once every worker is registered healthy.

    The router answers /health before it has registered its workers (it asks each for its
    /server_info first): requests sent then all go to the workers registered so far, and round
    robin starts unevenly. So start() waits for its `GET /workers` to list every URL healthy.

    `policy` is one of the router's: random, round_robin, cache_aware, power_of_two, manual (also
    from `rollout.router_args.policy`). Round robin suits single-turn rollouts (every engine gets an
    equal share); manual keeps requests with one `X-SMG-Routing-Key` header on one engine (the
    multi-turn helpers of rlx.agent send one per conversation); cache_aware routes by prefix.
    """

    def __init__(
        self,
        worker_urls: list[str],
        *,
        host: str = LOOPBACK,
        port: int | None = None,
        policy: str = "round_robin",
        extra_args: dict[str, Any] | None = None,
        startup_timeout_s: float = 120.0,
        api_key: str | None = None,
    ):
        """`api_key`: default the run's (`rlx.ports.api_key()`); None there: no key."""
        if not worker_urls:
            raise ValueError("Router needs at least one worker URL")
        self.worker_urls = list(worker_urls)
        self.host = host
        self._own_port = port is None  # picked here: picked again if taken before the router binds it
        self.port = port or free_port(host)
        api_key = api_key or ports.api_key()
        extra = dict(extra_args or {})
        self._policy = extra.pop("policy", policy)  # rollout.router_args.policy=manual: session affinity
        # its metrics stay beside it, on a port of their own: the default, 0.0.0.0:29000, is open to
        # the network and taken by the first router on the machine
        self._own_metrics_port = "prometheus_port" not in extra
        metrics = {"prometheus_host": host, "prometheus_port": free_port(host)}
        self._args = {"log_level": "warn", **metrics, **extra}
        self._api_key = api_key
        for name in ("host", "port", "worker_urls", "api_key"):  # owned by this class
            if name in self._args:
                raise ValueError(f"router arg {name!r} is set by Router's own parameters")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._startup_timeout_s = startup_timeout_s
        self._child = self._new_child()
        self._missing: list[str] | None = None  # None: /workers has not answered yet

    def _new_child(self) -> ChildProcess:
        flags = ["--host", self.host, "--port", str(self.port), "--worker-urls", *self.worker_urls,
                 "--policy", self._policy, *cli_flags(self._args)]  # fmt: skip
        return ChildProcess(
            module_cmd("sglang_router.launch_router", flags, keyed=bool(self._api_key)),
            self.url,
            name="sglang-router",
            startup_timeout_s=self._startup_timeout_s,
            env=key_env(self._api_key),
            ready=self._all_registered,
        )

    def _all_registered(self, http: httpx.Client) -> bool:
        """Whether the router lists every worker URL as healthy (else `_missing` says which not)."""
        if http.get(f"{self.url}/health").status_code != 200:
            return False
        answer = http.get(f"{self.url}/workers", headers=self._headers)
        if answer.status_code != 200:
            return False
        try:
            workers = answer.json()["workers"]
        except (ValueError, KeyError, TypeError):  # not its answer yet (a suite run once got 200, empty)
            return False
        healthy = {w["url"].rstrip("/") for w in workers if w.get("is_healthy")}
        self._missing = [url for url in self.worker_urls if url.rstrip("/") not in healthy]
        return not self._missing

    def start(self):
        """Start the router (a port of its own taken before it bound it: picked again,
        `ChildService.start`) and wait until it lists every worker as healthy."""
        try:
            return super().start()
        except TimeoutError as e:
            if self._missing is None:
                raise
            raise TimeoutError(
                f"sglang-router did not list {self._missing} as healthy workers in time: check that "
                f"each answers GET /health and /server_info (or /get_server_info).\n{e}"
            ) from None

    def _repick_ports(self) -> bool:
        if not (self._own_port or self._own_metrics_port):
            return False
        if self._own_port:
            self.port = free_port(self.host)
        if self._own_metrics_port:
            self._args["prometheus_port"] = free_port(self.host)
        self._child = self._new_child()
        return True

    @property
    def cmd(self) -> list[str]:
        return self._child.cmd


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
