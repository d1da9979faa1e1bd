"""`rlx.rollout.loop_watch`: a wait on the rollout loop gives up, naming the frame, once one
callback has held the loop past the limit; results and the coroutine's own errors pass through."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rlx.rollout.loop_watch import LoopWatch, RolloutLoopBlocked


@pytest.fixture
def loop_and_watch():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop, LoopWatch(loop, thread, blocked_s=0.5, beat_s=0.1)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    loop.close()


async def answer() -> int:
    await asyncio.sleep(0.01)
    return 42


async def own_timeout() -> None:
    raise TimeoutError("the tool service did not answer")


async def blocks(seconds: float) -> None:
    time.sleep(seconds)  # the mistake: a blocking call on the loop


def test_results_and_errors_pass_through(loop_and_watch):
    loop, watch = loop_and_watch
    assert watch.wait(asyncio.run_coroutine_threadsafe(answer(), loop)) == 42
    with pytest.raises(TimeoutError, match="did not answer"):  # the coroutine's own, not the watch's
        watch.wait(asyncio.run_coroutine_threadsafe(own_timeout(), loop))
    time.sleep(1.0)  # an idle loop keeps its heartbeat
    assert watch.stuck() is None


def test_a_blocked_loop_is_named_within_the_limit(loop_and_watch):
    loop, watch = loop_and_watch
    start = time.monotonic()
    with pytest.raises(RolloutLoopBlocked) as e:
        watch.wait(asyncio.run_coroutine_threadsafe(blocks(4.0), loop))
    assert 0.5 <= time.monotonic() - start < 3.5  # the limit, the heartbeat's period, a look (and load)
    assert "test_loop_watch.py:" in str(e.value) and "in blocks" in str(e.value)
    assert "asyncio.to_thread" in str(e.value)  # the fix
    assert watch.stuck() is not None
    time.sleep(4.0 - (time.monotonic() - start) + 0.5)  # the call returned: the heartbeat again
    assert watch.stuck() is None


def test_an_interrupted_wait_cancels_its_coroutine(loop_and_watch):
    """A second SIGTERM or Ctrl-C raises KeyboardInterrupt inside the driver's wait (the run's
    handler, `rlx.runtime._StopOnSignal`): the coroutine it waited for is cancelled with it, so
    nothing goes on generating while the run shuts down."""
    import signal

    loop, watch = loop_and_watch
    cancelled = threading.Event()

    async def generating() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(KeyboardInterrupt):
            watch.wait(asyncio.run_coroutine_threadsafe(generating(), loop))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert cancelled.wait(5.0)
