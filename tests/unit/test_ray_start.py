"""A one-node run's own Ray as `rlx.launcher.ray_start.start_local` asks Ray for it (ray.init
recorded, no Ray started), and the preload module's handling of torch's NVML switch."""

from __future__ import annotations

import importlib
import os

import pytest
import ray

from rlx.launcher import ray_start


@pytest.fixture
def init_args(monkeypatch) -> dict:
    seen: dict = {}
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(kwargs))
    return seen


def test_a_preloading_ray_has_its_workers_import_a_trainer_ranks_modules(init_args):
    ray_start.start_local(preload=True, num_cpus=2, _system_config={"object_timeout_milliseconds": 5})
    assert init_args["address"] == "local" and init_args["num_cpus"] == 2
    assert init_args["_system_config"] == {
        "object_timeout_milliseconds": 5,  # the caller's settings kept
        "preload_python_modules": ["rlx.trainer.preload"],
    }
    importlib.import_module(ray_start.PRELOAD)  # the name Ray's workers import exists


def test_a_plain_ray_preloads_nothing(init_args):
    ray_start.start_local(num_cpus=2)
    assert "_system_config" not in init_args


@pytest.mark.parametrize("before", [None, "0"])
def test_the_preload_answers_cuda_checks_through_nvml_only_while_it_imports(monkeypatch, before):
    if before is None:
        monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", before)
    import rlx.trainer.preload as preload

    importlib.reload(preload)  # runs the module again: sets the switch, imports, restores it
    assert os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK") == before
