"""The shared Ray's idle workers import a trainer rank's modules before they take work
(`gpu_ray`, tests/gpu/conftest.py: `rlx.trainer.preload`) and leave CUDA alone doing it: Ray tells
a GPU actor its GPU (CUDA_VISIBLE_DEVICES) only when the actor takes the worker, and a process that
had initialised CUDA before would see every GPU. Skipped without a GPU."""

from __future__ import annotations

import os
import sys

import pytest
import ray
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("gpu_ray"),
]


def test_a_gpu_actor_on_a_preloaded_worker_sees_only_its_own_gpu():
    class Probe:  # defined here, so Ray's pickle carries it by value (tests/ is not on a worker's path)
        def report(self) -> dict:
            return {
                "preloaded": "rlx.trainer.preload" in sys.modules and "megatron.core" in sys.modules,
                "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "count": torch.cuda.device_count(),
                "uuid": str(torch.cuda.get_device_properties(0).uuid),
            }

    n = torch.cuda.device_count()
    actors = [ray.remote(num_gpus=1)(Probe).remote() for _ in range(n)]
    try:
        reports = ray.get([a.report.remote() for a in actors], timeout=120)
    finally:
        for a in actors:
            ray.kill(a)
    assert all(r["preloaded"] and r["count"] == 1 for r in reports), reports
    assert sorted(r["visible"] for r in reports) == [str(i) for i in range(n)], reports
    assert len({r["uuid"] for r in reports}) == n, reports  # each on the GPU Ray gave it
