"""SGLang's routes that run the model: `/generate`, `/health_generate`, and `/abort_request`.

Requests go to the scheduler thread (`rlx.engine.serve.scheduler_thread`); each HTTP request waits
for all of its prompts with one wake-up, and aborts them if its client goes away, as SGLang does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rlx.engine.sequence import GenerateRequest, SamplingParams
from rlx.engine.serve.protocol import build_response, parse_generate
from rlx.engine.serve.route_helpers import error_response, json_body, server_of
from rlx.engine.serve.scheduler_thread import Pending

generate_routes = APIRouter()


async def _await_results(pendings: list[Pending], request: Request) -> list:
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
        if await request.is_disconnected():
            server_of(request).scheduler.cancel(pendings)


@generate_routes.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request):
    """SGLang's /generate: single or batch, input_ids or text; SSE with one event if `stream`."""
    body, server = await json_body(request), server_of(request)
    engine, scheduler = server.engine, server.scheduler
    try:
        items, single = parse_generate(body, engine)
    except (ValueError, TypeError) as exc:
        return error_response(str(exc))
    start = time.perf_counter()
    pendings = scheduler.submit([item["request"] for item in items])
    try:
        results = await _await_results(pendings, request)
    except Exception as exc:
        return error_response(f"generation failed: {exc}", 500)
    latency = time.perf_counter() - start
    text_in_logprobs = bool(body.get("return_text_in_logprobs"))
    outs = [
        build_response(engine, item, output, version, latency, text_in_logprobs)
        for item, (output, version) in zip(items, results, strict=True)
    ]
    if body.get("stream"):  # the whole result as one event: a client reading SSE still works
        events = [f"data: {json.dumps(o if single else {**o, 'index': i})}\n\n" for i, o in enumerate(outs)]
        return StreamingResponse(iter([*events, "data: [DONE]\n\n"]), media_type="text/event-stream")
    return JSONResponse(outs[0] if single else outs)


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
