"""Weight sync over a private gloo group (CPU): a sender and two receivers in spawned processes.

Every process wait and queue read has a timeout, so a broken group fails the test instead of
hanging it.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from rlx.ports import free_port
from rlx.weight_sync.buckets import flatten
from rlx.weight_sync.distributed import WeightReceiver, WeightSender, WeightSyncError

ADDRESS = "127.0.0.1"
BUCKET_BYTES = 4096
NUM_ROUNDS = 2  # the second round re-initialises the group on the same port after close()
WAIT_S = 20.0


def _weights(round_index: int) -> list[tuple[str, torch.Tensor]]:
    """Seeded mixed-dtype tensors, regenerated bit-identically in every process."""
    gen = torch.Generator().manual_seed(1000 + round_index)
    return [
        ("embed.weight", torch.randn(40, 16, generator=gen)),  # 2560 bytes
        ("layers.0.norm.weight", torch.randn(16, generator=gen).to(torch.bfloat16)),
        ("layers.0.proj.weight", torch.randn(64, 32, generator=gen).to(torch.bfloat16)),  # over the bound
        ("layers.0.counts", torch.randint(0, 2**40, (33,), generator=gen)),
        ("lm_head.weight", torch.randn(20, 16, generator=gen)),
    ]


def _sender(port: int, world_size: int, meta_queues: list, results) -> None:
    try:
        sender = WeightSender()
        for round_index in range(NUM_ROUNDS):
            sender.init(ADDRESS, port, world_size, backend="gloo", timeout_s=WAIT_S)
            announce = lambda meta: [q.put(meta) for q in meta_queues] and None  # noqa: E731
            metas = sender.send(iter(_weights(round_index)), BUCKET_BYTES, announce=announce)
            sender.close()
            for q in meta_queues:  # end of round, only once the group is gone
                q.put(None)
            results.put(("sender", round_index, [meta.names for meta in metas]))
    except BaseException:
        results.put(("error", "sender", traceback.format_exc()))
        raise


def _receiver(rank: int, port: int, world_size: int, meta_queue, results) -> None:
    try:
        receiver = WeightReceiver()
        for round_index in range(NUM_ROUNDS):
            receiver.init(ADDRESS, port, rank, world_size, backend="gloo", timeout_s=WAIT_S)
            received = []
            while (meta := meta_queue.get(timeout=WAIT_S)) is not None:
                received += [(name, view.clone()) for name, view in receiver.receive(meta)]
            receiver.close()
            exact = [
                name == want_name and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
                for (name, got), (want_name, want) in zip(received, _weights(round_index), strict=True)
            ]
            results.put(("receiver", rank, round_index, all(exact)))
    except BaseException:
        results.put(("error", f"receiver {rank}", traceback.format_exc()))
        raise


def _run_all(procs: list, results, num_results: int) -> list:
    for proc in procs:
        proc.start()
    got, deadline = [], time.monotonic() + 3 * WAIT_S
    try:
        while len(got) < num_results:
            item = results.get(timeout=max(0.1, deadline - time.monotonic()))
            assert item[0] != "error", f"{item[1]} failed:\n{item[2]}"
            got.append(item)
        for proc in procs:
            proc.join(timeout=WAIT_S)
            assert proc.exitcode == 0, f"{proc.name} exited with {proc.exitcode}"
    except queue.Empty:
        pytest.fail(f"weight sync timed out; results so far: {got}")
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    return got


def test_broadcast_to_two_receivers_bit_exact_and_reinitialisable():
    ctx = mp.get_context("spawn")
    port, world_size = free_port(), 3
    results = ctx.Queue()
    meta_queues = [ctx.Queue() for _ in range(world_size - 1)]
    procs = [ctx.Process(target=_sender, args=(port, world_size, meta_queues, results), name="sender")]
    procs += [
        ctx.Process(
            target=_receiver,
            args=(rank, port, world_size, meta_queues[rank - 1], results),
            name=f"rank{rank}",
        )
        for rank in range(1, world_size)
    ]
    got = _run_all(procs, results, NUM_ROUNDS * world_size)
    buckets = [item[2] for item in got if item[0] == "sender"]
    # 4096-byte bound: embed (2560) + norm (32) | proj alone (4096) | counts (264) + lm_head (1280).
    expected = [
        ["embed.weight", "layers.0.norm.weight"],
        ["layers.0.proj.weight"],
        ["layers.0.counts", "lm_head.weight"],
    ]
    assert buckets == [expected] * NUM_ROUNDS
    assert sorted(item[1:] for item in got if item[0] == "receiver") == [
        (rank, round_index, True) for rank in (1, 2) for round_index in range(NUM_ROUNDS)
    ]


def test_init_times_out_naming_the_address_when_a_peer_never_joins():
    port = free_port()
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match=f"127.0.0.1:{port}.*did not form within 1 s"):
        WeightSender().init(ADDRESS, port, world_size=2, timeout_s=1)
    with pytest.raises(WeightSyncError, match=f"127.0.0.1:{port}.*rank 1 of 2"):
        WeightReceiver().init(ADDRESS, port, rank=1, world_size=2, timeout_s=1)
    assert time.monotonic() - started < 15


def test_a_hosted_store_holds_its_port_and_the_group_forms_on_it():
    sender = WeightSender()
    port = sender.host(ADDRESS)  # picked by the OS and held from now on: nobody else can bind it
    with pytest.raises(OSError):
        socket.create_server((ADDRESS, port))
    other = WeightSender()
    other_port = other.host(ADDRESS)
    with pytest.raises(ValueError, match=f"serving the store on port {other_port}"):
        other.init(ADDRESS, other_port + 1, world_size=2)
    with pytest.raises(WeightSyncError, match=f"127.0.0.1:{port}.*did not form within 1 s"):
        sender.init(ADDRESS, port, world_size=2, timeout_s=1)  # on the hosted store: no peer comes


def test_send_before_init_fails_clearly():
    with pytest.raises(WeightSyncError, match="init"):
        WeightSender().send([("w", torch.zeros(1))], BUCKET_BYTES)


def test_a_failed_push_leaves_the_group_so_a_waiting_engine_fails_at_once():
    """A push that fails before a live engine's bucket reached it (in a run: the broadcast failed
    on an engine that died) must not leave that engine waiting out the group's timeout, nor the
    driver's `leave_weight_group` after it: rank 0 leaves the group, and the receive fails now."""
    from rlx.trainer.weight_push import WeightPusher

    group_timeout_s = 120.0  # what the engine would wait for its bucket if rank 0 stayed
    pusher, receiver = WeightPusher(), WeightReceiver()
    port = pusher.host_group(ADDRESS)
    joining = threading.Thread(
        target=receiver.init, args=(ADDRESS, port, 1, 2, "gloo"), kwargs={"timeout_s": group_timeout_s}
    )
    joining.start()
    pusher.init_group(ADDRESS, port, 2, "gloo")
    joining.join(WAIT_S)
    meta, _ = flatten([("w", torch.ones(16))])
    outcome = {}

    def receive() -> None:
        try:
            receiver.receive(meta)
        except WeightSyncError as e:
            outcome["error"] = str(e)

    waiting = threading.Thread(target=receive, daemon=True)
    waiting.start()

    def export():
        raise RuntimeError("the export failed")
        yield

    try:
        with pytest.raises(RuntimeError, match="the export failed"):
            pusher.distributed(export(), [], version=1, bucket_bytes=BUCKET_BYTES)
        waiting.join(WAIT_S)
        assert not waiting.is_alive(), "the engine still waits for a bucket rank 0 will never send"
        assert "rank 1 of 2" in outcome["error"]
    finally:
        if not waiting.is_alive():
            receiver.close()
        pusher.close()
