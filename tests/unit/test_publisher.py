"""WeightPublisher's disk path with `overlap` (async mode): the trainer waits for the export only,
the engines load in the background, and the order, errors and clean-up stay those of a blocking
publish. A recording trainer and pool stand in for the real ones (whose load is tested in the
async loop tests)."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest

from rlx.weight_sync.publisher import WeightPublisher


class Trainer:
    def __init__(self, log: list):
        self.log = log

    def export_weights(self, out_dir: str) -> str:
        Path(out_dir).mkdir(parents=True)
        self.log.append(("export", Path(out_dir).name))
        return out_dir


class Pool:
    """Loads finish only when the test says so (`finish`)."""

    health = None

    def __init__(self, log: list):
        self.log, self.loads = log, []

    def update_weights(self, path: str, version: int) -> None:
        self.log.append(("load", version))

    def update_weights_in_background(self, path: str, version: int) -> Future:
        self.log.append(("load started", version))
        self.loads.append(Future())
        return self.loads[-1]


def finish(load: Future, error: Exception | None = None) -> None:
    load.set_running_or_notify_cancel()
    load.set_exception(error) if error else load.set_result(None)


@pytest.fixture
def parts(tmp_path):
    log: list = []
    trainer, pool = Trainer(log), Pool(log)
    publish = WeightPublisher(
        trainer, pool, method="disk", backend="gloo", bucket_bytes=1 << 20, disk_root=tmp_path, overlap=True
    )
    publish.on_served = lambda version: log.append(("served", version))
    return publish, pool, log, tmp_path


def test_engines_load_while_the_trainer_goes_on(parts):
    publish, pool, log, root = parts
    publish(1)  # returns with the load still going on
    assert log == [("export", "v000001"), ("load started", 1)]
    assert publish.metrics() == {}  # nothing finished yet
    finish(pool.loads[0])  # the engines serve version 1: the producer is told at once
    assert log[-1] == ("served", 1)
    assert "time/weight_load_overlapped_s" in publish.metrics()

    publish(2)  # the previous directory goes once its successor is published
    assert log[-2:] == [("export", "v000002"), ("load started", 2)]
    assert sorted(p.name for p in root.iterdir()) == ["v000001", "v000002"]
    finish(pool.loads[1])
    publish.wait()  # what an evaluation and the end of the run call
    assert sorted(p.name for p in root.iterdir()) == ["v000002"]
    assert [entry for entry in log if entry[0] == "served"] == [("served", 1), ("served", 2)]


def test_a_version_is_loaded_only_after_the_one_before(parts):
    publish, pool, log, _ = parts
    publish(1)

    # the next publish waits for load 1 first: here it has failed, and the error stops the run
    finish(pool.loads[0], RuntimeError("engine http://e:1 failed to load weights"))
    with pytest.raises(RuntimeError, match="failed to load weights"):
        publish(2)
    assert ("served", 1) not in log and ("export", "v000002") not in log


def test_without_overlap_the_publish_returns_once_served(tmp_path):
    log: list = []
    publish = WeightPublisher(
        Trainer(log), Pool(log), method="disk", backend="gloo", bucket_bytes=1 << 20, disk_root=tmp_path
    )
    publish.on_served = lambda version: log.append(("served", version))
    publish(1)
    assert log == [("export", "v000001"), ("load", 1), ("served", 1)]
    assert publish.metrics() == {}


class PushPool:
    """One engine in rotation, behind the launcher `target` (a `rollout._target_`)."""

    health = None

    def __init__(self, target: str):
        from types import SimpleNamespace

        from rlx.rollout.config import RolloutConfig

        self.cfg = RolloutConfig(_target_=target)
        self.engines = SimpleNamespace(urls=["http://e:1"])

    def weight_targets(self) -> list[int]:
        return [0]

    def check_version(self, version: int) -> None:
        pass


class PushTrainer:
    def __init__(self):
        self.methods: list[str] = []

    def push_weights(self, method: str, urls: list[str], version: int, bucket_bytes: int) -> int:
        self.methods.append(method)
        return 1


@pytest.mark.parametrize(
    ("target", "pushed"),
    [
        ("rlx.rollout.launchers.LocalLauncher", "tensor_flat"),
        ("rlx.rollout.launchers.SGLangLauncher", "tensor"),
    ],
)
def test_tensor_buckets_go_flat_only_to_engines_that_read_them(tmp_path, target, pushed):
    """rlx's engine reads a colocated bucket as one flat buffer (one CUDA IPC handle a bucket),
    SGLang's one handle a tensor: the push takes the form of the pool's launcher
    (`flat_tensor_buckets`); the other paths are not touched."""
    trainer = PushTrainer()
    for method, sent in (("tensor", pushed), ("distributed", "distributed")):
        publish = WeightPublisher(
            trainer, PushPool(target), method=method, backend="gloo", bucket_bytes=1 << 20, disk_root=tmp_path
        )
        publish._members = {0: "http://e:1"}  # the broadcast group already formed
        publish(1)
        assert trainer.methods[-1] == sent
