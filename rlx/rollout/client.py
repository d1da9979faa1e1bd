"""Async client for SGLang's native HTTP API: a real SGLang server, sglang-router, or rlx's own.

Only endpoints and JSON shapes SGLang itself defines are used, with fallbacks where SGLang
renamed them (`/get_weight_version` is gone after 0.5.x: the version is then read from
`/model_info`), so the same client drives every engine the rollout pool can have.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from rlx import ports, sglang_api

logger = logging.getLogger(__name__)

# Failures of the connection itself (server restarting, keep-alive race, connect timeout); the
# request never ran or its answer was lost, so sending it again is safe for every endpoint used
# here. A request that ran out of its whole time limit is not retried: that is a hang, not a blip.
TRANSIENT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError)
TRANSIENT_STATUS = {502, 503, 504}  # the router's "no worker available yet" and proxies


class EngineError(RuntimeError):
    """An engine answered with an error status; `status_code` and the server's message are kept."""

    def __init__(self, status_code: int, message: str, url: str):
        super().__init__(f"{url} answered {status_code}: {message}")
        self.status_code = status_code
        self.message = message


class EngineTimeout(TimeoutError):
    """An engine (or the router) did not answer a request within the client's time limit."""


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


@dataclass
class Reply:
    """A read HTTP answer: status and body (parsed JSON where it is JSON, else text)."""

    status_code: int
    body: Any

    @property
    def is_success(self) -> bool:
        return 200 <= self.status_code < 300


