"""SGLang's routes that free or restore the engine's memory: `/release_memory_occupation` and
`/resume_memory_occupation` (a colocated trainer's turn), and `/flush_cache` (cached prefixes).
Each runs on the scheduler thread once the requests before it have finished."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rlx.engine.serve.route_helpers import server_of

memory_routes = APIRouter()


@memory_routes.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    """Forget the cached prompt prefixes; answered as SGLang does."""
    server = server_of(request)
    await asyncio.wrap_future(server.scheduler.call(server.engine.blocks.forget_cached))
    message = "Cache flushed.\nPlease check backend logs for more details. "
    return Response(
        message + "(When there are running or waiting requests, the operation will not be performed.)\n"
    )


async def _memory_call(request: Request, release: bool) -> Response:
    """SGLang's body: {"tags": ["weights", "kv_cache", ...]} (`rlx.sglang_api.MEMORY_TAGS`), all when absent."""
    server = server_of(request)
    try:
        body = await request.json()
    except ValueError:
        body = {}
    tags = (body or {}).get("tags") if isinstance(body, dict) else None
    method = server.engine.release_memory if release else server.engine.resume_memory
    await asyncio.wrap_future(server.scheduler.call(lambda: method(tags)))
    return Response(status_code=200)


@memory_routes.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request):
    """Free the KV cache and/or weights on the GPU (after the requests in flight finish)."""
    return await _memory_call(request, release=True)


@memory_routes.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request):
    return await _memory_call(request, release=False)
