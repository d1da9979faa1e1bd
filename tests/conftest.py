"""Fixtures shared by every test tier."""

from __future__ import annotations

import os
import sys
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
# the suite's load: `--durations=0`; 2026-11-30, a pytest run of 616 s), the files of 5 s or more; the
# order the workers take files in (`pytest_collection_modifyitems`). Refresh it when a file's time
# changes by much.
FILE_SECONDS = {
    "integration/test_algorithms_learn.py": 87,
    "unit/test_triton_interpreted.py": 72,
    "integration/test_launch.py": 66,
    "integration/test_slurm.py": 54,
    "integration/test_real_model.py": 53,
    "integration/test_fault_tolerance.py": 53,
    "integration/test_context_parallel.py": 48,
    "integration/test_e2e.py": 44,
    "integration/test_run_modes.py": 38,
    "integration/test_security.py": 38,
    "integration/test_hosts.py": 34,
    "integration/test_tool_calc.py": 32,
    "integration/test_lora_learns.py": 31,
    "integration/test_trainer.py": 27,
    "integration/test_lora_parallel.py": 26,
    "integration/test_critic.py": 24,
    "integration/test_pipeline.py": 23,
    "integration/test_async.py": 21,
    "unit/test_agent_routing.py": 20,
    "integration/test_engine_auth.py": 19,
    "integration/test_context_parallel_model.py": 18,
    "config/test_plan_only.py": 18,
    "integration/test_pool.py": 17,
    "integration/test_weight_paths.py": 16,
    "integration/test_sweep.py": 15,
    "integration/test_checkpoint.py": 14,
    "unit/test_megatron_jit.py": 20,
    "unit/test_megatron_logging.py": 13,
    "unit/test_layers.py": 12,
    "config/test_compose.py": 12,
    "integration/test_engine_http.py": 11,
    "config/test_from_checkpoint.py": 11,
    "config/test_doc_commands.py": 10,
    "integration/test_producer.py": 10,
    "integration/test_weight_sync_distributed.py": 10,
    "integration/test_moe_families.py": 9,
    "unit/test_lora.py": 9,
    "config/test_bad_input.py": 9,
    "config/test_algo_options.py": 8,
    "integration/test_family_loops.py": 8,
    "integration/test_placement.py": 8,
    "config/test_command_line.py": 8,
    "unit/test_memory_plan.py": 7,
    "integration/test_dense_families.py": 7,
    "config/test_megatron_checks.py": 6,
    "unit/test_loop_watch.py": 6,
    "unit/test_pytest_cpu.py": 5,
    "integration/test_weight_sync_tensor.py": 5,
    "config/test_tasks.py": 5,
    "unit/test_agent_sandbox.py": 5,
    "integration/test_timeouts.py": 5,
}
LONG_S = 30  # a file this long goes in the first band even if it needs no Ray
_LAST_BAND: set[Path] = set()  # the files of the last band (`pytest_collection_modifyitems`)


def pytest_collection_modifyitems(config, items):
    """The longest test files first (`FILE_SECONDS`), in three bands: the files that share their
    worker's Ray and the long ones, then the modules marked `own_ray`, then the rest. With `-n 2
    --dist loadfile --no-loadscope-reorder` (scripts/test.sh) pytest-xdist hands whole files to
    its workers in this order, so the two workers end together on short files instead of one
    waiting while the other runs a long one. An `own_ray` module stops its worker's shared Ray
    (`ray_session`), and with it the kept trainer ranks and engines (`kept_actors`): after the
    files that use them, no module starts them again (Ray, Megatron's and the engine's imports:
    seconds of CPU each time); a worker's first file of the last band stops them
    (`_integration_tests_share_ray`). The order within a file is kept."""
    tests = Path(__file__).parent

    def rank(item) -> tuple[int, float]:
        seconds = FILE_SECONDS.get(item.path.relative_to(tests).as_posix(), 0)
        if item.get_closest_marker("own_ray") is not None:
            return (1, -seconds)
        # tests/gpu's modules that use the GPU suite's Ray (`gpu_ray`, with its preloaded workers)
        # share it as the integration tests share theirs: none may come after a last-band module
        # has stopped it
        shares_ray = "integration" in item.path.parts or "gpu_ray" in item.fixturenames
        return (0 if shares_ray or seconds >= LONG_S else 2, -seconds)

    items.sort(key=rank)  # stable: collection order within a rank
    _LAST_BAND.update(item.path for item in items if rank(item)[0] == 2)


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
    marked `own_ray`: its tests take a Ray of their own, which stops the shared one. A module of
    the last band stops it: none after it uses it, and idle, its daemons, workers and kept
    processes take about 10% of a core."""
    if "integration" in request.node.path.parts and request.node.get_closest_marker("own_ray") is None:
        request.getfixturevalue("kept_actors")
        request.getfixturevalue("ray_session")
    elif request.node.path in _LAST_BAND and "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()


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
