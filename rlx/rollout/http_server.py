"""SGLang's native HTTP API in front of a `LocalEngine`, so rlx talks to it as to SGLang.

Endpoints, request and response JSON follow sglang 0.5.4 (`sglang/srt/entrypoints/http_server.py`,
`sglang/srt/managers/io_struct.py`, `tokenizer_manager.py::_handle_batch_output`), the release
sglang-router 0.3.2 ships with; `/model_info` and `/server_info` are the newer names of the same.

A scheduler thread owns the engine (`rlx.engine`) and runs its continuous-batching loop:
requests join the running batch at the next step and leave it when they finish. Weight
updates and memory release run on the same thread once the requests before them have
finished, so no request ever sees half-loaded weights or a released cache.

(Over 400 lines: scheduler, endpoints and CLI share private state; Scheduler could move to its own module.)

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

Run as a child process with sglang.launch_server's flag names:
    python -m rlx.rollout.http_server --model-path DIR --host 127.0.0.1 --port 30000 --random-seed 0
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import logging
import queue
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

import rlx
from rlx.engine.sequence import Sequence, Status
from rlx.rollout.local import GenerateOutput, GenerateRequest, LocalEngine, SamplingParams, abort_reason
from rlx.rollout.sglang import build_response, error_body, model_info_body, parse_generate
from rlx.rollout.weight_routes import weight_routes

logger = logging.getLogger(__name__)

_STOP = object()


@dataclass(eq=False)
class _Pending:
    """A request waiting for, or in, the engine; `future` resolves to (output, weight_version)."""

    request: GenerateRequest
    counted: bool = True  # health checks are not counted, as in SGLang
    aborted: bool = False
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    seq: Sequence | None = None  # once the engine has it


class Scheduler:
    """Owns the engine on one thread and runs its continuous-batching loop.

    Each turn takes what arrived (requests join the running batch at the next step), applies
    aborts, and runs one engine step. A call (weight update, memory release) runs between
    steps once every request queued before it has finished; what arrives after it waits.
    """

    def __init__(self, engine: LocalEngine, max_batch_size: int, batch_wait_s: float = 0.005):
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.num_requests_total = 0  # finished counted requests
        self.last_gen_throughput = 0.0  # output tokens/s over the last steps
        self._queue: queue.Queue = queue.Queue()
        self._held: list[Any] = []  # arrived behind a call that waits for the engine to drain
        self._live: set[_Pending] = set()
        self._in_engine: list[_Pending] = []
        self._stopped = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="rlx-scheduler", daemon=True)

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything in flight and end the thread; later requests are answered as aborted."""
        with self._lock:
            self._stopped = True
        self.abort(abort_all=True)
        self._queue.put(_STOP)
        self._thread.join(timeout)

    def submit(self, requests: list[GenerateRequest], counted: bool = True) -> list[_Pending]:
        pendings = [_Pending(r, counted) for r in requests]
        with self._lock:
            stopped = self._stopped
            if not stopped:
                self._live.update(pendings)
                for pending in pendings:
                    self._queue.put(pending)
        for pending in pendings if stopped else []:
            self._finish(
                pending, GenerateOutput(pending.request.rid, [], [], abort_reason("Server shut down"))
            )
        return pendings

    def call(self, fn) -> concurrent.futures.Future:
        """Run `fn()` on the scheduler thread after the requests queued before it have finished."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopped:
                future.set_exception(RuntimeError("server shut down"))
            else:
                self._queue.put((fn, future))
        return future

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        """SGLang's rule: `rid` must name a live request; every rid it prefixes is aborted."""
        with self._lock:
            live = list(self._live)
        if not abort_all and all(p.request.rid != rid for p in live):
            return 0
        hits = [p for p in live if abort_all or p.request.rid.startswith(rid)]
        for pending in hits:
            pending.aborted = True
        return len(hits)

    def num_waiting(self) -> int:
        with self._lock:
            return max(len(self._live) - self.num_running, 0)

    def num_tokens(self) -> int:
        """Prompt tokens of the requests queued or running (the load sglang-router balances on)."""
        with self._lock:
            return sum(len(p.request.input_ids) for p in self._live)

    def _loop(self) -> None:
        while True:
            idle = not self.engine.has_work()
            if not self._take(block=idle):
                break
            if idle and self.engine.has_work() and self.batch_wait_s > 0:
                time.sleep(self.batch_wait_s)  # let a burst of requests share the first step
                if not self._take(block=False):
                    break
            self._apply_aborts()
            self._step()
        self._drain()

    def _take(self, block: bool) -> bool:
        """Move arrivals into the engine (or run a due call); False once stopped."""
        items = [*self._held, *iter_queue(self._queue)]
        self._held = []
        if block and not items:
            items = [self._queue.get()]
        for index, item in enumerate(items):
            if item is _STOP:
                self._held = items[index:]
                return False
            if isinstance(item, _Pending):
                self._admit(item)
            elif self.engine.has_work():  # a call waits for the engine to drain
                self._held = items[index:]
                return True
            else:
                fn, future = item
                try:
                    future.set_result(fn())
                except Exception as exc:  # reported to the caller, the scheduler keeps running
                    future.set_exception(exc)
        return True

    def _admit(self, pending: _Pending) -> None:
        if pending.aborted:  # never started: SGLang's queued abort
            output = GenerateOutput(pending.request.rid, [], [], abort_reason("Abort before prefill"))
            self._finish(pending, output)
            return
        try:
            pending.seq = self.engine.add(pending.request, tag=pending)
        except RuntimeError as exc:  # the engine cannot take requests now (weights not loaded)
            self._finish(pending, exc)
            return
        if pending.seq.status is Status.FINISHED:  # nothing to generate (max_new_tokens 0)
            self._finish(pending, pending.seq.output())
        else:
            self._in_engine.append(pending)

    def _apply_aborts(self) -> None:
        for pending in self._in_engine:
            if pending.aborted:
                self.engine.abort(pending.seq)
        done = [p for p in self._in_engine if p.seq.status is Status.FINISHED]
        for pending in done:
            self._finish(pending, pending.seq.output())
        self._in_engine = [p for p in self._in_engine if p.seq.status is not Status.FINISHED]

    def _step(self) -> None:
        if not self.engine.has_work():
            return
        start = time.perf_counter()
        try:
            finished = self.engine.step()
        except Exception as exc:  # an engine bug fails the requests in flight, not the server
            logger.exception("engine step failed")
            for pending in self._in_engine:
                self.engine.abort(pending.seq)
                self._finish(pending, exc)
            self._in_engine = []
            return
        elapsed = max(time.perf_counter() - start, 1e-9)
        self.last_gen_throughput = self.engine.num_running / elapsed
        for seq in finished:
            self._finish(seq.tag, seq.output())
        if finished:
            self._in_engine = [p for p in self._in_engine if p.seq.status is not Status.FINISHED]

    def _finish(self, pending: _Pending, result: GenerateOutput | Exception) -> None:
        with self._lock:
            self._live.discard(pending)
        if isinstance(result, Exception):
            pending.future.set_exception(result)
            return
        if pending.counted:
            self.num_requests_total += 1
        pending.future.set_result((result, self.engine.weight_version))

    def _drain(self) -> None:
        for pending in self._in_engine:
            self.engine.abort(pending.seq, "Server shut down")
            self._finish(pending, pending.seq.output())
        self._in_engine = []
        for item in [*self._held, *iter_queue(self._queue)]:
            if isinstance(item, _Pending):
                self._finish(item, GenerateOutput(item.request.rid, [], [], abort_reason("Server shut down")))
            elif isinstance(item, tuple):
                item[1].set_exception(RuntimeError("server shut down"))


