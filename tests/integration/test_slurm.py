"""`hydra/launcher=slurm` on a real one-node SLURM (scripts/slurm-local.sh), the multi-node
bootstrap from hand-built SLURM environments, a real two-node Ray joined on loopback, and the
allocation check that runs before anything is submitted."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from rlx.errors import ConfigError
from rlx.launcher.nodes import NodeJoinError, check_allocation, expand_nodelist, join, node_role
from rlx.launcher.slurm import allocation_errors, job_overrides

ROOT = Path(__file__).resolve().parents[2]
SHORT = [
    "rollout.batch_size=8",
    "rollout.n_samples_per_prompt=4",
    "train.micro_batch_size=16",
    "run.progress=False",
]


def slurm_env(node_id: int, num_nodes: int = 2, nodelist: str = "gpu[01-02]", **extra) -> dict[str, str]:
    """What SLURM sets for task `node_id` of a one-task-per-node job."""
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": str(num_nodes),
        "SLURM_NTASKS": str(num_nodes),
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NODEID": str(node_id),
        "SLURM_PROCID": str(node_id),
    }
    return env | extra


# --- which node does what ---------------------------------------------------------------------


def test_nodelist_expands_in_slurm_order():
    assert expand_nodelist("localhost") == ["localhost"]
    assert expand_nodelist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert expand_nodelist("a[8-10]") == ["a8", "a9", "a10"]
    assert expand_nodelist("rack[1-2]-n[1,3]") == ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]
    with pytest.raises(ValueError, match="bad range"):
        expand_nodelist("gpu[a-b]")


def test_node_roles_from_slurm_environment():
    assert node_role({}).kind == "single"  # not under SLURM
    one = node_role(slurm_env(0, num_nodes=1, nodelist="localhost"))
    assert (one.kind, one.job_id, one.writes_results) == ("single", "4242", True)

    head = node_role(slurm_env(0))
    assert (head.kind, head.node_rank, head.hostnames, head.num_nodes) == ("head", 0, ("gpu01", "gpu02"), 2)
    assert head.writes_results
    worker = node_role(slurm_env(1))
    assert (worker.kind, worker.node_rank, worker.writes_results) == ("worker", 1, False)

    with pytest.raises(ConfigError, match="hydra.launcher.tasks_per_node=1"):
        node_role(slurm_env(0) | {"SLURM_NTASKS": "4"})  # two tasks per node
    with pytest.raises(ConfigError, match="SLURM_JOB_NODELIST"):
        node_role(slurm_env(0, nodelist="gpu01"))  # tasks launched outside the allocation's nodes


def test_job_checks_what_slurm_granted():
    cluster = SimpleNamespace(num_nodes=2, gpus_per_node=8)
    check_allocation(node_role(slurm_env(0)), cluster, slurm_env(0, SLURM_GPUS_ON_NODE="8"))
    check_allocation(node_role({}), cluster, {})  # outside SLURM nothing is checked

    small = slurm_env(0, num_nodes=1, nodelist="gpu01", SLURM_JOB_GPUS="0,1,2,3")
    with pytest.raises(ConfigError) as e:
        check_allocation(node_role(small), cluster, small)
    message = str(e.value)
    assert (
        "cluster.num_nodes=2" in message
        and "has 1 node(s)" in message
        and "hydra.launcher.nodes=2" in message
    )
    assert "cluster.gpus_per_node=8" in message and "4 GPU(s)" in message
    no_gpus = slurm_env(0)
    with pytest.raises(ConfigError, match="0 GPU"):
        check_allocation(node_role(no_gpus), cluster, no_gpus)


def test_worker_without_a_head_fails_naming_the_timeout(tmp_path):
    with pytest.raises(NodeJoinError, match=r"node 1 \(gpu02\).*cluster.ray_join_timeout_s=0.5"):
        join(node_role(slurm_env(1)), tmp_path, timeout_s=0.5)


# --- before submission ------------------------------------------------------------------------


def test_sweep_jobs_are_enumerated_as_hydra_numbers_them():
    config = OmegaConf.create(
        {"hydra": {"overrides": {"task": ["algo=grpo,gspo", "rollout.n_samples_per_prompt=4,8", "run.seed=3"]},
                   "sweeper": {"params": None}}}
    )  # fmt: skip
    assert job_overrides(config) == [
        ["algo=grpo", "rollout.n_samples_per_prompt=4", "run.seed=3"],
        ["algo=grpo", "rollout.n_samples_per_prompt=8", "run.seed=3"],
        ["algo=gspo", "rollout.n_samples_per_prompt=4", "run.seed=3"],
        ["algo=gspo", "rollout.n_samples_per_prompt=8", "run.seed=3"],
    ]


def test_allocation_errors_name_the_keys():
    cluster = SimpleNamespace(num_nodes=2, gpus_per_node=8)
    assert allocation_errors({"nodes": 2, "gpus_per_node": 8, "tasks_per_node": 1}, cluster) == []
    assert allocation_errors({"nodes": 4, "gpus_per_node": None, "tasks_per_node": 1}, cluster) == []
    nodes, gpus, tasks = allocation_errors({"nodes": 1, "gpus_per_node": 4, "tasks_per_node": 8}, cluster)
    assert "hydra.launcher.nodes=1" in nodes and "cluster.num_nodes=2" in nodes
    assert "hydra.launcher.gpus_per_node=4" in gpus and "cluster.gpus_per_node=8" in gpus
    assert "hydra.launcher.tasks_per_node=1" in tasks


def test_small_allocation_fails_before_submission(tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, "launch.py", "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep_dir}",
         "hydra.launcher.nodes=1", "hydra.launcher.gpus_per_node=4",
         "cluster=local,2x8", "rollout.num_engines=8", "train.micro_batch_size=32"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "nothing was submitted" in result.stderr and "Traceback" not in result.stderr
    assert "job #1 (cluster=2x8" in result.stderr and "job #0" not in result.stderr
    for key in (
        "hydra.launcher.nodes=1",
        "cluster.num_nodes=2",
        "hydra.launcher.gpus_per_node=4",
        "cluster.gpus_per_node=8",
    ):
        assert key in result.stderr
    assert not sweep_dir.exists()  # no job directory, no sbatch


# --- a real two-node Ray on loopback ----------------------------------------------------------

NODE_SCRIPT = textwrap.dedent(
    """
    import dataclasses, json, os, sys
    import ray
    from rlx.launcher import nodes
    # polls and the worker's grace period shortened (the mechanism is the same): a worker still
    # leaves only once the head's port has stayed closed, 1 s here instead of 10 s
    nodes.POLL_S, nodes.HEAD_GONE_S = 0.2, 1.0
    role = nodes.node_role(os.environ)
    if role.kind == "worker":
        nodes.join(role, sys.argv[1], timeout_s=120)
        print(json.dumps({"worker": "left"}))
    else:
        address, head = nodes.start_head(role, sys.argv[1], timeout_s=120)
        alive = len([n for n in ray.nodes() if n["Alive"]])
        three = dataclasses.replace(role, hostnames=(*role.hostnames, "gpu03"))  # one that never comes
        try:
            nodes._wait_for_nodes(three, address, timeout_s=1)
        except nodes.NodeJoinError as e:
            error = str(e)
        print(json.dumps({"address": address, "alive": alive, "error": error}))
        ray.shutdown()
        nodes.stop(head)
    """
)


def _node(tmp_path, node_id: int) -> subprocess.Popen:
    env = os.environ | slurm_env(node_id, nodelist="localhost,localhost") | {"PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-c", NODE_SCRIPT, str(tmp_path / "run")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_second_node_joins_the_head_and_leaves_with_it(tmp_path):
    head, worker = _node(tmp_path, 0), _node(tmp_path, 1)
    head_out, head_err = head.communicate(timeout=180)
    worker_out, worker_err = worker.communicate(timeout=60)  # leaves once the head's Ray is gone
    assert head.returncode == 0 and worker.returncode == 0, head_err[-2000:] + worker_err[-2000:]
    seen = json.loads(head_out.splitlines()[-1])
    assert seen["alive"] == 2 and seen["address"].startswith("127.0.0.1:")
    assert json.loads(worker_out.splitlines()[-1]) == {"worker": "left"}
    assert json.loads((tmp_path / "run" / ".ray_head.4242.json").read_text())["address"] == seen["address"]
    # the job's Ray is recorded in its own temp dirs, so no later ray.init() on the node joins it
    assert not Path("/tmp/ray/ray_current_cluster").exists()
    # a node that never joins: the message says how many did, which is missing, and the key
    assert "2 of 3 nodes joined" in seen["error"] and "gpu03" in seen["error"].split("missing:")[1]
    assert "cluster.ray_join_timeout_s=1" in seen["error"]


# --- a real SLURM ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm():
    """A one-node SLURM on localhost, started by scripts/slurm-local.sh (a no-op when it is up)."""
    if os.geteuid() != 0:
        pytest.skip("SLURM needs root here (scripts/slurm-local.sh installs and starts the daemons)")
    if shutil.which("sinfo") is None and shutil.which("apt-get") is None:
        pytest.skip("SLURM is not installed and apt-get is not available to install it")
    result = subprocess.run(
        ["bash", "scripts/slurm-local.sh"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0 and "apt-get could not install" in result.stderr:
        pytest.skip(f"apt-get could not install slurm-wlm and munge: {result.stderr[-500:]}")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_sweep_runs_through_sbatch(slurm, tmp_path):
    sweep_dir = tmp_path / "sweep"
    result = subprocess.run(
        [sys.executable, "launch.py", "-m", "hydra/launcher=slurm", f"hydra.sweep.dir={sweep_dir}",
         "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10",
         # one job at a time: two Rays starting at once beside the other test worker, on 2 cores,
         # once took longer than Ray's 30 s start-up limit
         "hydra.launcher.array_parallelism=1",
         "run.num_rollout=2", "algo=grpo,gspo", *SHORT],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert list((sweep_dir / ".submitit").iterdir())  # went through submitit's sbatch files
    summary = [json.loads(line) for line in (sweep_dir / "sweep_summary.jsonl").read_text().splitlines()]
    assert sorted(r["job"] for r in summary) == [0, 1]
    for record in summary:
        rows = [
            json.loads(line)
            for line in (sweep_dir / str(record["job"]) / "metrics.jsonl").read_text().splitlines()
        ]
        rewards = [row["rollout/reward_mean"] for row in rows]
        assert [row["step"] for row in rows] == [0, 1]
        assert record["status"] == "completed" and record["error"] is None
        assert record["overrides"] == ["run.num_rollout=2", f"algo={('grpo', 'gspo')[record['job']]}", *SHORT]
        assert record["final_reward_mean"] == rewards[-1] and record["best_reward_mean"] == max(rewards)
        assert record["num_steps"] == 2 and record["wall_time_s"] > 0
        assert record["slurm_job_id"] and record["dir"] == str(sweep_dir / str(record["job"]))
    assert len({r["slurm_job_id"] for r in summary}) == 2  # two SLURM jobs
