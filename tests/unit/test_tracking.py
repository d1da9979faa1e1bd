"""metrics.jsonl, TensorBoard events, the console line and rollout dumps."""

import json

from rlx.sample import Sample, Status
from rlx.tracking import Tracker


def test_tracker_writes_every_sink(tmp_path):
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
