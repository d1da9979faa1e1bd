"""The run's signal handling (`rlx.runtime._StopOnSignal`), called as the interpreter calls it: the
first SIGTERM/SIGINT lets the step finish, the second stops at once (`StoppedNow`, a
KeyboardInterrupt with the signal), and one that comes while the run ends its processes waits for
them (the handler the run restores afterwards would kill the driver midway)."""

from __future__ import annotations

import signal

import pytest

from rlx.errors import StoppedNow
from rlx.runtime import _StopOnSignal


def test_the_second_signal_stops_at_once_and_one_while_closing_waits():
    before = signal.getsignal(signal.SIGTERM)
    stop = _StopOnSignal()
    try:
        assert signal.getsignal(signal.SIGTERM) == stop._handle
        stop._handle(signal.SIGTERM, None)
        assert stop.signum == signal.SIGTERM  # the loop stops after its step
        with pytest.raises(StoppedNow, match="stopped at once by a second SIGINT") as e:
            stop._handle(signal.SIGINT, None)
        assert e.value.signum == signal.SIGINT and isinstance(e.value, KeyboardInterrupt)
        stop.closing()
        stop._handle(signal.SIGTERM, None)  # logged, not raised: the processes are being ended
        stop._handle(signal.SIGINT, None)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) == before
