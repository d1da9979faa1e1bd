"""Checkpoints: a resumed run serves exactly the saved policy and continues the data exactly."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlx.config.compose import compose
from rlx.errors import ConfigError
from rlx.runtime import run
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
