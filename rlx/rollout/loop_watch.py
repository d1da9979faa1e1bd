"""Notices the rollout loop stuck in one callback and names where, so that the run ends with that
message instead of hanging.

Every generate_fn, tool call and engine request of a run shares the rollout pool's one event loop
(`rlx.rollout.pool`). A `rollout.generate_fn` that blocks instead of awaiting (`time.sleep`, a
blocking HTTP client such as `requests` without a timeout, a busy loop) stops all of them, and the
timeouts that would end a hung request cannot fire either, since they run on that loop. The watch
keeps a heartbeat on the loop; whoever waits for the loop from another thread (`LoopWatch.wait`:
the driver) raises `RolloutLoopBlocked` once the heartbeat has been late for `BLOCKED_S`, naming
the frames the loop's thread is in.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import sys
import threading
import time
import traceback

from rlx.errors import UserError

BLOCKED_S = 60.0  # a callback that runs this long without yielding is stuck, not slow
BEAT_S = 1.0  # the heartbeat's period, and how often a waiter looks at it


class RolloutLoopBlocked(UserError):
    """The rollout loop has run one callback for longer than `BLOCKED_S`; the message names where."""


class LoopWatch:
    """A heartbeat on `loop` (run by `thread`), and waits on it that give up when it stops."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        thread: threading.Thread,
        blocked_s: float = BLOCKED_S,
        beat_s: float = BEAT_S,
    ):
        self.loop, self.thread, self.blocked_s, self.beat_s = loop, thread, blocked_s, beat_s
        self._beat = time.monotonic()
        loop.call_soon_threadsafe(self._tick)

    def _tick(self) -> None:
        self._beat = time.monotonic()
        self.loop.call_later(self.beat_s, self._tick)

    def stuck(self) -> str | None:
        """None while the loop keeps its heartbeat; else what its thread has been running instead."""
        late = time.monotonic() - self._beat - self.beat_s
        if late < self.blocked_s or not self.thread.is_alive():
            return None
        return (
            f"the rollout loop has run one callback for {late:.0f} s without yielding, in {where(self.thread)}. "
            "A rollout.generate_fn, or a tool or reward it calls on the loop, that blocks (time.sleep, a "
            "blocking HTTP client, a busy loop) stops every sample and every request's timeout: await "
            "instead (asyncio.sleep, aiohttp), or run blocking work with `await asyncio.to_thread(f, ...)`"
        )

    def wait(self, future: concurrent.futures.Future):
        """`future.result()` (a coroutine's on the loop), or RolloutLoopBlocked once the loop is stuck.
        A wait that ends otherwise (a second Ctrl-C raising KeyboardInterrupt in it, the loop stuck)
        cancels the coroutine: left running, it went on sending requests while the run shut its
        engines and HTTP sessions down, and opened a session of its own that nothing closed."""
        try:
            while True:
                done, _ = concurrent.futures.wait([future], timeout=self.beat_s)
                if done:
                    return future.result()
                if (message := self.stuck()) is not None:
                    raise RolloutLoopBlocked(message)
        except BaseException:
            future.cancel()  # a no-op once it is done
            raise


def where(thread: threading.Thread, depth: int = 6) -> str:
    """The innermost `depth` frames `thread` is running, below the event loop's own, outermost first:
    "FILE:LINE in FUNCTION > ..." (paths relative to the working directory where they lie under it)."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "(the thread has ended)"
    stack = traceback.extract_stack(frame)
    loop_frames = [
        i for i, f in enumerate(stack) if f.filename.endswith(os.path.join("asyncio", "events.py"))
    ]
    stack = stack[loop_frames[-1] + 1 :] if loop_frames else stack
    cwd = os.getcwd() + os.sep
    return " > ".join(f"{f.filename.removeprefix(cwd)}:{f.lineno} in {f.name}" for f in stack[-depth:])
