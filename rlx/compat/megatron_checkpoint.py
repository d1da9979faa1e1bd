"""megatron-core's distributed checkpoint save, without the process it starts for asynchronous saves.

megatron's filesystem writer (`megatron.core.dist_checkpointing.strategies.filesystem_async`)
hands its write results over a `multiprocessing.get_context("spawn").Manager().Queue()`, made on a
process's first save, so that an asynchronous save running in another process can report back.
The manager is a new Python interpreter that imports the parent's main module: 4.4 s of a trainer
rank's first checkpoint in a Ray actor (6.8 s in a script that imports rlx's trainer) on the
2-core CPU machine, for every rank of every run that saves. The second save of a process: 0.16 s.

rlx saves synchronously (`dist_checkpointing.save`: megatron's `AsyncRequest.execute_sync`), so
the results are put and taken in the rank's own process (its writer children report to the rank
over a queue of their own), and a thread-safe in-process queue carries them as well.
`in_process_results()` puts one in place for one save and restores megatron's afterwards: an
asynchronous save elsewhere in the process still gets megatron's manager.
"""

from __future__ import annotations

import contextlib
import queue
from collections.abc import Iterator


@contextlib.contextmanager
def in_process_results() -> Iterator[None]:
    """For a synchronous `dist_checkpointing.save` inside the block: the write results over an
    in-process queue instead of megatron's multiprocessing manager."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):  # another megatron: leave it as it is
        yield
        return
    previous = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = previous
