"""Checkpoints: a resumed run serves exactly the saved policy and continues the data exactly; a
checkpoint rlx did not write is refused before anything in it is unpickled."""

from __future__ import annotations

import json
import pathlib
import pickle
import re

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlx.config.compose import compose, to_object
from rlx.config.record import run_info
from rlx.errors import ConfigError
from rlx.runtime import _find_resume, run
from rlx.tools import export as export_tool
from rlx.tools.export import export

SHORT = [
    "rollout.batch_size=8",
    "rollout.n_samples_per_prompt=4",
    "train.micro_batch_size=16",
    "run.progress=false",
]


def _dump(run_dir, step):
    return [
        json.loads(line)
        for line in (run_dir / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()
    ]


def test_resume_continues_policy_and_data(tmp_path):
    first, resumed, straight = tmp_path / "first", tmp_path / "resumed", tmp_path / "straight"
    # the first run trains with TP=2; the resumed one and the export load its checkpoint as one rank
    run(compose([f"run.output_dir={first}", "run.num_rollout=4", "run.save=true", "run.save_interval=2",
                 "run.save_hf=true", "cluster.num_trainer_procs=2", "cluster.tensor_parallel_size=2", *SHORT]))  # fmt: skip
    assert (first / "checkpoints" / "latest").read_text() == "step_000003"
    assert (first / "checkpoints" / "step_000001" / "state.json").exists()
    state = json.loads((first / "checkpoints" / "step_000003" / "state.json").read_text())
    assert (state["step"], state["version"]) == (3, 4)

    history = run(
        compose([f"run.output_dir={resumed}", "run.num_rollout=5", f"run.resume_from={first}", *SHORT])
    )
    assert [h["step"] for h in history] == [4]
    samples = _dump(resumed, 4)
    assert {s["version"] for s in samples} == {4}

    # The resumed engines serve the policy the first run ended with (exported as HF at its end):
    # transformers on that export reproduces the resumed rollout's log-probs.
    model = AutoModelForCausalLM.from_pretrained(first / "hf", dtype=torch.float32)
    for s in samples[:8]:
        ids = torch.tensor([s["prompt_ids"] + s["response_ids"]])
        logp_V = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        n = len(s["prompt_ids"])
        expected = [logp_V[n - 1 + t, tok].item() for t, tok in enumerate(s["response_ids"])]
        assert s["rollout_logprobs"] == pytest.approx(expected, abs=1e-4)

    # The export tool writes the same policy from the checkpoint (TP=2 written, read as one rank).
    exported = export(first, out=tmp_path / "exported")
    saved = load_file(first / "hf" / "model-00001.safetensors")
    assert load_file(exported / "model-00001.safetensors").keys() == saved.keys()
    for name, tensor in load_file(exported / "model-00001.safetensors").items():
        assert torch.equal(tensor, saved[name]), name
    assert (exported / "config.json").is_file() and (exported / "tokenizer.json").is_file()

    # The data continues exactly where an uninterrupted run would be.
    run(compose([f"run.output_dir={straight}", "run.num_rollout=5", *SHORT]))
    prompts = lambda rows: [r["prompt_ids"] for r in rows]  # noqa: E731
    assert prompts(samples) == prompts(_dump(straight, 4))
    assert prompts(_dump(first, 3)) == prompts(_dump(straight, 3))


def test_resume_from_a_directory_without_checkpoints_fails_before_starting(tmp_path):
    with pytest.raises(ConfigError, match="run.resume_from"):
        run(compose([f"run.output_dir={tmp_path / 'out'}", f"run.resume_from={tmp_path}", *SHORT]))


def test_groups_carried_over_at_a_checkpoint_continue_after_resume(tmp_path):
    # over-sampling 16 groups for a batch of 8 with partial rollout: at each step's end up to 8
    # unfinished groups wait in the buffer; the checkpoint holds them and the resumed run starts
    # its first batch with them, their tokens intact
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    carry = ["rollout.over_sampling_batch_size=16", "rollout.partial_rollout=true", "rollout.max_response_len=8",
             "rollout.max_concurrency=4", "data.toy_num_digits=4", *SHORT]  # fmt: skip
    run(compose([f"run.output_dir={first}", "run.num_rollout=2", "run.save=true", *carry]))
    state = json.loads((first / "checkpoints" / "step_000001" / "state.json").read_text())
    carried = state["rollout"]["carried"]
    assert carried and state["rollout"]["ready"] == []

    run(compose([f"run.output_dir={resumed}", "run.num_rollout=3", f"run.resume_from={first}", *carry]))
    # the resumed run's first round starts with every carried group, continuing what it had
    unfinished = sum(row["status"] == "aborted" for group in carried for row in group)
    step2 = json.loads((resumed / "metrics.jsonl").read_text().splitlines()[0])
    assert step2["step"] == 2 and step2["rollout/partial_resumed"] == unfinished
    batch = _dump(resumed, 2)
    found = 0
    for group in carried:  # those that finished among the batch's first 8 kept their tokens
        for row in group:
            match = [s for s in batch if s["prompt_ids"] == row["prompt_ids"] and s["index"] == row["index"]]
            if match:
                found += 1
                assert match[0]["response_ids"][: len(row["response_ids"])] == row["response_ids"]
                assert match[0]["rollout_logprobs"][: len(row["response_ids"])] == row["rollout_logprobs"]
    assert found > 0


class _RunsCode:
    """Unpickling it creates `path`: what a checkpoint's pickled metadata could do instead."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.path),)


def _looks_like_a_checkpoint(run_dir, unpickled) -> pathlib.Path:
    """RUN/checkpoints/step_000001 as rlx.checkpoint.save lays it out, its metadata a pickle that
    creates `unpickled` when loaded; no run record beside it."""
    ckpt = run_dir / "checkpoints" / "step_000001"
    (ckpt / "megatron").mkdir(parents=True)
    (ckpt / "megatron" / ".metadata").write_bytes(pickle.dumps(_RunsCode(unpickled)))
    (ckpt / "megatron" / "common.pt").write_bytes(pickle.dumps(_RunsCode(unpickled)))
    (ckpt / "state.json").write_text(json.dumps({"step": 1, "version": 2, "data": {}}))
    (run_dir / "checkpoints" / "latest").write_text(ckpt.name)
    return ckpt


NOT_RLX = (
    r"refused: .* has no (config.yaml and no )?run_info.json \(the run record rlx writes into every run "
    r"directory, beside checkpoints/\), so rlx did not write this checkpoint. A checkpoint is loaded "
    r"with pickle .* load only checkpoints your own rlx runs wrote"
)


def test_a_checkpoint_without_rlx_s_run_record_is_refused_before_anything_is_unpickled(tmp_path, capsys):
    foreign, unpickled = tmp_path / "downloaded", tmp_path / "unpickled"
    ckpt = _looks_like_a_checkpoint(foreign, unpickled)
    for resume_from in (foreign, foreign / "checkpoints", ckpt):
        cfg = compose([f"run.output_dir={tmp_path / 'out'}", f"run.resume_from={resume_from}", *SHORT])
        with pytest.raises(
            ConfigError,
            match=rf"run.resume_from={re.escape(str(resume_from))} \(the checkpoint {re.escape(str(ckpt))}\): {NOT_RLX}",
        ):
            run(cfg)
    # run.resume_from=auto in a directory holding such checkpoints: checked before this run's own
    # record is written there
    with pytest.raises(ConfigError, match=rf"run.resume_from=auto .*{NOT_RLX}"):
        run(compose([f"run.output_dir={foreign}", "run.resume_from=auto", *SHORT]))
    (foreign / "config.yaml").write_text("model: {}\n")  # half a record is none; nor is a stranger's JSON
    (foreign / "run_info.json").write_text(json.dumps({"trainer": "other"}))
    with pytest.raises(ConfigError, match=r"has no run_info.json as rlx writes it"):
        export(foreign)
    (foreign / "run_info.json").unlink()
    with pytest.raises(
        ConfigError, match=rf"python -m rlx.tools.export {re.escape(str(foreign))}: {NOT_RLX}"
    ):
        export(foreign)
    with pytest.raises(
        SystemExit, match=rf"^error: python -m rlx.tools.export {re.escape(str(foreign))}: {NOT_RLX}"
    ):
        export_tool.main([str(foreign), "--step", "1"])
    assert not unpickled.exists()


def test_an_rlx_run_s_checkpoint_is_found_by_its_run_dir_its_checkpoints_dir_itself_and_auto(tmp_path):
    run_dir, unpickled = tmp_path / "run", tmp_path / "unpickled"
    ckpt = _looks_like_a_checkpoint(run_dir, unpickled)
    (run_dir / "config.yaml").write_text("# The config this run used (written by rlx.config.record)\n")
    (run_dir / "run_info.json").write_text(json.dumps(run_info(run_dir, run_dir, None)))
    for resume_from in (run_dir, run_dir / "checkpoints", ckpt):
        assert _find_resume(to_object(compose([f"run.resume_from={resume_from}"])), tmp_path / "out") == ckpt
    assert _find_resume(to_object(compose(["run.resume_from=auto"])), run_dir) == ckpt
    assert _find_resume(to_object(compose(["run.resume_from=auto"])), tmp_path / "fresh") is None
    assert not unpickled.exists()  # finding reads `latest` and state.json only


def test_a_distributed_optimizer_checkpoint_resumes_on_fewer_ranks_and_only_with_that_optimizer(tmp_path):
    """`train.distributed_optimizer=true` saves (megatron's default format for it was refused by its
    own checkpointing: rlx.compat.megatron_distrib_optimizer), written by 2 data-parallel ranks and
    resumed by 1; resuming it with the other optimizer, whose state megatron lays out differently,
    is refused before the run starts, naming the setting."""
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    distributed = ["train.distributed_optimizer=true", *SHORT]
    run(compose([f"run.output_dir={first}", "run.num_rollout=2", "run.save=true", "cluster.num_trainer_procs=2",
                 *distributed]))  # fmt: skip
    history = run(
        compose([f"run.output_dir={resumed}", "run.num_rollout=3", f"run.resume_from={first}", *distributed])
    )
    assert [h["step"] for h in history] == [2]
    assert history[0]["train/grad_norm"] > 0
    with pytest.raises(ConfigError, match="train.distributed_optimizer: True in the checkpoint, False now"):
        run(
            compose(
                [
                    f"run.output_dir={tmp_path / 'other'}",
                    "run.num_rollout=3",
                    f"run.resume_from={first}",
                    *SHORT,
                ]
            )
        )
