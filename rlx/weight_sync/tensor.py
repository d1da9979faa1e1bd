"""Colocated placement: hand tensors to another process on the same machine without copying them
through a socket (SGLang's `/update_weights_from_tensor`).

A payload is a base64 string of a pickle made with torch's multiprocessing reductions (as SGLang's
`MultiprocessingSerializer` makes it): CUDA tensors travel as CUDA IPC handles, CPU tensors as
shared-memory files (torch's `file_system` strategy, so a process that shares no file descriptors
with the sender opens them by name). `serialize([(name, tensor), ...])` gives the form SGLang
takes with `load_format=None`, one string per engine TP rank in `serialized_named_tensors`.
`serialize_bucket` sends one flat bucket instead (one IPC handle or one file per bucket rather
than per tensor); only rlx's own engine reads that form.

Lifetime rule. The receiver maps the sender's memory; it does not own a copy. So:
  * the sender keeps the tensors (and its process) alive until the receiver has replied that it
    is done: `TensorHandoff` holds them and `release()` lets them go;
  * the receiver copies what it needs into its own parameters, drops every tensor that
    `deserialize` returned, and only then replies;
  * each payload is deserialised exactly once (reading it consumes the reference taken for it).
For CPU tensors the shared-memory file is unlinked when the last mapping is dropped on either
side, or by torch's shm manager when the sender's process exits, whichever comes first.
"""

from __future__ import annotations

import base64
import contextlib
import io
import pickle
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import TypeVar

import torch
import torch.multiprocessing  # noqa: F401  (registers torch's tensor reductions on ForkingPickler)

from rlx.weight_sync.buckets import BucketMeta, flatten, unflatten

__all__ = ["TensorHandoff", "deserialize", "serialize", "serialize_bucket"]

_FLAT_KEY = "rlx_flat_bucket"
MANAGER_TIMEOUT = "Shared memory manager connection has timed out"  # libshm's message
MANAGER_TRIES = 3
T = TypeVar("T")


@contextlib.contextmanager
def _file_system_sharing() -> Iterator[None]:
    # The default `file_descriptor` strategy passes fds over a multiprocessing connection, which an
    # HTTP receiver does not have; the strategy is process-global, so restore it afterwards.
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def _asking_again(call: Callable[[], T]) -> T:
    """`call()` with CPU tensors' file_system sharing, asked again (MANAGER_TRIES times in all)
    where torch's shared-memory manager (torch_shm_manager) timed out: it answers a new client
    within a fixed time, and on a host under full load once did not, on either side (the sender
    moving a storage into shared memory, the receiver mapping one). What a failed attempt already
    moved or mapped is not done twice (torch's storage cache)."""
    for _ in range(MANAGER_TRIES - 1):
        try:
            with _file_system_sharing():
                return call()
        except RuntimeError as e:
            if MANAGER_TIMEOUT not in str(e):
                raise
    with _file_system_sharing():
        return call()


def _dump(obj: object) -> str:
    def pickled() -> bytes:
        buffer = io.BytesIO()
        ForkingPickler(buffer, pickle.HIGHEST_PROTOCOL).dump(obj)
        return buffer.getvalue()

    return base64.b64encode(_asking_again(pickled)).decode("ascii")


def serialize(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> str:
    """A JSON-safe string from which another local process maps these tensors (see lifetime rule)."""
    return _dump([(str(name), tensor.detach()) for name, tensor in named_tensors])


def serialize_bucket(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor]:
    """Flatten the tensors into one buffer and serialise that; returns (payload, buffer).

    The caller keeps the returned buffer alive (it is what the receiver maps), not the inputs.
    """
    meta, flat = flatten(named_tensors)
    return _dump({_FLAT_KEY: flat, **meta.to_fields()}), flat


def deserialize(payload: str | bytes) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a payload from `serialize` or `serialize_bucket`, mapped, not copied.

    Only torch's tensor-rebuilding callables are accepted, so a payload cannot run other code.
    """
    data = base64.b64decode(payload, validate=True) if isinstance(payload, str) else payload
    obj = _asking_again(lambda: _TensorUnpickler(io.BytesIO(data)).load())
    if isinstance(obj, dict) and _FLAT_KEY in obj:
        meta = BucketMeta.from_fields(obj["names"], obj["dtypes"], obj["shapes"])
        return unflatten(obj[_FLAT_KEY], meta)
    if not isinstance(obj, list) or not all(isinstance(item, tuple) and len(item) == 2 for item in obj):
        raise ValueError(f"payload is not a list of (name, tensor) pairs: {type(obj).__name__}")
    return obj


_REBUILDERS = {
    "rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
    "rebuild_storage_filename", "rebuild_storage_empty",
}  # fmt: skip
_ALLOWED = {
    "torch.multiprocessing.reductions": _REBUILDERS,
    "torch.storage": {"UntypedStorage", "TypedStorage"},
    "torch.nn.parameter": {"Parameter"},
    "torch": {"Tensor", "Size", "device", "UntypedStorage"},
}


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles only what torch's reductions emit for tensors (plus dtypes)."""

    def find_class(self, module: str, name: str) -> object:
        dtype = getattr(torch, name, None) if module == "torch" else None
        if name in _ALLOWED.get(module, ()) or isinstance(dtype, torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"weight payload refers to {module}.{name}, which is not a tensor rebuilder"
        )


class TensorHandoff:
    """The sender's side of one payload: holds the tensors until the receiver says it is done.

    Use as `with TensorHandoff(named_tensors) as payload: post(payload)`, the post returning only
    after the receiver has copied the tensors; leaving the block releases them. `flat=True` sends
    one flat bucket (one IPC handle) instead of one handle per tensor.
    """

    def __init__(self, named_tensors: Sequence[tuple[str, torch.Tensor]], flat: bool = False):
        if flat:
            self.payload, flat_buffer = serialize_bucket(named_tensors)
            self._held: list[torch.Tensor] | None = [flat_buffer]
        else:
            self._held = [tensor for _, tensor in named_tensors]
            self.payload = serialize(named_tensors)

    def __enter__(self) -> str:
        return self.payload

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def release(self) -> None:
        """Drop the tensors; call only after the receiver has replied."""
        uses_cuda = any(tensor.is_cuda for tensor in self._held or ())
        self._held = None
        if uses_cuda:
            # Blocks a receiver has released sit in torch's IPC limbo until collected.
            torch.cuda.ipc_collect()
