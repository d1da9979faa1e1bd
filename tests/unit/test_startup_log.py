"""The start-up logs' account of the slowest trainer rank and engine (hand-made times against the
words and figures expected), and the process age they are read from."""

from __future__ import annotations

import subprocess
import sys
import time

from rlx import process_clock
from rlx.rollout.engines import _slowest_start as engine_start
from rlx.trainer.group import _slowest_start as rank_start

ASKED = 1000.0


def test_the_slowest_rank_is_the_one_ready_last_and_its_start_is_split():
    warm = [
        {"started": 1000.5, "loaded": 1004.0, "imports_s": 8.0, "runs": 0},  # ready at 1012.0
        {"started": 1000.2, "loaded": 1006.5, "imports_s": 7.0, "runs": 0},  # ready at 1013.5: the slowest
    ]
    assert rank_start(warm, ASKED) == (
        " (the slowest rank, ready 13.5 s after it was asked for: a new process: Python, Ray's worker and torch 6.5 s, "
        "then Megatron and the kernels 7.0 s)"
    )
    # Ray started it before it was asked
    pooled = [{"started": 900.0, "loaded": 1003.0, "imports_s": 9.0, "runs": 0}]
    assert rank_start(pooled, ASKED) == (
        " (the slowest rank, ready 12.0 s after it was asked for: an idle Ray worker taking it and importing torch 3.0 s, "
        "then Megatron and the kernels 9.0 s)"
    )
    kept = [{"started": 10.0, "loaded": 20.0, "imports_s": 0.01, "runs": 2}]  # an earlier run's process
    assert (
        rank_start(kept, ASKED)
        == " (the slowest rank: a process of an earlier run, Megatron and the kernels 0.0 s)"
    )
    preloaded = [{"started": 10.0, "loaded": 20.0, "imports_s": 0.04, "runs": 0}]  # rlx.trainer.preload
    assert rank_start(preloaded, ASKED) == (
        " (the slowest rank: an idle Ray worker with torch and Megatron preloaded, then the kernels 0.0 s)"
    )
    unknown = [{"started": None, "loaded": 1002.0, "imports_s": 1.0, "runs": 0}]  # no /proc: counted as new
    assert "a new process" in rank_start(unknown, ASKED)


def test_the_slowest_engine_is_split_into_its_start_and_set_up():
    new = [
        {"started": 1000.1, "loaded": 1001.5, "warm_up_s": None, "setup_s": 4.0},
        {"started": 1000.1, "loaded": 1002.0, "warm_up_s": None, "setup_s": 9.0},  # the slowest
    ]
    assert engine_start(new, ASKED) == (
        " (the slowest engine: a new process, Python and Ray 2.0 s, then its set-up (imports, the model, the server) 9.0 s)"
    )
    early = [{"started": 950.0, "loaded": 951.0, "warm_up_s": 6.25, "setup_s": 0.5}]
    pooled = [{"started": 900.0, "loaded": 1000.5, "warm_up_s": None, "setup_s": 3.0}]
    assert engine_start(pooled, ASKED).startswith(
        " (the slowest engine: an idle Ray worker taking it 0.5 s, then"
    )
    assert engine_start(early, ASKED) == (
        " (the slowest engine: its set-up (imports, the model, the server) 0.5 s, after a warm-up of 6.2 s before the pool)"
    )


def test_process_age_counts_from_the_process_start():
    code = "import time; time.sleep(0.6); from rlx import process_clock; print(process_clock.age())"
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    elapsed = time.monotonic() - began
    assert 0.6 <= float(out) <= elapsed + 0.02  # the kernel's clock ticks are 10 ms
    assert process_clock.age() > 0.6  # this test process started before the child
