"""GPU placement on a Ray cluster with logical GPUs (this machine has none: Ray only counts them):
which GPU each trainer rank and engine is given, split and colocated."""

from __future__ import annotations

import pytest
import ray
from helpers import own_ray  # tests/ is on sys.path

from rlx.cluster import ClusterConfig
from rlx.placement import plan
from rlx.rollout.config import RolloutConfig

# a Ray with 4 pretend GPUs of its own, not the shared one (tests/conftest.py)
pytestmark = pytest.mark.own_ray


@ray.remote
class Probe:
    def gpus(self) -> list[int]:
        return [int(g) for g in ray.get_gpu_ids()]


@pytest.fixture(scope="module")
def four_gpus():
    with own_ray(num_cpus=2, num_gpus=4):
        yield


def _assigned(options: list[dict]) -> list[list[int]]:
    probes = [Probe.options(**o).remote() for o in options]
    try:
        return ray.get([p.gpus.remote() for p in probes], timeout=60)
    finally:
        for p in probes:
            ray.kill(p)


def test_split_gives_trainer_and_engines_disjoint_gpus(four_gpus):
    cluster = ClusterConfig(gpus_per_node=4, num_trainer_procs=2, num_rollout_gpus=2)
    placement = plan(cluster, RolloutConfig(num_engines=2))
    try:
        assert placement.bundles == [{"GPU": 1.0, "CPU": 0.0}] * 4
        trainer, engines = _assigned(placement.trainer), _assigned(placement.engines)
        assert all(len(g) == 1 for g in trainer + engines)
        assert sorted(g[0] for g in trainer + engines) == [0, 1, 2, 3]  # four different GPUs
    finally:
        placement.remove()


def test_colocated_puts_rank_i_and_engine_i_on_one_gpu(four_gpus):
    cluster = ClusterConfig(gpus_per_node=4, num_trainer_procs=2, num_rollout_gpus=2, colocate=True)
    placement = plan(cluster, RolloutConfig(num_engines=2))
    try:
        assert len(placement.bundles) == 2
        trainer, engines = _assigned(placement.trainer), _assigned(placement.engines)
        assert trainer == engines and trainer[0] != trainer[1]
    finally:
        placement.remove()


def test_an_engine_over_two_gpus_gets_both(four_gpus):
    cluster = ClusterConfig(gpus_per_node=4, num_trainer_procs=2, num_rollout_gpus=2)
    placement = plan(cluster, RolloutConfig(num_engines=1, gpus_per_engine=2))
    try:
        (engine,) = _assigned(placement.engines)
        trainer = _assigned(placement.trainer)
        assert len(engine) == 2 and not set(engine) & {g for t in trainer for g in t}
    finally:
        placement.remove()


def test_too_few_gpus_fails_naming_the_counts(four_gpus):
    cluster = ClusterConfig(gpus_per_node=8, num_trainer_procs=4, num_rollout_gpus=4)
    with pytest.raises(
        RuntimeError, match=r"needs 8 GPUs .*num_trainer_procs=4 .*num_rollout_gpus=4.* has 4"
    ):
        plan(cluster, RolloutConfig(num_engines=4))


def test_cpu_runs_need_no_placement_group():
    placement = plan(ClusterConfig(num_trainer_procs=2), RolloutConfig(num_engines=3))
    placement.remove()  # the run's key out of this process's environment, for the next tests
    assert placement.group is None and len(placement.trainer) == 2 and len(placement.engines) == 3
