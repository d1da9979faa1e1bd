"""SGLang's read-only routes: liveness (`/health`), the model and the server's configuration and
state, the load sglang-router balances on, and the weight version served."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

import rlx
from rlx.engine.serve.protocol import model_info_body
from rlx.engine.serve.route_helpers import server_of

info_routes = APIRouter()


@info_routes.get("/health")
async def health(request: Request):
    return Response(status_code=200 if server_of(request).scheduler.alive() else 503)


@info_routes.get("/get_model_info")
@info_routes.get("/model_info")
async def model_info(request: Request):
    return model_info_body(server_of(request).engine)


@info_routes.get("/get_server_info")
@info_routes.get("/server_info")
async def server_info(request: Request):
    server = server_of(request)
    return {
        **server.server_args(),
        "internal_states": [server.internal_state()],
        "version": f"rlx-{rlx.__version__}",
    }


@info_routes.get("/get_load")
async def get_load(request: Request):
    scheduler = server_of(request).scheduler
    waiting, running, num_tokens = scheduler.num_waiting(), scheduler.num_running, scheduler.num_tokens()
    return [
        {"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": num_tokens}
    ]


@info_routes.get("/get_weight_version")
async def get_weight_version(request: Request):
    return {"weight_version": server_of(request).engine.weight_version}
