"""Colocated weight sync on CPU: a spawned (not forked) process maps the tensors through shared
memory, bit-exact, and /dev/shm holds none of the files afterwards."""

from __future__ import annotations

import gc
import os
import pickle
import queue
import traceback
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from rlx.weight_sync.tensor import TensorHandoff, deserialize, serialize

WAIT_S = 20.0
SHM = Path("/dev/shm")


def _weights() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        ("embed.weight", torch.randn(64, 32, generator=gen)),
        ("norm.weight", torch.randn(32, generator=gen).to(torch.bfloat16)),
        ("counts", torch.randint(-(2**62), 2**62, (5,), generator=gen)),
        ("proj.weight", torch.nn.Parameter(torch.randn(8, 4, generator=gen))),
    ]


def _receive(payloads: list[str], results) -> None:
    try:
        for payload in payloads:
            received = deserialize(payload)
            exact = [
                name == want_name
                and got.dtype == want.dtype
                and torch.equal(got.view(torch.uint8), want.detach().view(torch.uint8))
                for (name, got), (want_name, want) in zip(received, _weights(), strict=True)
            ]
            # Mapped, not copied: the storage is a shared-memory file.
            results.put((all(exact), all(t.is_shared() for _, t in received)))
            del received  # the lifetime rule: drop the mapping before replying
    except BaseException:
        results.put(("error", traceback.format_exc()))
        raise


def _our_shm_files() -> set[str]:
    # torch names its file_system segments torch_<creator pid>_...
    return {p.name for p in SHM.glob(f"torch_{os.getpid()}_*")} if SHM.is_dir() else set()


def _receive_after_a_manager_timeout(payloads: list[str], results) -> None:
    """`_receive` where torch's shared-memory manager times out on the first storage mapped (what
    a host under full load once did): `deserialize` asks again, and the replies say whether the
    timeout really was raised."""
    from rlx.weight_sync.tensor import MANAGER_TIMEOUT

    real, raised = torch.UntypedStorage._new_shared_filename_cpu, []

    def once_timed_out(*args):
        if not raised:
            raised.append(True)
            raise RuntimeError(MANAGER_TIMEOUT)
        return real(*args)

    torch.UntypedStorage._new_shared_filename_cpu = once_timed_out
    replies: list = []
    _receive(payloads, type("Replies", (), {"put": staticmethod(replies.append)}))
    for reply in replies:
        results.put(reply if raised else ("error", "no timeout was raised"))


@pytest.mark.parametrize("receive", [_receive, _receive_after_a_manager_timeout])
def test_spawned_process_maps_tensors_bit_exact_and_shm_is_released(receive):
    before = _our_shm_files()
    handoffs = [TensorHandoff(_weights()), TensorHandoff(_weights(), flat=True)]
    assert _our_shm_files() - before, "the tensors should now live in shared memory"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=receive, args=([h.payload for h in handoffs], results))
    proc.start()
    try:
        replies = [results.get(timeout=WAIT_S) for _ in handoffs]
        proc.join(timeout=WAIT_S)
    except queue.Empty:
        pytest.fail("the receiving process did not answer")
    finally:
        if proc.is_alive():
            proc.kill()
    assert replies == [(True, True), (True, True)], replies
    assert proc.exitcode == 0
    for handoff in handoffs:
        handoff.release()
    gc.collect()
    assert _our_shm_files() == before


def test_a_sender_whose_shared_memory_manager_times_out_asks_again(monkeypatch):
    """Moving a CPU storage into shared memory asks torch's manager, which on a host under full
    load once timed out in the sender (CI, 2026-11-29): `serialize` asks again, and the payload
    still maps the tensors bit-exact, shared."""
    from rlx.weight_sync.tensor import MANAGER_TIMEOUT

    real, raised = torch.UntypedStorage._share_filename_cpu_, []

    def once_timed_out(self, *args, **kwargs):
        if not raised:
            raised.append(True)
            raise RuntimeError(MANAGER_TIMEOUT)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", once_timed_out)
    handoff = TensorHandoff(_weights())
    assert raised, "no timeout was raised"
    received = deserialize(handoff.payload)
    assert [name for name, _ in received] == [name for name, _ in _weights()]
    for (_, got), (_, want) in zip(received, _weights(), strict=True):
        assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.detach().view(torch.uint8))
        assert got.is_shared()
    del received
    handoff.release()
    # any other error is not retried
    monkeypatch.setattr(torch.UntypedStorage, "_share_filename_cpu_", lambda self, *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        serialize(_weights())


def test_payload_is_json_safe_and_refuses_foreign_callables():
    payload = serialize([("w", torch.ones(3))])
    assert payload.isascii()
    ((name, tensor),) = deserialize(payload)
    assert name == "w" and torch.equal(tensor, torch.ones(3))
    del tensor
    hostile = pickle.dumps(os.getpid)  # any callable outside torch's tensor rebuilders
    with pytest.raises(pickle.UnpicklingError, match="posix.getpid"):
        deserialize(hostile)
