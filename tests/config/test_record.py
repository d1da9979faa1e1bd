"""The run directory records what was used: config.yaml reruns as it stands (with the checkpoint
directory actually loaded), run_info.json holds versions and rlx's git state. CPU, no processes."""

from __future__ import annotations

import json
import subprocess
from importlib import metadata

import yaml

from rlx.config import build
from rlx.config.compose import compose, to_object
from rlx.config.record import RLX_ROOT, git_state, run_dir_summary, write_run_config


def _checkpoint(tmp_path, model="tiny_llama3"):
    """The config.json a run of the tiny `model` records as its checkpoint (no weights needed here)."""
    hf_dir = tmp_path / "model"
    build(to_object(compose([f"model={model}"])).model).hf_config().save_pretrained(hf_dir)
    return hf_dir


def test_config_yaml_records_the_checkpoint_used_and_reruns_to_the_same_config(tmp_path):
    cfg = compose(
        ["model=tiny_llama3", "rollout.n_samples_per_prompt=4", "+rollout.engine_args.max_running_requests=8"]
    )
    cfg.run.output_dir = str(tmp_path)  # as launch.py sets it
    hf_dir = _checkpoint(tmp_path)
    write_run_config(cfg, tmp_path, hf_dir)

    recorded = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert cfg.model.hf_checkpoint is None  # the tiny model: resolved only when the run starts
    assert recorded["model"]["hf_checkpoint"] == str(hf_dir)
    assert recorded["run"]["output_dir"] is None  # a rerun gets a run directory of its own
    assert recorded["train"]["global_batch_size"] == 32 * 4  # interpolation resolved

    rerun = to_object(compose([], config_dir=tmp_path))  # typed on the schema: unknown keys would fail
    original = to_object(cfg)
    assert rerun.model.hf_checkpoint == str(hf_dir)
    assert rerun.rollout.engine_args == {"max_running_requests": 8}
    original.model.hf_checkpoint, original.run.output_dir = str(hf_dir), None
    assert rerun == original


def test_relative_prompt_and_eval_paths_are_recorded_absolute(tmp_path, monkeypatch):
    """A run launched where its data lies (data.prompt_path=train.jsonl) reruns from anywhere."""
    monkeypatch.chdir(tmp_path)
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / name).write_text('{"prompt": "1 =", "label": "1"}\n')
    cfg = compose(["data=jsonl", "data.prompt_path=train.jsonl", "+data.eval={test: {path: test.jsonl}}",
                   "run.eval_interval=5", "reward.fn=rlx.reward.toy.exact_match"], validated=False)  # fmt: skip
    write_run_config(cfg, tmp_path, _checkpoint(tmp_path))
    recorded = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert recorded["data"]["prompt_path"] == str(tmp_path / "train.jsonl")
    assert recorded["data"]["eval"]["test"]["path"] == str(tmp_path / "test.jsonl")
    assert cfg.data.prompt_path == "train.jsonl"  # the run's own config is left as given


def test_run_info_holds_versions_and_the_git_commit(tmp_path):
    write_run_config(compose(), tmp_path, _checkpoint(tmp_path))
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["hf_checkpoint"] == str(tmp_path / "model")
    assert info["hf_checkpoint_given"] is None
    for name in ("torch", "megatron-core", "transformers", "ray", "sglang-router"):
        assert info["packages"][name] == metadata.version(name)
    assert "sglang" not in info["packages"] or info["packages"]["sglang"] == metadata.version("sglang")
    head = subprocess.run(["git", "-C", str(RLX_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert info["rlx"]["git_commit"] == (head.stdout.strip() if head.returncode == 0 else None)


def test_git_state_sees_commits_and_uncommitted_changes(tmp_path):
    assert git_state(tmp_path) == {"git_commit": None, "git_dirty": None}  # not a checkout
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    (tmp_path / "untracked.txt").write_text("not counted")
    assert git_state(tmp_path) == {"git_commit": head, "git_dirty": False}
    (tmp_path / "a.py").write_text("x = 2\n")
    assert git_state(tmp_path) == {"git_commit": head, "git_dirty": True}


def test_a_finished_run_names_its_directory_and_what_it_holds(tmp_path):
    out = tmp_path / "run"
    for d in ("tensorboard", "rollouts", ".hydra"):
        (out / d).mkdir(parents=True)
    for f in ("metrics.jsonl", "config.yaml"):
        (out / f).write_text("")
    assert run_dir_summary(out) == (
        f"run directory {out}: config.yaml, metrics.jsonl, rollouts/, tensorboard/; "
        f"tensorboard --logdir {out}/tensorboard"
    )
    (empty := tmp_path / "empty").mkdir()
    assert run_dir_summary(empty) == f"run directory {empty}: empty"