class EngineClient:
    """One SGLang-API endpoint (an engine or the router), over a pooled aiohttp session.

    aiohttp rather than httpx: at hundreds of concurrent requests on loopback httpx spent about
    10 ms a request (2.5 s for 256 /health calls) where aiohttp spends well under 1 ms.
    Every request is bounded by `timeout` seconds (a whole /generate included): past it,
    `EngineTimeout` names the URL, the call and the limit. Transient connection errors and
    502/503/504 answers are retried `max_retries` times with exponential backoff; everything else
    is raised as `EngineError` or the aiohttp error. `api_key` (default: the run's, from the
    RLX_ENGINE_API_KEY environment variable) is sent as `Authorization: Bearer KEY` on every request.
    """

    def __init__(
        self,
        base_url: str,
        timeout: float = 600.0,
        *,
        max_retries: int = 3,
        retry_backoff_s: float = 0.5,
        max_connections: int = 1024,
        api_key: str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.api_key = api_key or ports.api_key()
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None  # made in the loop that first uses it

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout, connect=min(self.timeout, 10.0)),
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                headers=ports.auth_headers(self.api_key),
                trust_env=False,  # engines are on loopback or the cluster network, never behind a proxy
            )
        return self._session

    async def _send(self, method: str, path: str, **kwargs: Any) -> Reply:
        try:
            async with self._http().request(method, self.base_url + path, **kwargs) as response:
                data = await response.read()
        except aiohttp.ClientError:
            raise  # connect/read timeouts are ClientErrors too: transient, retried by `_request`
        except TimeoutError as exc:  # the request's whole time limit
            limit = kwargs["timeout"].total if "timeout" in kwargs else self.timeout
            raise EngineTimeout(f"{self.base_url} did not answer {method} {path} within {limit:g} s") from exc
        try:
            body = sglang_api.loads(data) if data else None
        except ValueError:
            body = data.decode(errors="replace")
        return Reply(response.status, body)

    async def _request(
        self, method: str, path: str, *, ok_statuses: tuple[int, ...] = (), **kwargs: Any
    ) -> Reply:
        """Send with bounded retries; return a 2xx answer (or one of `ok_statuses`), else raise."""
        for attempt in range(self.max_retries + 1):
            try:
                reply = await self._send(method, path, **kwargs)
            except TRANSIENT_ERRORS as exc:
                if attempt == self.max_retries:
                    raise
                logger.debug("%s %s%s failed (%r); retrying", method, self.base_url, path, exc)
            else:
                if reply.is_success or reply.status_code in ok_statuses:
                    return reply
                if reply.status_code not in TRANSIENT_STATUS or attempt == self.max_retries:
                    message = _error_message(reply.body)
                    if reply.status_code == 401:
                        sent = "sent another key" if self.api_key else f"had none ({ports.API_KEY_ENV} unset)"
                        message += f" (the engine requires the run's API key; this client {sent})"
                    raise EngineError(reply.status_code, message, self.base_url + path)
            await asyncio.sleep(self.retry_backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    async def generate(
        self,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        *,
        return_logprob: bool = True,
        rid: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """POST /generate for one prompt; the raw SGLang response (`text`, `output_ids`, `meta_info`).
        `headers`: extra HTTP headers (sglang-router's `X-SMG-Routing-Key`, say)."""
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "return_logprob": return_logprob,
        }
        if rid is not None:
            payload["rid"] = rid
        return (await self._request("POST", "/generate", json=payload, headers=headers or {})).body

    async def generate_batch(
        self,
        input_ids: list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]],
        *,
        return_logprob: bool = True,
        rids: list[str] | None = None,
    ) -> list[dict[str, Any]]:
        """POST /generate with SGLang's batch form (a list of prompts); one response per prompt.
        `sampling_params` is one dict for every prompt or one per prompt (SGLang accepts both).

        One request per group keeps a group on one engine behind the router, where its shared
        prompt is cached once, and costs one HTTP round trip instead of n. `rids`: one request id
        per prompt (for `abort`); SGLang makes them up when absent.
        """
        payload = {
            "input_ids": [list(ids) for ids in input_ids],
            "sampling_params": (
                dict(sampling_params)
                if isinstance(sampling_params, dict)
                else [dict(p) for p in sampling_params]
            ),
            "return_logprob": return_logprob,
        }
        if rids is not None:
            payload["rid"] = list(rids)
        return (await self._request("POST", "/generate", json=payload)).body

    async def health(self) -> bool:
        """True if GET /health answers 200 (no retries: this is the probe)."""
        try:
            reply = await self._send("GET", "/health", timeout=aiohttp.ClientTimeout(total=10.0))
        except (TimeoutError, aiohttp.ClientError):  # EngineTimeout is a TimeoutError
            return False
        return reply.status_code == 200

    async def wait_healthy(self, timeout_s: float = 300.0, interval_s: float = 0.5) -> None:
        """Poll /health until it answers 200; TimeoutError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not await self.health():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.base_url}/health did not answer 200 within {timeout_s:.0f} s")
            await asyncio.sleep(interval_s)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, **extra: Any
    ) -> dict[str, Any]:
        """POST /update_weights_from_disk; SGLang's {"success", "message", ...}, or RuntimeError
        naming the engine, the directory and SGLang's message when the load failed.

        `extra` carries SGLang's other fields (`abort_all_requests`, `load_format`, ...).
        """
        payload = {"model_path": str(model_path), **extra}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._post_checked(
            "/update_weights_from_disk",
            payload,
            f"engine {self.base_url} failed to load weights from {model_path}",
        )

    async def get_weight_version(self) -> str:
        """GET /get_weight_version, or `weight_version` of the model info where that is gone."""
        reply = await self._request("GET", "/get_weight_version", ok_statuses=(404,))
        if reply.status_code == 404:
            return str((await self.get_model_info())["weight_version"])
        return str(reply.body["weight_version"])

    async def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        """POST /release_memory_occupation: free `tags` ("weights", "kv_cache"; all when None) on the GPU."""
        await self._request("POST", "/release_memory_occupation", json={} if tags is None else {"tags": tags})

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        """POST /resume_memory_occupation: allocate `tags` again (all when None)."""
        await self._request("POST", "/resume_memory_occupation", json={} if tags is None else {"tags": tags})

    async def init_weights_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int, backend: str
    ) -> None:
        """POST /init_weights_update_group: join the trainer's broadcast group as `rank_offset`
        (returns once the whole group has formed); RuntimeError with SGLang's message otherwise."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "backend": backend, "group_name": "weight_update_group"}  # fmt: skip
        await self._post_checked(
            "/init_weights_update_group", body, f"{self.base_url} could not join the weight update group"
        )

    async def destroy_weights_update_group(self) -> None:
        """POST /destroy_weights_update_group: leave the trainer's broadcast group (before it is
        formed again with other members); RuntimeError with SGLang's message otherwise."""
        await self._post_checked(
            "/destroy_weights_update_group",
            {"group_name": "weight_update_group"},
            f"{self.base_url} could not leave the weight update group",
        )

    async def _post_checked(self, path: str, body: dict[str, Any], failure: str) -> dict[str, Any]:
        """POST one of SGLang's weight requests; its reply ({"success", "message", ...}), or
        RuntimeError("`failure`: SGLang's message") unless it succeeded (SGLang answers 400 then)."""
        result = (await self._request("POST", path, json=body, ok_statuses=(400,))).body
        if not result.get("success", False):
            raise RuntimeError(f"{failure}: {result.get('message')}")
        return result

    async def flush_cache(self) -> bool:
        """POST /flush_cache; False when SGLang refuses (requests still running)."""
        return (await self._request("POST", "/flush_cache", ok_statuses=(400,))).is_success

    async def abort(self, rid: str | None = None, abort_all: bool = False) -> None:
        """POST /abort_request: the request `rid` (and those it prefixes), or all of them."""
        await self._request("POST", "/abort_request", json={"rid": rid or "", "abort_all": abort_all})

    async def get_model_info(self) -> dict[str, Any]:
        """GET /get_model_info (the name sglang-router serves), else /model_info (newer SGLang)."""
        reply = await self._request("GET", "/get_model_info", ok_statuses=(404,))
        if reply.status_code == 404:
            reply = await self._request("GET", "/model_info")
        return reply.body

    async def get_server_info(self) -> dict[str, Any]:
        """GET /get_server_info, else /server_info (newer SGLang)."""
        reply = await self._request("GET", "/get_server_info", ok_statuses=(404,))
        if reply.status_code == 404:
            reply = await self._request("GET", "/server_info")
        return reply.body

    async def aclose(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()


def _error_message(body: Any) -> str:
    """SGLang's error bodies: {"error": {"message"}}, {"message"}, FastAPI's {"detail"}, or text."""
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in body:
                return str(body[key])
    return str(body)[:500]
