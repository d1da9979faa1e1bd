"""What every route of the engine server uses: the server it serves, the request's JSON body,
and SGLang's error reply."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from rlx.engine.serve.protocol import error_body


def server_of(request: Request) -> Any:
    """The `EngineServer` (`rlx.engine.serve.server`) whose app answers `request`: its `engine`
    and its `scheduler` (the scheduler thread). `build_app` puts it in the app's state."""
    return request.app.state.server


def error_response(message: str, status_code: int = 400) -> JSONResponse:
    return JSONResponse(error_body(message), status_code=status_code)


async def json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; ValueError (-> 400) if it is not one."""
    try:
        body = await request.json()
    except ValueError as exc:
        raise ValueError(f"invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("the JSON body must be an object")
    return body
