"""Split placement: trainer rank 0 broadcasts weight buckets to engine processes over a private group.

The group is built directly on a `TCPStore` (`ProcessGroupGloo` on CPU, `ProcessGroupNCCL` on
GPU), never through `torch.distributed.init_process_group`, so it lives beside the trainer's
megatron world and needs none in the engines. Rank 0 is the trainer and hosts the store at
`master_address:master_port`; engines are ranks 1..N (SGLang: `rank_offset + tp_rank`).

The store keys follow the layout SGLang's `init_custom_process_group` reaches through torch's
group helper (`<group>` / `<group>/` / `<device>/` prefixes), so a real SGLang server that got
`/init_weights_update_group` with the same fields joins the same group as `WeightReceiver`.

Per bucket, the receiver must learn the metadata before the broadcast can finish: the sender
calls `announce(meta)` (the integrator posts `/update_weights_from_distributed` with
`load_format="flattened_bucket"` and returns a wait function), broadcasts the one flat buffer,
then waits. Every step has a timeout: a peer that never joins raises `WeightSyncError` naming
the address instead of hanging.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from rlx.ports import held_store, pin_collectives, route_address, tcp_store
from rlx.weight_sync.buckets import BucketMeta, flatten, iter_buckets, unflatten

__all__ = ["Announce", "WeightReceiver", "WeightSender", "WeightSyncError"]

DEFAULT_GROUP = "weight_update_group"  # SGLang's default `group_name`
HOSTED_TIMEOUT_S = 300.0  # a hosted store's own operations (torch's TCPStore default)

# Called with each bucket's metadata before its broadcast; may return a function that blocks
# until the receivers have loaded the bucket (for example the HTTP responses).
Announce = Callable[[BucketMeta], Callable[[], Any] | None]


class WeightSyncError(RuntimeError):
    """A weight-sync group failed to form or a transfer failed; the message names the address."""


class _Group:
    """A store and a process group of one backend, outside any default torch.distributed world."""

    def __init__(
        self,
        address: str,
        port: int,
        rank: int,
        world_size: int,
        backend: str,
        group_name: str,
        timeout_s: float,
        store: dist.TCPStore | None = None,
    ):
        """`store`: the master's, already hosted (`WeightSender.host`); else one is made here."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.where = f"{address}:{port} (group {group_name!r}, rank {rank} of {world_size}, {backend})"
        self.rank, self.backend = rank, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        pin_collectives(address)  # one node: gloo and NCCL on loopback
        try:
            # A missing engine shows up here, after `timeout_s`, not never: the master of a store
            # made here waits for every peer (wait_for_workers); on a hosted store the process
            # group's own rendezvous waits as long.
            if store is None:
                store = tcp_store(
                    address, port, is_master=rank == 0, world_size=world_size, timeout_s=timeout_s
                )
            self.store = store
            device = "cuda" if backend == "nccl" else "cpu"
            prefixed = dist.PrefixStore(
                f"{device}/", dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, self.store))
            )
            self.pg = _process_group(backend, prefixed, rank, world_size, timeout, route_address(address))
        except (dist.DistError, RuntimeError, OSError) as e:  # OSError: the address cannot be bound
            raise WeightSyncError(
                f"weight-sync group at {self.where} did not form within {timeout_s:g} s: {e}"
            ) from e
        self.device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )

    def broadcast(self, flat: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        try:
            self.pg.broadcast([flat], options).wait()
        except (dist.DistError, RuntimeError) as e:
            raise WeightSyncError(f"broadcast of {flat.numel()} bytes over {self.where} failed: {e}") from e

    def close(self) -> None:
        # NCCL communicators hold GPU memory and threads until freed; gloo just drops sockets.
        # Aborted, not shut down: shutdown() destroys the communicator, and NCCL's destroy waits
        # for every rank on the node to destroy theirs too, so a sender leaving first (or a group
        # re-formed without a dead engine) would hang. Every broadcast here was waited on; the
        # synchronize makes sure the last one has landed before the communicator goes.
        if self.backend == "nccl":
            torch.cuda.synchronize(self.device)
            end = getattr(self.pg, "abort", None) or getattr(self.pg, "shutdown", None)
            if end is not None:
                end()
        del self.pg, self.store


def _process_group(
    backend: str,
    store: dist.Store,
    rank: int,
    world_size: int,
    timeout: datetime.timedelta,
    local_address: str,
):
    """`local_address`: this process's address towards rank 0, which gloo binds (its default is
    what the hostname resolves to: loopback on many clusters, Debian's 127.0.1.1), unless
    GLOO_SOCKET_IFNAME names an interface."""
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        interface = os.environ.get("GLOO_SOCKET_IFNAME")
        device = dist.ProcessGroupGloo.create_device(
            **({"interface": interface} if interface else {"hostname": local_address})
        )
        options._devices = [device]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


class WeightSender:
    """Trainer rank 0: hosts the group and broadcasts buckets of named tensors to ranks 1..N."""

    def __init__(self) -> None:
        self._group: _Group | None = None
        self._buffer: torch.Tensor | None = None
        self._hosted: dist.TCPStore | None = None

    def host(self, master_address: str) -> int:
        """Start hosting the group's store on `master_address`, on a port it holds
        (`rlx.ports.held_store`); that port, for `init` and the receivers."""
        self._hosted = held_store(master_address, HOSTED_TIMEOUT_S)
        return self._hosted.port

    def init(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        backend: str = "gloo",
        group_name: str = DEFAULT_GROUP,
        timeout_s: float = 300.0,
    ) -> None:
        """Join as rank 0, on the store `host` made (its port is `master_port`), else on one
        hosted here now; blocks until all `world_size - 1` receivers join."""
        if self._group is not None:
            raise WeightSyncError(f"already joined {self._group.where}; close() first")
        hosted, self._hosted = self._hosted, None
        if hosted is not None and hosted.port != master_port:
            raise ValueError(
                f"master_port={master_port}, but host() is serving the store on port {hosted.port}"
            )
        self._group = _Group(
            master_address, master_port, 0, world_size, backend, group_name, timeout_s, store=hosted
        )

    def send(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        bucket_bytes: int,
        announce: Announce | None = None,
    ) -> list[BucketMeta]:
        """Broadcast the tensors bucket by bucket; returns each bucket's metadata, in order.

        `named_tensors` is consumed lazily (one bucket held at a time). Tensors must be on the
        group's device (CUDA for nccl, CPU for gloo); one flat buffer is reused across buckets.
        """
        group = self._require_group()
        sent = []
        for bucket in iter_buckets(named_tensors, bucket_bytes):
            nbytes = sum(tensor.numel() * tensor.element_size() for _, tensor in bucket)
            meta, flat = flatten(bucket, out=self._buffer_for(nbytes, group.device))
            wait = announce(meta) if announce is not None else None
            group.broadcast(flat)
            if wait is not None:
                wait()
            sent.append(meta)
        return sent

    def _buffer_for(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes or self._buffer.device != device:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._buffer

    def _require_group(self) -> _Group:
        if self._group is None:
            raise WeightSyncError("WeightSender.init() was not called (or the group was closed)")
        return self._group

    def close(self) -> None:
        """Leave the group and stop hosting the store; `init` may be called again afterwards."""
        if self._group is not None:
            self._group.close()
        self._group, self._buffer = None, None


class WeightReceiver:
    """Engine side (ranks 1..N): receives each bucket into one reusable flat buffer."""

    def __init__(self) -> None:
        self._group: _Group | None = None
        self._buffer: torch.Tensor | None = None

    def init(
        self,
        master_address: str,
        master_port: int,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        group_name: str = DEFAULT_GROUP,
        timeout_s: float = 300.0,
    ) -> None:
        """Join the sender's group as `rank` (>= 1); blocks until the whole group has formed."""
        if rank == 0:
            raise ValueError("rank 0 is the sender's; receivers are ranks 1..world_size-1")
        if self._group is not None:
            raise WeightSyncError(f"already joined {self._group.where}; close() first")
        self._group = _Group(master_address, master_port, rank, world_size, backend, group_name, timeout_s)

    def receive(self, meta: BucketMeta) -> list[tuple[str, torch.Tensor]]:
        """Receive one bucket; returns (name, view) pairs into the shared buffer.

        The views are overwritten by the next `receive`: copy them into the parameters first.
        """
        if self._group is None:
            raise WeightSyncError("WeightReceiver.init() was not called (or the group was closed)")
        device = self._group.device
        if self._buffer is None or self._buffer.numel() < meta.nbytes:
            self._buffer = torch.empty(meta.nbytes, dtype=torch.uint8, device=device)
        flat = self._buffer[: meta.nbytes]
        self._group.broadcast(flat)
        return unflatten(flat, meta)

    def close(self) -> None:
        """Leave the group and free the buffer; `init` may be called again afterwards."""
        if self._group is not None:
            self._group.close()
        self._group, self._buffer = None, None
