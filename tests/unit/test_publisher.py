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
