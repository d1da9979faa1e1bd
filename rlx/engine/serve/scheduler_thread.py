"""The engine server's scheduler thread: it owns the engine and runs its continuous-batching loop.

Requests join the running batch at the next step and leave it when they finish. Weight updates
and memory release (`call`) run on the same thread once the requests before them have finished,
so no request ever sees half-loaded weights or a released cache. (Which requests run in a step,
under the token budget, is the engine's own scheduler's choice: `rlx.engine.scheduler`.)
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from rlx.engine.local import LocalEngine
from rlx.engine.sequence import GenerateOutput, GenerateRequest, Sequence, SequenceStatus, abort_reason

logger = logging.getLogger(__name__)

_STOP = object()


@dataclass(eq=False)
class Pending:
    """A request waiting for, or in, the engine; `future` resolves to (output, weight_version)."""

    request: GenerateRequest
    counted: bool = True  # health checks are not counted, as in SGLang
    aborted: bool = False
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    seq: Sequence | None = None  # once the engine has it


class SchedulerThread:
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
        self._live: set[Pending] = set()
        self._in_engine: dict[Pending, None] = {}  # in arrival order; a finished one leaves in O(1)
        # set when a request is aborted (`cancel`, `abort`): only then does a turn look for them
        self._abort_seen = False
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

    def submit(self, requests: list[GenerateRequest], counted: bool = True) -> list[Pending]:
        pendings = [Pending(r, counted) for r in requests]
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
        self.cancel(hits)
        return len(hits)

    def cancel(self, pendings: list[Pending]) -> None:
        """Abort these requests (from any thread): at the next turn, or before they start."""
        for pending in pendings:
            pending.aborted = True
        self._abort_seen = True

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
            if isinstance(item, Pending):
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

    def _admit(self, pending: Pending) -> None:
        if pending.aborted:  # never started: SGLang's queued abort
            output = GenerateOutput(pending.request.rid, [], [], abort_reason("Abort before prefill"))
            self._finish(pending, output)
            return
        try:
            pending.seq = self.engine.add(pending.request, tag=pending)
        except RuntimeError as exc:  # the engine cannot take requests now (weights not loaded)
            self._finish(pending, exc)
            return
        if pending.seq.status is SequenceStatus.FINISHED:  # nothing to generate (max_new_tokens 0)
            self._finish(pending, pending.seq.output())
        else:
            self._in_engine[pending] = None

    def _apply_aborts(self) -> None:
        """Aborted requests out of the engine, answered with what they have. A turn without an
        abort since the last skips the scan (1,024 requests: three passes a step otherwise)."""
        if not self._abort_seen:
            return
        self._abort_seen = False  # before the scan: an abort during it is seen next turn
        for pending in self._in_engine:
            if pending.aborted:
                self.engine.abort(pending.seq)
        done = [p for p in self._in_engine if p.seq.status is SequenceStatus.FINISHED]
        for pending in done:
            del self._in_engine[pending]
            self._finish(pending, pending.seq.output())

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
            self._in_engine = {}
            return
        elapsed = max(time.perf_counter() - start, 1e-9)
        self.last_gen_throughput = self.engine.num_running / elapsed
        for seq in finished:
            self._in_engine.pop(seq.tag, None)
            self._finish(seq.tag, seq.output())

    def _finish(self, pending: Pending, result: GenerateOutput | Exception) -> None:
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
        self._in_engine = {}
        for item in [*self._held, *iter_queue(self._queue)]:
            if isinstance(item, Pending):
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
