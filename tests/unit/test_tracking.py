"""The default sinks (metrics.jsonl, TensorBoard), the console line and rollout dumps; and
`run.loggers`: every sink gets the run's config, name, tags and each step's metrics, read back
from what it wrote (metrics.jsonl; TensorBoard's event file; the W&B run file written offline; an
MLflow file store); a sink that cannot start or fails mid-run is dropped with one warning and the
others lose nothing; a bad list is refused when composing, naming the extra to install."""

from __future__ import annotations

import glob
import json
import logging
import struct

import pytest

from rlx.config.compose import compose
from rlx.errors import ConfigError
from rlx.sample import Sample, Status
from rlx.tracking import Tracker

CONFIG = {"algo": {"eps_clip": 0.2, "name": "grpo"}, "run": {"seed": 1}}
STEPS = [
    {
        "rollout/reward_mean": 0.25,
        "train/loss": -0.5,
        "eval/test/pass@1": 0.5,
        "rollout/staleness_hist": [3, 1],
    },
    {"rollout/reward_mean": 0.5, "train/loss": float("nan"), "eval/test/pass@1": 0.75},
]


@pytest.fixture
def offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps its file store for tests like this
    return tmp_path


def wandb_records(run_dir):
    """The records of the W&B run file written offline (LevelDB's log format: 32 KiB blocks of
    records with a 7-byte header (CRC, length, type: full, first, middle, last), after a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, part = open(path, "rb").read(), 7, b""
    while pos + 7 <= len(data):
        if (left := 32768 - pos % 32768) < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        part, pos = part + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # full, last
            record = pb.Record()
            record.ParseFromString(part)
            yield record
            part = b""


def test_every_sink_gets_the_config_name_tags_and_each_step(offline):
    run_dir = offline / "run"
    tracker = Tracker(run_dir, loggers=["jsonl", "tensorboard", "wandb", "mlflow"], config=CONFIG, name="r1",
                      project="rlx-test", tags=["toy", "grpo"])  # fmt: skip
    assert tracker.loggers == ["jsonl", "tensorboard", "wandb", "mlflow"]
    for step, metrics in enumerate(STEPS):
        tracker.log(step, metrics)
    tracker.close()

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1] and rows[0]["rollout/staleness_hist"] == [3, 1]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")] == [(0, 0.25), (1, 0.5)]
    assert [e.step for e in events.Scalars("train/loss")] == [0]  # NaN is the JSON record's only

    records = list(wandb_records(run_dir))
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "r1" and list(run.tags) == ["toy", "grpo"] and run.project == "rlx-test"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["algo"] == {"eps_clip": 0.2, "name": "grpo"}
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.WhichOneof("record_type") == "history"]  # fmt: skip
    assert [(h["_step"], h["rollout/reward_mean"], h["eval/test/pass@1"]) for h in history] == [(0, 0.25, 0.5), (1, 0.5, 0.75)]  # fmt: skip

    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    (found,) = client.search_runs([client.get_experiment_by_name("rlx-test").experiment_id])
    assert found.info.run_name == "r1" and {"toy", "grpo"} <= set(found.data.tags)
    assert found.data.params["algo.eps_clip"] == "0.2" and found.data.params["run.seed"] == "1"
    history = client.get_metric_history(found.info.run_id, "rollout/reward_mean")
    assert [(m.step, m.value) for m in history] == [(0, 0.25), (1, 0.5)]
    assert [m.value for m in client.get_metric_history(found.info.run_id, "eval/test/pass_1")] == [0.5, 0.75]


def test_a_tracker_that_cannot_start_or_fails_mid_run_is_dropped_with_one_warning(
    offline, monkeypatch, caplog
):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    run_dir = offline / "run"
    with caplog.at_level(logging.WARNING, logger="rlx.tracking"):
        tracker = Tracker(run_dir, loggers=["jsonl", "tensorboard", "mlflow"], config=CONFIG)
    assert tracker.loggers == ["jsonl", "tensorboard"]
    assert "run.loggers: mlflow could not start" in caplog.text

    def broken(step, metrics):
        raise OSError("disk quota exceeded")

    monkeypatch.setattr(tracker._sinks["tensorboard"], "log", broken)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlx.tracking"):
        for step, metrics in enumerate(STEPS * 2):
            tracker.log(step, metrics)
    tracker.close()
    assert caplog.text.count("run.loggers: tensorboard failed at step 0") == 1  # warned once, then off
    assert tracker.loggers == ["jsonl"]
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 4  # the local record kept every step


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["run.loggers=[jsonl,wandbb]"], ["run.loggers: 'wandbb' is not a logger", "jsonl, tensorboard, wandb, mlflow"]),
        (["run.loggers=[jsonl,jsonl]"], ["names a logger twice"]),
        (["run.tensorboard=false"], ["run.tensorboard has moved to run.loggers", "run.loggers=[jsonl]"]),
    ],
)  # fmt: skip
def test_a_bad_logger_list_is_refused_when_composing(overrides, fragments):
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    for fragment in fragments:
        assert fragment in str(e.value)


def test_a_logger_whose_package_is_missing_names_the_extra(monkeypatch):
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find(name, *a)
    )
    with pytest.raises(
        ConfigError, match=r"run.loggers: wandb needs the wandb package.*pip install 'rlx\[trackers\]'"
    ):
        compose(["run.loggers=[jsonl,wandb]"])


def test_the_default_sinks_the_console_line_and_rollout_dumps(tmp_path):
    tracker = Tracker(tmp_path)
    line = tracker.log(0, {"rollout/reward_mean": 0.25, "train/loss": -0.5, "time/rollout_s": 1.5})
    tracker.log(1, {"rollout/reward_mean": 0.5})
    s = Sample(
        prompt="1 2 =",
        prompt_ids=[3, 4, 12],
        label="2 1",
        response_ids=[4, 3, 1],
        rollout_logprobs=[-0.1, -0.2, -0.3],
        reward=1.0,
        status=Status.COMPLETED,
        version=3,
    )
    tracker.write_rollouts(7, [s])
    tracker.close()

    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 0, "rollout/reward_mean": 0.25, "train/loss": -0.5, "time/rollout_s": 1.5},
        {"step": 1, "rollout/reward_mean": 0.5},
    ]
    assert line == "step    0 | reward 0.250 | loss -0.5000 | rollout 1.50s"
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    (dump,) = (tmp_path / "rollouts").iterdir()
    assert dump.name == "step_000007.jsonl"
    row = json.loads(dump.read_text())
    assert row["prompt_ids"] == [3, 4, 12] and row["response_ids"] == [4, 3, 1]
    assert row["rollout_logprobs"] == [-0.1, -0.2, -0.3]
    assert (row["reward"], row["status"], row["version"], row["label"]) == (1.0, "completed", 3, "2 1")


def test_the_console_line_names_failures_and_each_eval_sets_pass_at_1(tmp_path):
    tracker = Tracker(tmp_path, loggers=["jsonl"])
    metrics = {"rollout/reward_mean": 0.5, "rollout/failed_frac": 0.25, "time/rollout_s": 2.0,
               "eval/gsm8k/pass@1": 0.375, "eval/gsm8k/pass@4": 0.75, "eval/aime/pass@1": 0.0}  # fmt: skip
    line = tracker.log(3, metrics)
    assert (
        line
        == "step    3 | reward 0.500 | failed 25.0% | rollout 2.00s | eval gsm8k pass@1 0.375 | eval aime pass@1 0.000"
    )
    # the final evaluation alone (after the last step) has a line of its own
    assert tracker.log(4, {"eval/gsm8k/pass@1": 0.5}) == "step    4 | eval gsm8k pass@1 0.500"
    assert (
        tracker.log(5, {"rollout/failed_frac": 0.0, "rollout/reward_mean": 1.0}) == "step    5 | reward 1.000"
    )
    tracker.close()
