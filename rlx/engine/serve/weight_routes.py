"""SGLang's weight-update endpoints of the engine server, one per path:

    POST /update_weights_from_disk         any: load the HF shards of a directory
    POST /update_weights_from_tensor       colocated: CUDA IPC handles (GPU) or shared memory (CPU)
    POST /init_weights_update_group        split: join the trainer's broadcast group
    POST /update_weights_from_distributed  split: receive one broadcast bucket
    POST /destroy_weights_update_group
    POST /update_weight_version            the version served, without new weights

Bodies and replies follow SGLang's (`{"success": bool, "message": str}`). Payloads are decoded by
`rlx.weight_sync`; the tensors are copied into the live weights on the engine's scheduler thread,
after the requests queued before them, by `Engine.load_named_weights`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rlx.engine.serve.route_helpers import json_body, server_of
from rlx.weight_sync.buckets import BucketMeta
from rlx.weight_sync.distributed import WeightReceiver
from rlx.weight_sync.tensor import deserialize

weight_routes = APIRouter()


def _reply(success: bool, message: str, status_code: int | None = None) -> JSONResponse:
    return JSONResponse(
        {"success": success, "message": message}, status_code=status_code or (200 if success else 400)
    )


async def _load(request: Request, named: list, body: dict[str, Any]) -> JSONResponse:
    """Copy `named` into the engine's weights on its scheduler thread; SGLang's reply."""
    server = server_of(request)
    version = body.get("weight_version")
    load = lambda: server.engine.load_named_weights(named, None if version is None else str(version))  # noqa: E731
    try:
        num = await asyncio.wrap_future(server.scheduler.call(load))
    except (RuntimeError, ValueError) as e:
        return _reply(False, f"failed to load weights: {e}")
    return _reply(True, f"loaded {num} tensors")


@weight_routes.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request):
    """Load new weights between steps (requests in flight finish first, unless abort_all_requests)."""
    body, server = await json_body(request), server_of(request)
    engine, scheduler = server.engine, server.scheduler
    path, version = body.get("model_path"), body.get("weight_version")
    if body.get("abort_all_requests"):
        scheduler.abort(abort_all=True)
    try:
        await asyncio.wrap_future(scheduler.call(lambda: engine.load_weights_from_disk(path, version)))
    except Exception as exc:
        failure = {"success": False, "message": f"Failed to update weights: {exc}.", "num_paused_requests": 0}
        return JSONResponse(failure, status_code=400)
    message = "Succeeded to update model weights."
    if version is not None:
        message += f" Weight version updated to {version}."
    return {"success": True, "message": message, "num_paused_requests": 0}


@weight_routes.post("/update_weight_version")
async def update_weight_version(request: Request):
    body, server = await json_body(request), server_of(request)
    engine, scheduler = server.engine, server.scheduler
    if body.get("new_version") is None:
        raise ValueError("new_version is required")
    if body.get("abort_all_requests", True):
        scheduler.abort(abort_all=True)
    version = str(body["new_version"])
    await asyncio.wrap_future(scheduler.call(lambda: setattr(engine, "weight_version", version)))
    return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}


@weight_routes.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request):
    body = await request.json()
    payloads = body.get("serialized_named_tensors") or []
    if not payloads:
        return _reply(False, "serialized_named_tensors is empty")
    try:  # one payload per tensor-parallel rank of the engine; rlx's engine has one
        named = deserialize(payloads[0])
    except Exception as e:  # a payload this engine cannot open is the request's fault
        return _reply(False, f"cannot deserialize serialized_named_tensors: {type(e).__name__}: {e}")
    try:
        return await _load(request, named, body)
    finally:
        del named  # the sender may free its tensors once we reply


def _receiver(request: Request) -> WeightReceiver:
    state = request.app.state
    if getattr(state, "weight_receiver", None) is None:
        state.weight_receiver = WeightReceiver()
    return state.weight_receiver


@weight_routes.post("/init_weights_update_group")
async def init_weights_update_group(request: Request):
    body = await request.json()
    try:  # blocks until the trainer and every engine have joined: off the event loop
        await asyncio.to_thread(
            _receiver(request).init,
            body["master_address"],
            int(body["master_port"]),
            int(body["rank_offset"]),
            int(body["world_size"]),
            body.get("backend") or "nccl",
            body.get("group_name") or "weight_update_group",
        )
    except Exception as e:
        return _reply(False, f"cannot join the weight update group: {type(e).__name__}: {e}")
    return _reply(True, "joined the weight update group")


@weight_routes.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request):
    body = await request.json()
    try:
        meta = BucketMeta.from_fields(body["names"], body["dtypes"], body["shapes"])
        named = await asyncio.to_thread(_receiver(request).receive, meta)  # the trainer's broadcast
    except Exception as e:
        return _reply(False, f"cannot receive the broadcast: {type(e).__name__}: {e}")
    return await _load(request, named, body)


@weight_routes.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request):
    # off the event loop: a receive still blocked on a failed broadcast holds the group until its timeout
    await asyncio.to_thread(_receiver(request).close)
    return _reply(True, "left the weight update group")
