"""SGLang's weight-update endpoints of the engine server, for the two paths besides disk:

    POST /update_weights_from_tensor       colocated: CUDA IPC handles (GPU) or shared memory (CPU)
    POST /init_weights_update_group        split: join the trainer's broadcast group
    POST /update_weights_from_distributed  split: receive one broadcast bucket
    POST /destroy_weights_update_group

Bodies and replies follow SGLang's (`{"success": bool, "message": str}`). Payloads are decoded by
`rlx.weight_sync`; the tensors are copied into the live weights on the engine's scheduler thread,
after the requests queued before them, by `Engine.load_named_weights`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

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
    server = request.app.state.server
    version = body.get("weight_version")
    load = lambda: server.engine.load_named_weights(named, None if version is None else str(version))  # noqa: E731
    try:
        num = await asyncio.wrap_future(server.scheduler.call(load))
    except (RuntimeError, ValueError) as e:
        return _reply(False, f"failed to load weights: {e}")
    return _reply(True, f"loaded {num} tensors")


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