def iter_queue(q: queue.Queue):
    """Everything currently in `q`, without blocking."""
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return


class EngineServer:
    """SGLang-compatible HTTP server for a `LocalEngine`, on a background thread.

    `start()` returns once the port is bound and serving (`port=0` picks a free one); `url`
    is then valid. A plain class: the Ray actor that hosts an engine wraps it.
    """

    def __init__(
        self,
        engine: LocalEngine,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_batch_size: int | None = None,
        batch_wait_s: float = 0.005,
        api_key: str | None = None,
    ):
        self.engine = engine
        self.host = host
        self.port = port
        self.scheduler = Scheduler(engine, max_batch_size or engine.max_batch_size, batch_wait_s)
        self.app = build_app(self, api_key)
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> EngineServer:
        """Bind, start the scheduler and the HTTP thread; return once requests are served."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(2048)
        self.port = sock.getsockname()[1]
        self.scheduler.start()
        # "error": sglang-router's start-up probe for a gRPC worker makes uvicorn warn about HTTP/2.
        config = uvicorn.Config(
            self.app, log_level="error", access_log=False, lifespan="off", timeout_graceful_shutdown=5
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, name=f"rlx-http-{self.port}", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"engine HTTP server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Abort in-flight requests (they answer with finish_reason abort), then shut down."""
        self.scheduler.stop()
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=15)
        self._server = self._thread = None

    def server_args(self) -> dict[str, Any]:
        """The launch configuration reported by /get_server_info (SGLang's ServerArgs names)."""
        engine = self.engine
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.tokenizer_path,
            "served_model_name": engine.served_model_name,
            "host": self.host,
            "port": self.port,
            "dtype": engine.dtype,
            "random_seed": engine.seed,
            "context_length": engine.context_length,
            "max_running_requests": self.scheduler.max_batch_size,
            "mem_fraction_static": engine.args.mem_fraction_static,
            "chunked_prefill_size": engine.args.chunked_prefill_size,
            "page_size": engine.args.page_size,
            "max_total_num_tokens": engine.blocks.capacity_tokens,
            "disable_cuda_graph": engine.runner.graphs is None,
            "device": engine.device.type,
            "tp_size": 1,
            "dp_size": 1,
            "skip_tokenizer_init": False,
            "weight_version": engine.weight_version,
        }

    def internal_state(self) -> dict[str, Any]:
        """Live scheduler state (SGLang's `internal_states` entry) plus rlx's request counter."""
        return {
            "num_requests_total": self.scheduler.num_requests_total,
            "num_running_reqs": self.scheduler.num_running,
            "num_waiting_reqs": self.scheduler.num_waiting(),
            "last_gen_throughput": self.scheduler.last_gen_throughput,
            "weight_version": self.engine.weight_version,
        }


