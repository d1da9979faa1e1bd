"""SGLang's routes that run the model: `/generate`, `/health_generate`, and `/abort_request`.

Requests go to the scheduler thread (`rlx.engine.serve.scheduler_thread`); each HTTP request waits
for all of its prompts with one wake-up, and aborts them if its client goes away, as SGLang does.
`/generate` is plain ASGI (`GenerateEndpoint`, ahead of FastAPI's routing); the others are FastAPI
routes.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rlx import sglang_api
from rlx.engine.sequence import GenerateRequest, SamplingParams
from rlx.engine.serve.protocol import build_response, error_body, parse_generate
from rlx.engine.serve.route_helpers import json_body, server_of
from rlx.engine.serve.scheduler_thread import Pending

generate_routes = APIRouter()


async def _await_results(
    pendings: list[Pending], client_gone: Callable[[], Awaitable[bool]], scheduler
) -> list:
    """Every pending's result, in order; all aborted if the client goes away (as SGLang does).

    One loop future for the whole request, set by the scheduler thread when its last item
    finishes: a batch of n prompts costs one wake-up here, not n tasks and n timers."""
    loop = asyncio.get_running_loop()
    all_done = loop.create_future()
    left = [len(pendings)]
    lock = threading.Lock()

    def one_done(_future) -> None:  # on the thread that set the result
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits any more
                loop.call_soon_threadsafe(lambda: all_done.done() or all_done.set_result(None))

    for pending in pendings:
        pending.future.add_done_callback(one_done)
    if not pendings:
        all_done.set_result(None)
    while True:
        done, _ = await asyncio.wait({all_done}, timeout=1.0)
        if done:
            return [p.future.result() for p in pendings]  # an engine error is raised here
        if await client_gone():
            scheduler.cancel(pendings)


class GenerateEndpoint:
    """SGLang's /generate (POST or PUT) in plain ASGI, ahead of FastAPI's routing, which passes
    everything else on to `app`: single or batch, input_ids or text; SSE with one event if
    `stream`. A multi-turn rollout sends a request per sample and turn, and FastAPI's routing,
    middleware and request objects held the GIL the scheduler thread's steps wait for: 1,024
    two-turn requests 0.82-0.98 -> 0.56-0.61 s on an H200 (`bench/short_rollout.py --turns`,
    docs/benchmarks.md)."""

    METHODS = ("POST", "PUT")

    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != "/generate" or scope["method"] not in self.METHODS:
            await self.app(scope, receive, send)
            return
        status, media_type, payload = await self.answer(receive)
        headers = [(b"content-type", media_type), (b"content-length", str(len(payload)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    async def answer(self, receive) -> tuple[int, bytes, bytes]:
        """(status, media type, body) of one /generate request."""
        try:
            body = sglang_api.loads(await _read_body(receive))
        except ValueError as exc:
            return _error(f"invalid JSON body: {exc}")
        if not isinstance(body, dict):
            return _error("the JSON body must be an object")
        engine, scheduler = self.server.engine, self.server.scheduler
        try:
            items, single = parse_generate(body, engine)
        except (ValueError, TypeError) as exc:
            return _error(str(exc))
        start = time.perf_counter()
        pendings = scheduler.submit([item["request"] for item in items])
        try:
            results = await _await_results(pendings, lambda: _client_gone(receive), scheduler)
        except Exception as exc:
            return _error(f"generation failed: {exc}", 500)
        latency = time.perf_counter() - start
        text_in_logprobs = bool(body.get("return_text_in_logprobs"))
        outs = [
            build_response(engine, item, output, version, latency, text_in_logprobs)
            for item, (output, version) in zip(items, results, strict=True)
        ]
        if body.get("stream"):  # the whole result as one event: a client reading SSE still works
            events = [
                b"data: " + sglang_api.dumps(o if single else {**o, "index": i}) + b"\n\n"
                for i, o in enumerate(outs)
            ]
            return 200, b"text/event-stream", b"".join([*events, b"data: [DONE]\n\n"])
        return 200, b"application/json", sglang_api.dumps(outs[0] if single else outs)


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


async def _client_gone(receive) -> bool:
    """Whether the client has disconnected (a message waiting that says so); asked once a second."""
    try:
        message = await asyncio.wait_for(receive(), timeout=0.01)
    except TimeoutError:
        return False
    return message.get("type") == "http.disconnect"


def _error(message: str, status: int = 400) -> tuple[int, bytes, bytes]:
    return status, b"application/json", sglang_api.dumps(error_body(message))


@generate_routes.get("/health_generate")
async def health_generate(request: Request):
    """One greedy token through the scheduler, as SGLang's health check does."""
    probe = GenerateRequest(
        [0], SamplingParams(max_new_tokens=1, temperature=0.0), f"HEALTH_CHECK_{uuid.uuid4().hex}"
    )
    (pending,) = server_of(request).scheduler.submit([probe], counted=False)
    try:
        await asyncio.wait_for(asyncio.wrap_future(pending.future), timeout=20)
    except Exception:
        server_of(request).scheduler.cancel([pending])
        return Response(status_code=503)
    return Response(status_code=200)


@generate_routes.post("/abort_request")
async def abort_request(request: Request):
    body = await json_body(request)
    server_of(request).scheduler.abort(str(body.get("rid") or ""), bool(body.get("abort_all", False)))
    return Response(status_code=200)
