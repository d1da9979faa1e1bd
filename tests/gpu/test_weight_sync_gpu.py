"""Weight sync between GPUs (NCCL): trainer on GPU 0, engine on GPU 1 (split placement). Skipped
without two GPUs.

- Each split sync path leaves the engine serving exactly the trainer's weights at every step of a
  3-step fp32 run (`train/logprob_abs_diff`, as the CPU tests check on gloo and shared memory).
- The NCCL broadcast group closes in either order and forms again, as it does when an engine is
  restarted (the engines leave first, then trainer rank 0 hosts a new group). A communicator
  destroyed gracefully waits for every rank on the node to destroy theirs, so the side that leaves
  first would hang; each close here must return within CLOSE_S.

Run on a CUDA machine with 2 GPUs (docs/gpu.md):  python -m pytest tests/gpu/test_weight_sync_gpu.py -q
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.multiprocessing as mp

from rlx.config.compose import compose
from rlx.runtime import run
from rlx.weight_sync.distributed import WeightReceiver, WeightSender

pytestmark = [
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
    pytest.mark.usefixtures("gpu_ray"),  # the runs share the directory's Ray (tests/gpu/conftest.py)
]

SPLIT = ["cluster.gpus_per_node=2", "cluster.num_trainer_procs=1", "cluster.num_rollout_gpus=1",
         "cluster.colocate=false", "+rollout.engine_args.dtype=float32", "run.num_rollout=3",
         "rollout.batch_size=8", "rollout.n_samples_per_prompt=4", "train.micro_batch_size=16",
         "run.progress=false"]  # fmt: skip
CLOSE_S = 30.0  # a close that has to wait for the other side would take until the test's timeout
WAIT_S = 120.0


@pytest.mark.parametrize("method", ["distributed", "disk"])
def test_split_sync_paths_serve_the_trainers_weights(tmp_path, method):
    history = run(compose([f"run.output_dir={tmp_path}", f"rollout.weight_sync={method}", *SPLIT]))
    assert len(history) == 3
    # fp32 on both GPUs (TF32 off): steps 1 and 2 are generated with weights the trainer changed
    assert all(h["train/logprob_abs_diff"] <= 1e-4 for h in history), [
        h["train/logprob_abs_diff"] for h in history
    ]


def _engine_side(commands, results) -> None:
    """The engine's receiver on GPU 1, driven by commands; answers on `results`."""
    torch.cuda.set_device(1)
    receiver = WeightReceiver()
    while (command := commands.get(timeout=WAIT_S))[0] != "stop":
        kind, arg = command
        if kind == "join":
            receiver.init("127.0.0.1", arg, 1, 2, backend="nccl", group_name="test", timeout_s=60.0)
            results.put("joined")
        elif kind == "bucket":
            results.put([(name, tensor.cpu().clone()) for name, tensor in receiver.receive(arg)])
        elif kind == "leave":
            started = time.perf_counter()
            receiver.close()
            results.put(time.perf_counter() - started)


def _timed_close(sender: WeightSender) -> float:
    """Seconds `sender.close()` took; fails (rather than hanging the suite) past CLOSE_S."""
    took: list[float] = []

    def close() -> None:
        started = time.perf_counter()
        sender.close()
        took.append(time.perf_counter() - started)

    thread = threading.Thread(target=close, daemon=True)
    thread.start()
    thread.join(CLOSE_S)
    assert took, f"WeightSender.close() did not return within {CLOSE_S:g} s"
    return took[0]


def test_nccl_group_closes_in_either_order_and_forms_again():
    torch.cuda.set_device(0)
    ctx = mp.get_context("spawn")
    commands, results = ctx.Queue(), ctx.Queue()
    engine = ctx.Process(target=_engine_side, args=(commands, results), daemon=True)
    engine.start()
    sender = WeightSender()

    def form_and_send(seed: int) -> None:
        port = sender.host("127.0.0.1")
        commands.put(("join", port))
        sender.init("127.0.0.1", port, 2, backend="nccl", group_name="test", timeout_s=60.0)
        assert results.get(timeout=WAIT_S) == "joined"
        gen = torch.Generator(device="cuda").manual_seed(seed)
        weights = [("a.weight", torch.randn(64, 32, generator=gen, device="cuda").bfloat16()),
                   ("b.weight", torch.randn(1000, generator=gen, device="cuda"))]  # fmt: skip
        sender.send(weights, 1 << 20, announce=lambda meta: commands.put(("bucket", meta)))
        received = results.get(timeout=WAIT_S)
        assert [name for name, _ in received] == [name for name, _ in weights]
        for (_, got), (_, sent) in zip(received, weights, strict=True):
            assert got.dtype == sent.dtype and torch.equal(got, sent.cpu())

    try:
        form_and_send(seed=1)
        assert _timed_close(sender) < CLOSE_S  # trainer first, the engine still in the group
        commands.put(("leave", None))
        assert results.get(timeout=WAIT_S) < CLOSE_S
        form_and_send(seed=2)  # a new group, as after an engine restart
        commands.put(("leave", None))  # the order `WeightPublisher._form_group` uses: engines first
        assert results.get(timeout=CLOSE_S + 5) < CLOSE_S
        assert _timed_close(sender) < CLOSE_S
    finally:
        commands.put(("stop", None))
        engine.join(timeout=60)
        if engine.is_alive():
            engine.kill()
