"""rlx's engine behind SGLang's native HTTP API, so rlx talks to it as to SGLang.

Endpoints, request and response JSON follow sglang 0.5.4 (`sglang/srt/entrypoints/http_server.py`,
`sglang/srt/managers/io_struct.py`, `tokenizer_manager.py::_handle_batch_output`), the release
sglang-router 0.3.2 ships with; `/model_info` and `/server_info` are the newer names of the same.
One job per module:

- `server`: `EngineServer`, the scheduler thread and uvicorn's on one bound socket;
- `scheduler_thread`: the thread that owns the engine and runs its continuous-batching loop;
- `app`: what uvicorn serves: the FastAPI app of SGLang's routes, /generate ahead of it, the API key;
- `protocol`: SGLang's /generate JSON to the engine's requests and back, its other bodies;
- `generate_routes`, `info_routes`, `memory_routes`, `weight_routes`: the endpoints, by what they do;
- `route_helpers`: what the routes share (the server, the JSON body, SGLang's error reply);
- `cli` (run by `__main__`): `python -m rlx.engine.serve`, sglang.launch_server's flags.

The public entry point for the rest of rlx: `python -m rlx.engine.serve` (a child process, started
like SGLang's server by `rlx.rollout.sglang`) or `start_server` (in this process, for
`rlx.rollout.launchers.LocalLauncher`, which may first call `load_ahead` in a process started ahead
of its engine). Everything else talks to the engine over HTTP only.
"""

from __future__ import annotations

from typing import Any

from rlx.engine.checkpoint import load_ahead
from rlx.engine.local import LocalEngine
from rlx.engine.serve.server import EngineServer


def start_server(
    model_path: str,
    engine_args: dict[str, Any] | None = None,
    *,
    seed: int = 0,
    num_threads: int = 1,
    host: str = "127.0.0.1",
    port: int = 0,
    api_key: str | None = None,
) -> EngineServer:
    """rlx's engine for `model_path` (`engine_args`: SGLang's server-argument names) served in this
    process on `host:port` (0: a free port), on background threads; returns once it serves.
    `api_key`: required on every route but /health (`rlx.engine.serve.app`)."""
    engine = LocalEngine(model_path, seed=seed, num_threads=num_threads, **dict(engine_args or {}))
    return EngineServer(engine, host, port, api_key=api_key).start()


__all__ = ["EngineServer", "load_ahead", "start_server"]