def error_response(message: str, status_code: int = 400) -> JSONResponse:
    return JSONResponse(error_body(message), status_code=status_code)


async def _json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object; ValueError (-> 400) if it is not one."""
    try:
        body = await request.json()
    except ValueError as exc:
        raise ValueError(f"invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("the JSON body must be an object")
    return body


async def _await_results(pendings: list[_Pending], request: Request) -> list:
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
            for pending in pendings:
                pending.aborted = True


routes = APIRouter()


def _server(request: Request) -> EngineServer:
    return request.app.state.server


@routes.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request):
    """SGLang's /generate: single or batch, input_ids or text; SSE with one event if `stream`."""
    body, engine, scheduler = await _json_body(request), _server(request).engine, _server(request).scheduler
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


@routes.get("/health")
async def health(request: Request):
    return Response(status_code=200 if _server(request).scheduler.alive() else 503)


@routes.get("/health_generate")
async def health_generate(request: Request):
    """One greedy token through the scheduler, as SGLang's health check does."""
    probe = GenerateRequest(
        [0], SamplingParams(max_new_tokens=1, temperature=0.0), f"HEALTH_CHECK_{uuid.uuid4().hex}"
    )
    (pending,) = _server(request).scheduler.submit([probe], counted=False)
    try:
        await asyncio.wait_for(asyncio.wrap_future(pending.future), timeout=20)
    except Exception:
        pending.aborted = True
        return Response(status_code=503)
    return Response(status_code=200)


@routes.get("/get_model_info")
@routes.get("/model_info")
async def model_info(request: Request):
    return model_info_body(_server(request).engine)


@routes.get("/get_server_info")
@routes.get("/server_info")
async def server_info(request: Request):
    server = _server(request)
    return {
        **server.server_args(),
        "internal_states": [server.internal_state()],
        "version": f"rlx-{rlx.__version__}",
    }


@routes.get("/get_load")
async def get_load(request: Request):
    scheduler = _server(request).scheduler
    waiting, running, num_tokens = scheduler.num_waiting(), scheduler.num_running, scheduler.num_tokens()
    return [
        {"dp_rank": 0, "num_reqs": running + waiting, "num_waiting_reqs": waiting, "num_tokens": num_tokens}
    ]


@routes.get("/get_weight_version")
async def get_weight_version(request: Request):
    return {"weight_version": _server(request).engine.weight_version}


@routes.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request):
    """Forget the cached prompt prefixes; answered as SGLang does."""
    server = _server(request)
    await asyncio.wrap_future(server.scheduler.call(server.engine.blocks.forget_cached))
    message = "Cache flushed.\nPlease check backend logs for more details. "
    return Response(
        message + "(When there are running or waiting requests, the operation will not be performed.)\n"
    )


