"""The engine server: rlx's engine behind SGLang's native HTTP API, on background threads.

Its scheduler thread (`scheduler_thread`) owns the engine; uvicorn serves the FastAPI app (`app`)
on a thread of its own, on a socket bound before `start()` returns.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import uvicorn

from rlx.engine.local import LocalEngine
from rlx.engine.serve.app import build_app, serve_app
from rlx.engine.serve.scheduler_thread import SchedulerThread


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
        self.scheduler = SchedulerThread(engine, max_batch_size or engine.max_batch_size, batch_wait_s)
        self.app = build_app(self)  # FastAPI: SGLang's routes but /generate
        self.asgi = serve_app(self.app, self, api_key)  # what uvicorn serves
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
        # No proxy headers: nothing reads the client's address, and each request skipped a layer.
        config = uvicorn.Config(
            self.asgi, log_level="error", access_log=False, lifespan="off", timeout_graceful_shutdown=5,
            proxy_headers=False,
        )  # fmt: skip
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
            "admission_group": engine.scheduler.admission_group,  # rlx's: the default resolved
            "page_size": engine.args.page_size,
            "max_total_num_tokens": engine.blocks.capacity_tokens,
            "disable_cuda_graph": engine.runner.graphs is None,
            "cuda_graph_max_bs": engine.runner.graphs.max_bs if engine.runner.graphs is not None else 0,
            # resolved: whether a release keeps the addresses (CUDA only; the decode graphs survive it)
            "enable_memory_saver": getattr(engine.model, "weight_arena", None) is not None,
            "device": engine.device.type,
            "tp_size": 1,
            "dp_size": 1,
            "skip_tokenizer_init": False,
            "weight_version": engine.weight_version,
        }

    def internal_state(self) -> dict[str, Any]:
        """Live scheduler state (SGLang's `internal_states` entry) plus rlx's counters."""
        graphs = self.engine.runner.graphs
        return {
            "num_requests_total": self.scheduler.num_requests_total,
            "num_running_reqs": self.scheduler.num_running,
            "num_waiting_reqs": self.scheduler.num_waiting(),
            "num_preempted_total": self.engine.scheduler.num_preempted,  # rlx's
            # rlx's: decode CUDA graphs captured so far and the seconds spent capturing them
            "num_cuda_graphs_captured": graphs.num_captured if graphs is not None else 0,
            "cuda_graph_capture_s": round(graphs.capture_s, 3) if graphs is not None else 0.0,
            "last_gen_throughput": self.scheduler.last_gen_throughput,
            "weight_version": self.engine.weight_version,
        }
