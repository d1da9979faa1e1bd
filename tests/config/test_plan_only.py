"""The memory plan where the config is composed: a GPU run that cannot fit is refused naming the
knob, and `python launch.py ... run.plan_only=true` prints the plan and starts nothing (the real
command line, with a `ray` package that fails on import first on the path, so any Ray start or
import on the way fails the test; a plan that does not fit is printed, then refused, status 1; a
CPU config has no plan). About 8 s a command line (composing checks Megatron's config)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ["cluster=1gpu", "train.precision=bf16", "cluster.gpu_memory_gib=79.6"]


@pytest.fixture(scope="module")
def no_ray(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("no_ray")
    (root / "ray").mkdir()
    (root / "ray" / "__init__.py").write_text("raise ImportError('run.plan_only imported ray')\n")
    return root


def plan_only(no_ray: Path, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """The command's result, its stdout from the plan's first line on (megatron logs a few lines
    when the config's Megatron check imports it)."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(no_ray), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "launch.py", "run.plan_only=true", f"hydra.run.dir={tmp_path}", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    start = done.stdout.find("memory plan:")
    done.stdout = done.stdout[start:] if start >= 0 else done.stdout
    return done


def test_plan_only_prints_the_plan_and_starts_nothing(no_ray, tmp_path):
    done = plan_only(no_ray, tmp_path, *GPU)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("memory plan: tiny_qwen3 (75,136 parameters), bf16, TP=1")
    assert lines[1] == "GPU memory: 79.6 GiB (cluster.gpu_memory_gib=79.6)"
    assert lines[2].startswith("colocated GPU (trainer rank + engine) x 1")
    for term in ("policy weights", "gradients", "optimizer state", "activations", "KV cache", "CUDA graphs"):
        assert f"    {term}" in done.stdout, term
    assert "to spare" in done.stdout and "Traceback" not in done.stderr
    # 32 x 8 samples a step, 64 a micro-batch: a 75k-parameter model fits the whole step in one
    assert "\ntrain.micro_batch_size=64: the plan fits 256 as well (trainer peak " in done.stdout
    assert not list(tmp_path.glob("*.jsonl")) and not (tmp_path / "config.yaml").exists()  # no run started


def test_plan_only_prints_a_plan_that_does_not_fit_then_refuses_it(no_ray, tmp_path):
    wide = ["model.tiny=true", "model=glm4_9b", "rollout.max_response_len=1024"]  # 9.4B on one GPU
    done = plan_only(no_ray, tmp_path, *GPU, *wide)
    assert done.returncode == 1
    assert done.stdout.startswith("memory plan: glm4_9b (9.40B parameters)")
    assert "OVER the GPU's 79.6 GiB" in done.stdout
    assert "error: this run would be refused:" in done.stderr
    assert "memory plan: the colocated GPU (trainer rank + engine) needs" in done.stderr
    assert "cluster.tensor_parallel_size" in done.stderr and "Traceback" not in done.stderr


def test_a_cpu_run_has_no_gpu_plan_and_its_host_plan_refuses_what_cannot_fit(no_ray, tmp_path):
    """The default job (CPU): no GPU plan; the host plan's line, its three processes of 0.9 GiB
    each (the tiny model's terms: kilobytes), on a machine stated as 24 GiB; on one of 2 GiB the
    refusal its run would get (status 1), which no micro-batch avoids."""
    done = plan_only(no_ray, tmp_path / "fits", "cluster.gpu_memory_gib=0.001", "cluster.host_memory_gib=24")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [
        "memory plan: none for a CPU run (cluster.gpus_per_node=0); choose a GPU cluster, e.g. cluster=1gpu",
        "host memory plan: about 2.7 GiB of the host's 24.0 GiB (cluster.host_memory_gib=24): a trainer rank "
        "0.9 × 1, an engine 0.9 × 1, the driver 0.9 (approximate: rlx/memory/host.py; prompts not counted: "
        "data.max_prompt_len is unset, and the run counts its data's longest)",
    ]
    done = plan_only(no_ray, tmp_path / "over", "cluster.host_memory_gib=2")
    assert done.returncode == 1 and "this run would be refused:" in done.stderr, done.stderr
    assert "more than 95% of the host's 2.0 GiB (cluster.host_memory_gib=2)" in done.stderr
    assert "use a smaller model or a GPU cluster (e.g. cluster=1gpu)" in done.stderr


def test_a_gpu_run_logs_its_plan_first_and_a_cpu_run_none(tmp_path, caplog):
    """`rlx.runtime.run` prepares a run (config, checkpoint, data) before Ray starts; on a GPU
    cluster its first log lines are the plan, then what `cluster.offload_trainer=auto` and
    `cluster.release_memory=auto` decided by it; on CPU there is none. Composed here, not run."""
    import logging

    from rlx.config.compose import compose
    from rlx.runtime import _prepare

    gpu, cpu = (
        compose([*overrides, f"run.output_dir={tmp_path / name}"])
        for name, overrides in (("gpu", GPU), ("cpu", []))
    )
    with caplog.at_level(logging.INFO):
        caplog.clear()  # what composing logged (megatron's import)
        _prepare(gpu)
    assert caplog.records[0].getMessage().startswith("memory plan: tiny_qwen3 (75,136 parameters), bf16")
    assert "GPU memory: 79.6 GiB (cluster.gpu_memory_gib=79.6)" in caplog.records[0].getMessage()
    # the run's plan counts the longest prompt its data holds (4 tokens) with the response's 4:
    # composing, with data.max_prompt_len unset, counts the response alone
    assert "activations (64 × 8 tokens, 2 layers)" in caplog.records[0].getMessage()
    assert "data.max_prompt_len is unset" not in caplog.records[0].getMessage()
    # then what cluster.offload_trainer=auto (the default) decided from it, the KV cache's cap
    # beside the trainer, and its size by the requests: the toy task's prompts of at most 4 tokens
    # and 4 of response, 256 running (the engine's least), a page of 16 tokens each
    decided, kept, capped, sized, roomier = (r.getMessage() for r in caplog.records[1:6])
    assert sized.startswith(
        "each engine's KV cache holds its 256 running requests at full length: 256 × (4 prompt"
    )
    assert sized.endswith(
        "= 4,096 tokens (rollout.engine_args.max_total_tokens=4096); a hand-over moves no more"
    )
    assert roomier.startswith("train.micro_batch_size=64: the plan fits 256 as well")
    assert decided.startswith(
        "cluster.offload_trainer=auto: kept on the GPU: beside it each engine's KV cache"
    )
    # and cluster.release_memory=auto: the tiny trainer and the engine both fit resident
    assert kept.startswith(
        "cluster.release_memory=auto: nothing released: trainer and engines stay resident, the weight sync is "
        "the whole hand-over"
    )
    assert capped.startswith(
        "the trainer stays on the GPU while the engines generate: each engine's KV cache is capped"
    )
    with caplog.at_level(logging.INFO):
        caplog.clear()
        _prepare(cpu)
    assert not [r for r in caplog.records if "memory plan" in r.getMessage()]


def test_plan_only_prints_what_the_run_would_log(no_ray, tmp_path, caplog):
    """`run.plan_only=true` plans with what the run decides first (the trainer kept, nothing
    released, the KV cache sized to the running requests: here 256 × (4 + 4 tokens) in pages of
    16, 4,096 tokens, where the fraction of 79.6 GiB would give millions), so it prints the run's
    plan and decision lines word for word: the toy task's prompts are at most 4 tokens, and
    `data.max_prompt_len=4` tells composing so."""
    import logging

    from rlx.config.compose import compose
    from rlx.runtime import _prepare

    overrides = [*GPU, "data.max_prompt_len=4"]
    done = plan_only(no_ray, tmp_path / "plan", *overrides)
    assert done.returncode == 0, done.stderr
    with caplog.at_level(logging.INFO):
        _prepare(compose([*overrides, f"run.output_dir={tmp_path / 'run'}"]))
    logged = [r.getMessage() for r in caplog.records]
    logged = logged[next(i for i, m in enumerate(logged) if m.startswith("memory plan:")) :]
    assert done.stdout.rstrip("\n") == "\n".join(logged)
    assert "KV cache (max_total_tokens 4,096: 4,096 tokens, 512 samples)" in done.stdout


# a Qwen3-1.7B shape (never written: composing builds no weights), samples of 1,024 + 7,168 tokens,
# split over two GPUs of 79.6 GiB
WIDE = ["model.tiny=true", "model.num_layers=28", "model.hidden_size=2048", "model.ffn_hidden_size=6144",
        "model.num_attention_heads=16", "model.num_query_groups=8", "model.kv_channels=128",
        "model.vocab_size=151936", "model.max_position_embeddings=40960", "data.max_prompt_len=1024",
        "rollout.max_response_len=7168", "rollout.batch_size=8", "train.precision=bf16",
        "cluster.gpus_per_node=2", "cluster.num_trainer_procs=1", "cluster.num_rollout_gpus=1",
        "cluster.gpu_memory_gib=79.6"]  # fmt: skip


def test_a_gpu_run_that_cannot_fit_is_refused_when_composing_naming_the_knob():
    from rlx.config.compose import compose
    from rlx.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        compose([*WIDE, "train.micro_batch_size=8"])
    message = str(refused.value)
    assert "memory plan: the trainer GPU needs" in message and "at its peak (training)" in message
    assert "more than the 79.6 GiB of a GPU (cluster.gpu_memory_gib=79.6)" in message
    assert "largest terms (GiB): activations" in message
    assert (
        "set train.micro_batch_size=2 (the plan then predicts" in message
    )  # 4 rows do not fit: 8,192 tokens each
    compose([*WIDE, "train.micro_batch_size=2"])  # what it advises composes


def test_an_engine_cache_that_cannot_hold_one_sample_is_refused_when_composing():
    from rlx.config.compose import compose
    from rlx.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        compose([*WIDE, "train.micro_batch_size=1", "+rollout.engine_args.mem_fraction_static=0.05"])
    message = str(refused.value)
    assert "memory plan: the engines' KV cache on each engine GPU holds" in message
    assert (
        "fewer than one sample of 8,192" in message
        and "set rollout.engine_args.mem_fraction_static=0.06" in message
    )


def test_cpu_runs_are_never_refused_for_memory():
    from rlx.config.compose import compose

    compose(["cluster.gpu_memory_gib=0.001"])  # the default job (CPU): no plan, no refusal


def test_a_model_class_of_the_users_own_has_no_plan():
    from rlx.cluster import ClusterConfig
    from rlx.config.memory_check import memory_plan, no_plan
    from rlx.config.schema import RlxConfig
    from rlx.models.config import ModelConfig

    own = RlxConfig(
        model=ModelConfig(_target_="collections.OrderedDict"), cluster=ClusterConfig(gpus_per_node=1)
    )
    assert memory_plan(own) is None
    assert no_plan(own) == (
        "model._target_=collections.OrderedDict is no rlx ModelFamily, whose parameter count the plan needs"
    )
    assert no_plan(RlxConfig()).startswith("a CPU run")
    assert no_plan(RlxConfig(cluster=ClusterConfig(gpus_per_node=1))) is None