@routes.post("/abort_request")
async def abort_request(request: Request):
    body = await _json_body(request)
    _server(request).scheduler.abort(str(body.get("rid") or ""), bool(body.get("abort_all", False)))
    return Response(status_code=200)


@routes.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request):
    """Load new weights between steps (requests in flight finish first, unless abort_all_requests)."""
    body, engine, scheduler = await _json_body(request), _server(request).engine, _server(request).scheduler
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


@routes.post("/update_weight_version")
async def update_weight_version(request: Request):
    body, engine, scheduler = await _json_body(request), _server(request).engine, _server(request).scheduler
    if body.get("new_version") is None:
        raise ValueError("new_version is required")
    if body.get("abort_all_requests", True):
        scheduler.abort(abort_all=True)
    version = str(body["new_version"])
    await asyncio.wrap_future(scheduler.call(lambda: setattr(engine, "weight_version", version)))
    return {"success": True, "message": f"Weight version updated to {version}", "new_version": version}


async def _memory_call(request: Request, release: bool) -> Response:
    """SGLang's body: {"tags": ["weights", "kv_cache", ...]}, all when absent."""
    server = _server(request)
    try:
        body = await request.json()
    except ValueError:
        body = {}
    tags = (body or {}).get("tags") if isinstance(body, dict) else None
    method = server.engine.release_memory if release else server.engine.resume_memory
    await asyncio.wrap_future(server.scheduler.call(lambda: method(tags)))
    return Response(status_code=200)


@routes.api_route("/release_memory_occupation", methods=["GET", "POST"])
async def release_memory_occupation(request: Request):
    """Free the KV cache and/or weights on the GPU (after the requests in flight finish)."""
    return await _memory_call(request, release=True)


@routes.api_route("/resume_memory_occupation", methods=["GET", "POST"])
async def resume_memory_occupation(request: Request):
    return await _memory_call(request, release=False)


async def _bad_request(request: Request, exc: Exception) -> JSONResponse:
    return error_response(str(exc))


class RequireApiKey:
    """ASGI middleware: 401 (SGLang's body) unless `Authorization: Bearer KEY`, on every route but
    `GET /health`. Plain ASGI, not Starlette's BaseHTTPMiddleware, which would hide client
    disconnects from `_await_results`."""

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


def build_app(server: EngineServer, api_key: str | None = None) -> FastAPI:
    """A FastAPI app with SGLang's native endpoints, serving `server`; `api_key`: see the module doc."""
    app = FastAPI()
    app.state.server = server
    app.include_router(routes)
    app.include_router(weight_routes)  # the tensor and distributed weight paths
    app.add_exception_handler(ValueError, _bad_request)
    if api_key:
        app.add_middleware(RequireApiKey, api_key=api_key)
    return app


def arg_parser() -> argparse.ArgumentParser:
    """sglang.launch_server's flag names, those the local engine uses."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )  # an unknown SGLang flag must not match ours by prefix
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument("--max-running-requests", type=int, default=256)
    parser.add_argument("--num-threads", type=int, default=1)
    parser.add_argument("--tokenizer-path")
    parser.add_argument("--context-length", type=int)
    parser.add_argument("--served-model-name")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument(
        "--api-key",
        help="require `Authorization: Bearer KEY` (all routes but /health); see rlx.rollout.keyed_launch",
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    """CLI with sglang.launch_server's flag names; unknown SGLang flags are accepted and ignored."""
    args, unknown = arg_parser().parse_known_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    if unknown:
        logger.info("ignoring SGLang flags the local engine has no use for: %s", unknown)
    engine_args = {
        k: v
        for k, v in {
            "tokenizer_path": args.tokenizer_path,
            "context_length": args.context_length,
            "served_model_name": args.served_model_name,
            "weight_version": args.weight_version,
        }.items()
        if v is not None
    }
    engine = LocalEngine(
        args.model_path,
        dtype=args.dtype,
        seed=args.random_seed,
        max_batch_size=args.max_running_requests,
        num_threads=args.num_threads,
        **engine_args,
    )
    server = EngineServer(engine, args.host, args.port, api_key=args.api_key).start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"rlx engine serving {args.model_path} on {server.url}", flush=True)
    while not stop.wait(1.0):
        pass
    server.stop()


if __name__ == "__main__":
    main()
