"""The engine server's FastAPI app: SGLang's routes, its 400 for a bad request, and its API key.

With an API key (SGLang's `--api-key`; every rlx run gives its engines one, `rlx.ports`) every route
but `GET /health` answers 401 unless the request carries `Authorization: Bearer KEY`, whatever the
bind address, loopback included. That covers every route that changes the engine or reads files:
the weight updates (`/update_weights_from_disk` loads any directory it names;
`/update_weights_from_tensor`; `/init_weights_update_group` joins a process group at any address,
then `/update_weights_from_distributed` takes its tensors; `/destroy_weights_update_group`),
`/update_weight_version`, `/release_memory_occupation`, `/resume_memory_occupation`,
`/abort_request`, `/flush_cache`, and the routes that run the model (`/generate`,
`/health_generate`). The read-only ones (`/get_model_info`, `/get_server_info`, `/get_load`,
`/get_weight_version`, FastAPI's `/docs`) want it too: SGLang's key covers them, sglang-router
sends it on all of them, and their answers name the model's path. /health stays open, as in
SGLang, because sglang-router's liveness probe sends no key.
"""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from rlx.engine.serve.generate_routes import GenerateEndpoint, generate_routes
from rlx.engine.serve.info_routes import info_routes
from rlx.engine.serve.memory_routes import memory_routes
from rlx.engine.serve.protocol import error_body
from rlx.engine.serve.route_helpers import error_response
from rlx.engine.serve.weight_routes import weight_routes

# every route of SGLang's API the server has but /generate (`GenerateEndpoint`, plain ASGI; `app.routes`
# lists an included router as one entry)
ROUTERS = (generate_routes, info_routes, memory_routes, weight_routes)


async def _bad_request(request: Request, exc: Exception) -> JSONResponse:
    return error_response(str(exc))


class RequireApiKey:
    """ASGI middleware: 401 (SGLang's body) unless `Authorization: Bearer KEY`, on every route but
    `GET /health`. Plain ASGI, not Starlette's BaseHTTPMiddleware, which would hide client
    disconnects from the generate route's wait (`generate_routes._await_results`)."""

    OPEN = ("/health",)  # sglang-router probes liveness without the key

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.OPEN:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await JSONResponse(error_body("Unauthorized"), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(server: Any) -> FastAPI:
    """A FastAPI app with SGLang's native endpoints but /generate, serving `server` (an
    `EngineServer`)."""
    app = FastAPI()
    app.state.server = server
    for routes in ROUTERS:
        app.include_router(routes)
    app.add_exception_handler(ValueError, _bad_request)
    return app


def serve_app(app: FastAPI, server: Any, api_key: str | None = None):
    """What uvicorn serves: /generate in plain ASGI (`GenerateEndpoint`) ahead of `app`, whose
    middleware and routing it skips, and with `api_key` the key's check around both (see the
    module doc)."""
    outer = GenerateEndpoint(app, server)
    return RequireApiKey(outer, api_key) if api_key else outer
