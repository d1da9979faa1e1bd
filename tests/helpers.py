"""Helpers shared by tests: free ports, ranks spawned inside pytest, a one-rank megatron world."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn_ranks(fn: Callable, world_size: int, *args) -> None:
    """Run `fn(rank, world_size, port, *args)` in `world_size` fresh processes and wait.

    `fn` must be a module-level function (it is pickled by name). A failing rank raises here
    with its traceback.
    """
    mp.spawn(fn, args=(world_size, free_port(), *args), nprocs=world_size, join=True)


@contextlib.contextmanager
def megatron_world(rank: int = 0, world_size: int = 1, port: int | None = None, **parallel) -> Iterator[None]:
    """Megatron's parallel state over gloo (one rank in-process by default), torn down after."""
    from rlx.trainer.parallel import destroy_distributed, init_distributed

    init_distributed(rank, world_size, "127.0.0.1", port or free_port(), **parallel)
    try:
        yield
    finally:
        destroy_distributed()
