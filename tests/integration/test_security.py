"""A run listens only where it must, and its Ray never runs unauthenticated off the host.

One node: every socket a run listens on (Ray's GCS, raylet, workers and agents, the trainer ranks'
rendezvous and gloo, the weight-sync group, the engines' HTTP servers, sglang-router) is on
loopback, sampled while the run runs. Several nodes: the Ray of a SLURM job requires the job's
token (`rlx.launcher.nodes.start_head`); a driver with it joins and runs tasks, drivers without it
or with another are refused, at once and naming what to set.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import psutil
import pytest
import ray

from rlx.config.compose import compose
from rlx.ports import is_loopback
from rlx.runtime import run

# its runs and heads start a Ray of their own, as launch.py does: no shared Ray (tests/conftest.py)
pytestmark = pytest.mark.own_ray

ROOT = Path(__file__).resolve().parents[2]
SHORT = ["run.num_rollout=2", "rollout.batch_size=8", "rollout.n_samples_per_prompt=4", "train.micro_batch_size=16",
         "run.progress=false", "run.loggers=[jsonl]"]  # fmt: skip


class Listeners:
    """Every LISTEN socket of this process and its descendants (the run's Ray, trainer ranks,
    engines, router), sampled every 0.2 s while the block runs: {(address, port, pid): process}."""

    def __init__(self):
        self.seen: dict[tuple[str, int, int], str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, daemon=True)

    def __enter__(self) -> Listeners:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample_until_stopped(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            processes = {me.pid: me} | {p.pid: p for p in me.children(recursive=True)}
            for conn in psutil.net_connections(kind="inet"):
                key = (conn.laddr.ip, conn.laddr.port, conn.pid) if conn.laddr else None
                if conn.status == psutil.CONN_LISTEN and conn.pid in processes and key not in self.seen:
                    self.seen[key] = _describe(processes[conn.pid])
            self._stop.wait(0.2)

    def off_host(self) -> list[str]:
        return [
            f"{name} (pid {pid}) listens on {ip}:{port}"
            for (ip, port, pid), name in sorted(self.seen.items())
            if not is_loopback(ip)
        ]


def _describe(process: psutil.Process) -> str:
    try:
        return " ".join(" ".join(process.cmdline()).split())[:120] or process.name()  # Ray pads its titles
    except psutil.Error:  # gone meanwhile
        return "(ended)"


@pytest.fixture
def no_shared_ray():
    """The run starts a Ray of its own, as `python launch.py` does (the module's shared Ray is
    stopped; the next module starts it again)."""
    ray.shutdown()
    yield
    ray.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        [],  # the default job: one engine, one trainer rank, weights through the disk
        # the router in front of two engines, two trainer ranks (gloo between them), and the
        # weight-sync group (trainer rank 0 broadcasting to the engines over gloo)
        ["rollout.num_engines=2", "cluster.num_trainer_procs=2", "rollout.weight_sync=distributed"],
    ],
    ids=["default", "router, two ranks, distributed sync"],
)
def test_a_one_node_run_listens_on_loopback_only(tmp_path, no_shared_ray, overrides):
    with Listeners() as listeners:
        history = run(compose([f"run.output_dir={tmp_path}", *SHORT, *overrides]))
    assert [h["version"] for h in history] == [1, 2]
    assert not listeners.off_host(), "listening off the host:\n" + "\n".join(listeners.off_host())
    names = " ".join(listeners.seen.values())
    # the sampler saw the run's processes
    for part in ("gcs_server", "raylet", "EngineActor", "TrainerRank", *(["router"] if overrides else [])):
        assert part in names, f"no listener of {part} seen among {sorted(set(listeners.seen.values()))}"
    assert not ray.is_initialized()  # the run's own Ray, stopped with it


# --- several nodes: the job's Ray requires its token ------------------------------------------

HEAD_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import ray
    from rlx.launcher import nodes
    role = nodes.NodeRole("head", 0, ("localhost",), "4343")
    address, head = nodes.start_head(role, sys.argv[1], timeout_s=120)

    @ray.remote(num_cpus=0)
    def node_id():
        return ray.get_runtime_context().get_node_id()

    print(json.dumps({"address": address, "ran": ray.get(node_id.remote()), "pid": head.pid}), flush=True)
    sys.stdin.readline()  # until the test is done with the head's Ray
    ray.shutdown()
    nodes.stop(head)
    """
)

