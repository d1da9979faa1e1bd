"""Fixtures shared by every test tier."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# No test reaches the network: a Hugging Face repo id resolves from the local cache or fails at once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from helpers import write_tiny_qwen3  # tests/ is on sys.path


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """A random tiny Qwen3 HF checkpoint (config.json, model.safetensors, tokenizer.json), seed 0."""
    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3") / "m", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_factory(tmp_path_factory):
    """`make(seed)`: the tiny Qwen3 checkpoint initialised from `seed` (written once per session)."""
    root = tmp_path_factory.mktemp("tiny_qwen3_seeds")

    def make(seed: int) -> Path:
        return write_tiny_qwen3(root / f"seed{seed}", seed=seed)

    return make


# Seconds each test file takes in `bash scripts/test.sh` (the sum of its tests' durations there, under
# the suite's load: `--durations=0`), the files of 5 s or more; the order the workers take files in
# (`pytest_collection_modifyitems`). Refresh it when a file's time changes by much.
FILE_SECONDS = {
    "integration/test_algorithms_learn.py": 122,
    "integration/test_real_model.py": 119,
    "unit/test_triton_interpreted.py": 87,
    "integration/test_slurm.py": 68,
    "integration/test_context_parallel.py": 66,
    "integration/test_fault_tolerance.py": 66,
    "integration/test_security.py": 56,
    "integration/test_e2e.py": 55,
    "integration/test_run_modes.py": 54,
    "integration/test_trainer.py": 47,
    "integration/test_hosts.py": 45,
    "integration/test_launch.py": 45,
    "integration/test_pipeline.py": 43,
    "integration/test_tool_calc.py": 39,
    "integration/test_lora_parallel.py": 37,
    "integration/test_async.py": 37,
    "integration/test_lora_learns.py": 33,
    "integration/test_pool.py": 30,
    "integration/test_sweep.py": 28,
    "integration/test_producer.py": 25,
    "integration/test_engine_auth.py": 23,
    "integration/test_weight_paths.py": 23,
    "unit/test_agent_routing.py": 21,
    "integration/test_checkpoint.py": 20,
    "config/test_plan_only.py": 20,
    "unit/test_megatron_logging.py": 19,
    "integration/test_family_loops.py": 19,
    "unit/test_megatron_jit.py": 19,
    "integration/test_critic.py": 17,
    "integration/test_context_parallel_model.py": 16,
    "integration/test_moe_families.py": 15,
    "unit/test_layers.py": 15,
    "config/test_compose.py": 14,
    "config/test_doc_commands.py": 12,
    "unit/test_lora.py": 11,
    "integration/test_engine_http.py": 11,
    "config/test_from_checkpoint.py": 11,
    "config/test_bad_input.py": 11,
    "integration/test_weight_sync_distributed.py": 10,
    "integration/test_placement.py": 10,
    "config/test_algo_options.py": 10,
    "unit/test_memory_plan.py": 9,
    "config/test_command_line.py": 8,
    "integration/test_dense_families.py": 8,
    "integration/test_weight_sync_tensor.py": 7,
    "integration/test_golden.py": 6,
    "config/test_megatron_checks.py": 6,
    "integration/test_timeouts.py": 6,
    "config/test_cluster.py": 6,
    "unit/test_loop_watch.py": 6,
    "unit/test_pytest_cpu.py": 5,
    "unit/test_agent_sandbox.py": 5,
}
LONG_S = 30  # a file this long goes in the first band even if it needs no Ray


def pytest_collection_modifyitems(config, items):
    """The longest test files first (`FILE_SECONDS`), in three bands: the files that share their
    worker's Ray and the long ones, then the modules marked `own_ray`, then the rest. With `-n 2
    --dist loadfile --no-loadscope-reorder` (scripts/test.sh) pytest-xdist hands whole files to
    its workers in this order, so the two workers end together on short files instead of one
    waiting while the other runs a long one. An `own_ray` module stops its worker's shared Ray
    (`ray_session`), and with it the kept trainer ranks and engines (`kept_actors`): after the
    files that use them, no module starts them again (Ray, Megatron's and the engine's imports:
    seconds of CPU each time). The order within a file is kept."""
    tests = Path(__file__).parent

    def rank(item) -> tuple[int, float]:
        seconds = FILE_SECONDS.get(item.path.relative_to(tests).as_posix(), 0)
        if item.get_closest_marker("own_ray") is not None:
            return (1, -seconds)
        shares_ray = "integration" in item.path.parts
        return (0 if shares_ray or seconds >= LONG_S else 2, -seconds)

    items.sort(key=rank)  # stable: collection order within a rank


@pytest.fixture(scope="module")
def ray_session():
    """This test process's Ray, shared by its tests: started by the first module that needs it and
    left up for the next (a run that finds Ray up uses it and leaves it up), so Ray's start-up and
    shut-down (about 5 s of CPU) are paid once per pytest worker, not once per run. It is started
    as a run starts its own (`rlx.launcher.ray_start`: on loopback). A test that needs a Ray of
    another shape takes one with `helpers.own_ray`."""
    import ray

    from rlx.launcher import ray_start

    if not ray.is_initialized():
        ray_start.start_local(num_cpus=2, logging_level="ERROR")
    yield


@pytest.fixture(scope="session")
def kept_actors():
    """Trainer rank and engine processes outlive their runs within this pytest worker and the next
    run sets them up again (`rlx.actor_reuse.keep_actors`): a new one spends seconds of CPU on its
    imports (Megatron; torch and the engine's HTTP stack), most of a short run's."""
    from rlx.actor_reuse import keep_actors

    with keep_actors():
        yield


@pytest.fixture(scope="module", autouse=True)
def _integration_tests_share_ray(request):
    """Every integration test finds this process's Ray up (`ray_session`): its runs use it, and
    they keep their trainer ranks and engines for the next run (`kept_actors`). Not for a module
    marked `own_ray`: its tests take a Ray of their own, which stops the shared one."""
    if "integration" in request.node.path.parts and request.node.get_closest_marker("own_ray") is None:
        request.getfixturevalue("kept_actors")
        request.getfixturevalue("ray_session")


@pytest.fixture(scope="module")
def world():
    """One gloo rank with megatron's parallel state (TP=1, EP=1) for the test module."""
    from helpers import megatron_world  # tests/ is on sys.path

    with megatron_world():
        yield


@pytest.fixture(scope="session")
def scrambled_dir(tiny_qwen3_dir, tmp_path_factory) -> Path:
    """The tiny checkpoint with weights redrawn at std 0.3: at init scale a 2-layer model just
    repeats its last token greedily, which would make token-for-token comparisons vacuous."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_dir), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, 0.3, generator=generator)
    path = tmp_path_factory.mktemp("scrambled") / "m"
    model.save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_qwen3_dir / name, path / name)
    return path
