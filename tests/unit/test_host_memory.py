"""The host memory plan of a CPU run (rlx.memory.host): its trainer rank's figure against the peaks
measured on this workplace's CPU, and the refusal a run that cannot fit gets before Ray starts."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from rlx.config.compose import compose, to_object
from rlx.errors import ConfigError

GIB = 1 << 30
# the default job's model widened to 25.2M parameters (fp32), responses of 64 on prompts of 4
WIDE = ["model.hidden_size=512", "model.ffn_hidden_size=1536", "model.num_layers=8", "model.num_attention_heads=8",
        "model.num_query_groups=4", "model.kv_channels=64", "rollout.max_response_len=64",
        "model.max_position_embeddings=128"]  # fmt: skip


SMOLLM2 = {  # its config.json's shape (tests/config/test_from_checkpoint.py has all of it)
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
    "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64,
    "max_position_embeddings": 8192, "vocab_size": 49152, "tie_word_embeddings": True, "hidden_act": "silu",
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "attention_bias": False, "mlp_bias": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
}  # fmt: skip


def setup_of(overrides, prompt_len):
    from rlx.config.memory_check import _setup

    return replace(_setup(to_object(compose(overrides))), prompt_len=prompt_len)


@pytest.fixture
def smollm2(tmp_path):
    """SmolLM2-135M-Instruct's config.json alone (the shape is all the plan reads)."""
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    prompts = tmp_path / "x.jsonl"
    prompts.write_text('{"prompt": "What is 7 * 8?", "label": "56"}\n')
    return ["+experiment=smollm2_arithmetic", "cluster=local", f"model.hf_checkpoint={tmp_path}",
            "rollout.batch_size=4", "rollout.n_samples_per_prompt=4", "train.global_batch_size=16",
            f"data.prompt_path={prompts}", f"data.eval.test_greedy.path={prompts}", f"data.eval.test.path={prompts}"]  # fmt: skip


@pytest.mark.parametrize(
    ("which", "micro_batch", "prompt_len", "measured_gib"),
    [("wide", 32, 4, 2.66), ("wide", 256, 4, 8.96), ("smollm2", 4, 40, 4.30), ("smollm2", 16, 40, 7.79)],
)
def test_a_trainer_rank_is_planned_within_a_fifth_of_its_measured_peak(
    which, micro_batch, prompt_len, measured_gib, smollm2
):
    """`perf/trainer_peak_rss_gib` of 2-step runs on this workplace's CPU (2026-11-29): the wide
    model with `python launch.py run.num_rollout=2 <WIDE> train.micro_batch_size=N`, SmolLM2 with
    the experiment on `cluster=local` at 4 prompts × 4 samples (its longest prompt: 40 tokens).
    What the plan was calibrated on: a change to its terms that moves these shows here."""
    from rlx.memory.host import trainer_rank_bytes

    base = WIDE if which == "wide" else smollm2
    planned = trainer_rank_bytes(setup_of([*base, f"train.micro_batch_size={micro_batch}"], prompt_len)) / GIB
    assert abs(planned - measured_gib) <= 0.2 * measured_gib, (planned, measured_gib)


def test_a_cpu_run_that_cannot_fit_is_refused_naming_the_micro_batch_that_does():
    """The wide model at micro-batch 256 on a machine stated as 8 GiB (Ray kills past 95%: 7.6):
    refused, naming the largest halving that fits; on 64 GiB, nothing to say; a GPU run, never."""
    from rlx.config.memory_check import host_memory_errors
    from rlx.memory.host import host_plan

    small = to_object(compose([*WIDE, "train.micro_batch_size=256", "cluster.host_memory_gib=8"]))
    (error,) = host_memory_errors(small)
    assert error.startswith("host memory plan: this CPU run needs about"), error
    assert "more than 95% of the host's 8.0 GiB (cluster.host_memory_gib=8)" in error
    fits = [
        m
        for m in (128, 64, 32, 16)
        if host_plan(setup_of([*WIDE, f"train.micro_batch_size={m}"], 0)).total <= 0.95 * 8 * GIB
    ]
    assert fits and f"set train.micro_batch_size={fits[0]} (the largest halving that fits)" in error
    assert host_plan(setup_of([*WIDE, "train.micro_batch_size=256"], 0)).total > 0.95 * 8 * GIB
    assert (
        host_memory_errors(
            to_object(compose([*WIDE, "train.micro_batch_size=256", "cluster.host_memory_gib=64"]))
        )
        == []
    )
    gpu = to_object(compose(["cluster=1gpu", "cluster.host_memory_gib=0.5"]))
    assert host_memory_errors(gpu) == []


def test_a_run_refused_by_the_host_plan_stops_before_ray(tmp_path):
    """`rlx.runtime._prepare` (before Ray or any process starts): the default job on a machine
    stated as 1 GiB cannot fit its three processes whatever the micro-batch."""
    from rlx.runtime import _prepare

    cfg = compose([f"run.output_dir={tmp_path}", "cluster.host_memory_gib=1"])
    with pytest.raises(ConfigError, match="use a smaller model or a GPU cluster"):
        _prepare(cfg)