# a driver joining a Ray it did not start (cluster.ray_address), as a run of several nodes does
DRIVER_SCRIPT = textwrap.dedent(
    """
    import json, sys, types
    import ray
    from rlx.launcher import ray_start
    cluster = types.SimpleNamespace(num_nodes=2, ray_address=sys.argv[1], ray_allow_unauthenticated=False)
    try:
        ray_start.connect(cluster)
    except Exception as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e)}))
        sys.exit(0)

    @ray.remote(num_cpus=0)
    def node_id():
        return ray.get_runtime_context().get_node_id()

    print(json.dumps({"ran": ray.get(node_id.remote())}))
    """
)


def _env(**extra: str) -> dict[str, str]:
    """This process's environment without its Ray authentication settings, plus `extra` (those of
    the driver or head, say)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    return env | {"PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"} | extra


# Ray's driver tries the GCS 20 times, a second apart, before it gives up on a refused token; a
# driver the head must refuse tries twice (RAY_gcs_server_port_wait_time_s): refused all the same
REFUSED_RETRIES = {"RAY_gcs_server_port_wait_time_s": "2"}


def _driver(address: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", DRIVER_SCRIPT, address], env=_env(**env),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _outcome(driver: subprocess.Popen) -> dict:
    out, err = driver.communicate(timeout=120)  # a refusal comes after Ray's connection retries
    assert driver.returncode == 0 and out.strip(), err[-3000:]
    return json.loads(out.splitlines()[-1])


def test_a_jobs_ray_requires_its_token(tmp_path):
    run_dir, head_log = tmp_path / "run", tmp_path / "head.log"
    with open(head_log, "w") as log:  # a file: a pipe nobody reads while the head waits could fill
        head = subprocess.Popen(
            [sys.executable, "-c", HEAD_SCRIPT, str(run_dir)], env=_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
        )  # fmt: skip
    try:
        line = head.stdout.readline()
        assert line, head_log.read_text()[-3000:]
        started = json.loads(line)
        assert started["ran"]  # the head's driver joined with the job's token and ran a task
        rendezvous = run_dir / ".ray_head.4343.json"
        token = json.loads(rendezvous.read_text())["token"]
        assert len(token) == 64 and stat.S_IMODE(rendezvous.stat().st_mode) == 0o600  # the job's user only
        ray_processes = [
            psutil.Process(started["pid"]),
            *psutil.Process(started["pid"]).children(recursive=True),
        ]
        assert not [p for p in ray_processes if token in " ".join(p.cmdline())]  # never on a command line

        address = started["address"]
        drivers = {
            "token": _driver(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token),
            "none": _driver(address, **REFUSED_RETRIES),
            "another": _driver(address, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="f" * 64, **REFUSED_RETRIES),
        }
        outcomes = {name: _outcome(driver) for name, driver in drivers.items()}
    finally:
        head.stdin.close()  # the head stops its Ray
        head.wait(timeout=120)
    assert outcomes["token"] == {"ran": started["ran"]}  # joined, ran a task on the head's node
    for name in ("none", "another"):
        assert outcomes[name]["error"] == "RayAuthError", outcomes[name]
        message = outcomes[name]["message"]
        assert f"cluster.ray_address={address} refused this driver" in message
        assert "RAY_AUTH_MODE=token" in message and "RAY_AUTH_TOKEN" in message
    assert "RAY_AUTH_MODE=unset, RAY_AUTH_TOKEN unset" in outcomes["none"]["message"]
