"""The loop's other modes on the tiny model (CPU): evaluation during a run, the debug halves
(rollout only; train only from dumps), stopping on SIGTERM with a checkpoint and continuing it
with run.resume_from=auto."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlx.config.compose import compose
from rlx.errors import ConfigError
from rlx.reward.toy import position_match
from rlx.runtime import _check_resumable, run
from rlx.sample import Sample

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "train.micro_batch_size=16",
         "run.progress=false", "run.loggers=[jsonl]"]  # fmt: skip
EVAL_ROWS = [("4 1 7 =", "4 1 7"), ("0 9 9 =", "0 9 9"), ("5 3 2 =", "5 3 2")]


def _rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_eval_sets_are_scored_before_during_and_after_training(tmp_path, monkeypatch):
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"prompt": p, "label": label}) + "\n" for p, label in EVAL_ROWS))
    out = tmp_path / "run"
    # the trackers users have, offline: MLflow in a file store (W&B's run file: tests/unit/test_tracking.py)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file://{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    history = run(compose([f"run.output_dir={out}", "run.num_rollout=2", "run.eval_interval=1",
                           f"+data.eval={{held: {{path: {held}}}}}", "rollout.n_samples_per_eval_prompt=2",
                           "rollout.eval_temperature=0", *SMALL, "run.loggers=[jsonl,mlflow]", "run.name=evals",
                           "run.tags=[toy]"]))  # fmt: skip
    evals = {h["step"]: h for h in history if "eval/held/reward_mean" in h}
    assert sorted(evals) == [0, 1, 2]  # before step 0, before step 1, after the last
    assert {"eval/held/pass@1", "eval/held/pass@2"} <= set(evals[2])

    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    (found,) = client.search_runs([client.get_experiment_by_name("rlx").experiment_id])
    assert found.info.run_name == "evals" and "toy" in found.data.tags
    assert found.data.params["run.eval_interval"] == "1"  # the run's config
    logged = client.get_metric_history(found.info.run_id, "eval/held/reward_mean")
    assert [(m.step, m.value) for m in logged] == [(s, evals[s]["eval/held/reward_mean"]) for s in (0, 1, 2)]

    # before training the engines serve the initial checkpoint: greedy decoding with transformers,
    # scored by the same reward, gives the same mean (both greedy samples of a prompt are equal)
    hf_dir = OmegaConf.load(out / "config.yaml").model.hf_checkpoint  # the directory the run loaded
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    rewards = []
    for prompt, label in EVAL_ROWS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        new = model.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1] :].tolist()
        text = tokenizer.decode(new, skip_special_tokens=True)
        rewards.append(position_match(Sample(prompt=prompt, prompt_ids=[], label=label, response_text=text)))
    assert evals[0]["eval/held/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))


def test_train_only_from_dumps_reproduces_the_losses_of_the_run_that_made_them(tmp_path):
    """The run that makes the dumps has its step 1 profiled: the profile is left in its
    directory, and profiling changes no number (the unprofiled replay gives the same losses)."""
    first = tmp_path / "first"
    made = run(
        compose([f"run.output_dir={first}", "run.num_rollout=2", "debug.profile_train_steps=[1]", *SMALL])
    )
    replayed = run(compose([f"run.output_dir={tmp_path / 'replay'}", "run.num_rollout=2", "debug.train_only=true",
                            f"debug.load_rollouts={first}", *SMALL]))  # fmt: skip
    for a, b in zip(made, replayed, strict=True):
        assert (a["train/loss"], a["train/grad_norm"]) == (b["train/loss"], b["train/grad_norm"])

    profile = first / "profile"
    (trace,) = profile.glob("step_000001_rank_0.*.pt.trace.json")
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert {"aten::mm", "aten::addmm"} & names  # the model's matmuls are in the timeline
    table = (profile / "step_000001_rank_0_ops.txt").read_text().splitlines()
    assert table[0].startswith("CPU self time:") and len(table) == 41  # no GPU here: CPU ops
    assert not list(profile.glob("step_000000_*"))  # step 0 ran unprofiled
    assert not (tmp_path / "replay" / "profile").exists()

    rollouts = tmp_path / "rollouts_only"
    history = run(
        compose([f"run.output_dir={rollouts}", "run.num_rollout=2", "debug.rollout_only=true", *SMALL])
    )
    assert all("train/loss" not in h and h["version"] == 0 for h in history)
    assert [len(_rows(rollouts / "rollouts" / f"step_{k:06d}.jsonl")) for k in (0, 1)] == [16, 16]


@pytest.mark.slow
def test_sigterm_checkpoints_the_step_and_resume_auto_continues_it(tmp_path):
    out = tmp_path / "run"
    options = [
        "run.save=true",
        "run.keep_checkpoints=1",
        "run.resume_from=auto",
        "run.progress=false",
        *SMALL[:3],
    ]
    args = [sys.executable, "launch.py", f"run.output_dir={out}", "run.num_rollout=50", *options]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step    1 |" in line:
            break
    proc.send_signal(signal.SIGTERM)
    tail, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, "".join(lines)[-2000:] + tail[-2000:]
    assert "stopped by SIGTERM" in tail and "run.resume_from=" in tail
    done = len(_rows(out / "metrics.jsonl"))
    checkpoints = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert checkpoints == [f"step_{done - 1:06d}"]  # the stopped step's, the only one kept

    # the same command but for its length, run here (this process's Ray and kept ranks and engines:
    # no second start-up of Ray, Megatron and the engine); launch.py's own path is the first run's
    run(compose([f"run.output_dir={out}", f"run.num_rollout={done + 1}", *options]))
    steps = [row["step"] for row in _rows(out / "metrics.jsonl")]
    assert steps == list(range(done + 1))  # nothing trained twice or skipped
    assert os.path.isdir(out / "checkpoints" / f"step_{done:06d}")


def test_resuming_with_another_model_shape_is_refused_naming_the_keys(tmp_path):
    rc = compose(["model.num_layers=3"])
    from rlx.config.compose import to_object

    state = {"shape": {"model.num_layers": 2, "model.hidden_size": 32, "critic": False}}
    with pytest.raises(ConfigError, match=r"model.num_layers: 2 in the checkpoint, 3 now"):
        _check_resumable(to_object(rc), state, tmp_path)


class _Trainer:
    """Writes a file per save; `fail` makes the next save crash half way."""

    fail = False

    def save(self, path):
        Path(path).mkdir(parents=True)
        (Path(path) / "model.pt").write_text("weights")
        if self.fail:
            raise OSError("disk full")


def test_a_crash_while_saving_leaves_the_previous_checkpoint_in_force(tmp_path):
    from rlx import checkpoint

    trainer = _Trainer()
    for step in range(3):
        checkpoint.save(trainer, tmp_path, step, {"step": step}, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]
    trainer.fail = True
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(trainer, tmp_path, 3, {"step": 3}, keep=2)
    latest = checkpoint.find_latest(str(tmp_path))
    assert latest.name == "step_000002" and checkpoint.load_state(latest) == {"step": 2}
    assert checkpoint.find_latest("auto", tmp_path) == latest
    assert checkpoint.find_latest("auto", tmp_path / "fresh") is None  # nothing there: start fresh


@pytest.mark.slow
def test_a_killed_trainer_ends_the_job_and_resume_auto_finishes_it(tmp_path):
    import psutil

    out = tmp_path / "run"
    options = [
        "run.save=true",
        "run.save_interval=1",
        "run.resume_from=auto",
        "run.progress=false",
        *SMALL[:3],
    ]
    args = [sys.executable, "launch.py", f"run.output_dir={out}", "run.num_rollout=30", *options]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        if "step    1 |" in line:
            break
    family = psutil.Process(proc.pid).children(recursive=True)
    trainers = [
        p for p in family if " ".join(p.cmdline()).startswith("ray::") and "Trainer" in " ".join(p.cmdline())
    ]
    assert trainers, [" ".join(p.cmdline())[:40] for p in family]
    trainers[0].kill()  # kill -9 of the trainer rank
    tail, _ = proc.communicate(timeout=120)
    assert proc.returncode not in (0, None)
    # one message naming what failed, the traceback in the job's log only
    assert "error: TrainerRankError: trainer rank 0" in tail and "died during" in tail, tail[-3000:]
    assert "Traceback" not in tail and "HYDRA_FULL_ERROR" not in tail, tail[-3000:]
    done = len(_rows(out / "metrics.jsonl"))  # each of them checkpointed (save_interval=1)
    assert 2 <= done < 30
    # resumed with the same options but for its length, here (as above): two steps past the killed one
    run(compose([f"run.output_dir={out}", f"run.num_rollout={done + 2}", *options]))
    steps = [row["step"] for row in _rows(out / "metrics.jsonl")]
    assert steps == list(range(done + 2))  # nothing trained twice or skipped
