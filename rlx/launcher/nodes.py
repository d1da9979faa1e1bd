"""One job over several SLURM nodes: which node does what, and the Ray cluster they form.

`hydra/launcher=slurm` starts one task per node (`tasks_per_node: 1`), each running `launch.py`'s
job. `node_role(os.environ)` reads what SLURM sets for the task (SLURM_JOB_ID, SLURM_NNODES,
SLURM_NODEID, SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST):

    single   not under SLURM, or a one-node job: nothing to start (the run starts its own local Ray)
    head     node 0: `ray start --head`, waits for the others, runs the driver against that Ray
    worker   nodes 1..N-1: `ray start --address=HEAD` and stay until the head goes away

The head publishes its address in a rendezvous file in the job's run directory (SLURM jobs see one
shared filesystem: submitit already needs it), so two jobs on one node never fight over a port.

The job's Ray requires a token of the job's own (Ray's token authentication: its servers listen on
every interface of a node whose address is not loopback): the head makes it, starts its Ray and
its driver with it, and hands it to the other nodes in the rendezvous file, which only the job's
user may read (mode 0600), as `rlx.placement` hands the engines' API key to their processes.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlx.errors import ConfigError, UserError
from rlx.ports import PORT_ATTEMPTS, free_port

log = logging.getLogger(__name__)

POLL_S = 1.0  # how often the head counts nodes and a worker checks the head
HEAD_GONE_S = 10.0  # a worker leaves once the head's Ray port has been closed this long


class NodeJoinError(UserError):
    """A node of a multi-node job did not reach the Ray head in time."""


class HeadPortTaken(NodeJoinError):
    """`ray start --head` could not bind the port found free for it: another process took it first."""


@dataclass(frozen=True)
class NodeRole:
    """What this task of a SLURM job does (`kind`) and where the other nodes are."""

    kind: Literal["single", "head", "worker"]
    node_rank: int = 0  # SLURM_NODEID
    hostnames: tuple[str, ...] = ()  # the job's nodes, node 0 first (SLURM_JOB_NODELIST expanded)
    job_id: str | None = None  # SLURM_JOB_ID

    @property
    def num_nodes(self) -> int:
        return max(len(self.hostnames), 1)

    @property
    def writes_results(self) -> bool:
        """Only the driver's task reports the job (summary line, return value)."""
        return self.kind != "worker"


def node_role(env: Mapping[str, str]) -> NodeRole:
    """This task's role from SLURM's environment variables (`os.environ`, or a hand-built dict)."""
    if "SLURM_JOB_ID" not in env:
        return NodeRole("single")
    num_nodes = int(env.get("SLURM_NNODES") or env.get("SLURM_JOB_NUM_NODES") or 1)
    job_id = env["SLURM_JOB_ID"]
    if num_nodes == 1:
        return NodeRole("single", job_id=job_id)
    num_tasks = int(env.get("SLURM_NTASKS", num_nodes))
    if num_tasks != num_nodes:
        raise ConfigError(
            f"SLURM job {job_id} runs {num_tasks} tasks on {num_nodes} nodes; rlx needs one task per "
            "node (the first starts Ray, the others join it): set hydra.launcher.tasks_per_node=1 "
            "(or srun --ntasks-per-node=1)"
        )
    hostnames = expand_nodelist(env["SLURM_JOB_NODELIST"])
    if len(hostnames) != num_nodes:
        raise ConfigError(
            f"SLURM_JOB_NODELIST={env['SLURM_JOB_NODELIST']!r} names {len(hostnames)} nodes but "
            f"SLURM_NNODES={num_nodes}; run the job's tasks with srun inside the allocation"
        )
    node_rank = int(env["SLURM_NODEID"])
    return NodeRole("head" if node_rank == 0 else "worker", node_rank, tuple(hostnames), job_id)


def check_allocation(role: NodeRole, cluster, env: Mapping[str, str]) -> None:
    """Raise ConfigError when this SLURM job has fewer nodes or GPUs per node than `cluster` asks."""
    if role.job_id is None:
        return
    errors = []
    if cluster.num_nodes > role.num_nodes:
        errors.append(
            f"cluster.num_nodes={cluster.num_nodes} but SLURM job {role.job_id} has {role.num_nodes} "
            f"node(s); set hydra.launcher.nodes={cluster.num_nodes} (it follows cluster.num_nodes "
            "unless overridden) or choose a smaller cluster="
        )
    gpus = _gpus_on_node(env)
    if gpus is not None and cluster.gpus_per_node > gpus:
        errors.append(
            f"cluster.gpus_per_node={cluster.gpus_per_node} but SLURM gave this node {gpus} GPU(s); "
            f"set hydra.launcher.gpus_per_node={cluster.gpus_per_node}"
        )
    if errors:
        raise ConfigError("\n".join(errors))


def _gpus_on_node(env: Mapping[str, str]) -> int | None:
    if "SLURM_GPUS_ON_NODE" in env:
        return int(env["SLURM_GPUS_ON_NODE"])
    if "SLURM_JOB_GPUS" in env or "SLURM_STEP_GPUS" in env:
        return len([g for g in (env.get("SLURM_STEP_GPUS") or env["SLURM_JOB_GPUS"]).split(",") if g])
    return 0  # SLURM sets one of these whenever it allocated GPUs


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list in order: "gpu[01-03,07],login" -> gpu01 gpu02 gpu03 gpu07 login."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist):
        parts = re.split(r"\[([^\]]*)\]", item)  # text, ranges, text, ranges, ..., text
        choices = [[text] if i % 2 == 0 else _expand_ranges(text, nodelist) for i, text in enumerate(parts)]
        hosts += ["".join(combo) for combo in itertools.product(*choices)]
    return hosts


def _expand_ranges(ranges: str, nodelist: str) -> list[str]:
    out = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"cannot read the SLURM host list {nodelist!r}: bad range {part!r}")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi or lo) + 1)]
    return out


def rendezvous_path(run_dir: str | Path, role: NodeRole) -> Path:
    """Where the head writes its Ray address for this SLURM job's other nodes."""
    return Path(run_dir) / f".ray_head.{role.job_id}.json"


def start_head(role: NodeRole, run_dir: str | Path, timeout_s: float) -> tuple[str, subprocess.Popen]:
    """Start a Ray head on this node, publish its address, wait for every node of the job.

    Returns (the address for `ray.init`, the `ray start --block` process: terminating it stops
    this job's Ray and nothing else on the node). This process joins with the job's token (and so
    does the run it goes on to drive). Raises NodeJoinError naming the missing nodes.
    """
    from rlx.launcher import ray_start  # imports Ray: not when launch.py only validates a config

    host_ip = socket.gethostbyname(role.hostnames[0])
    log_path = Path(run_dir) / f"ray_node0.{role.job_id}.log"
    token = ray_start.new_token()
    ray_start.use_token(token)
    address, proc = _start_head_ray(role, host_ip, log_path, token, timeout_s)
    try:
        _publish(rendezvous_path(run_dir, role), {"address": address, "job_id": role.job_id, "token": token})
        log.info("Ray head at %s; waiting for %d more node(s)", address, role.num_nodes - 1)
        _wait_for_nodes(role, address, timeout_s)
    except BaseException:
        stop(proc)
        raise
    return address, proc


def _start_head_ray(
    role: NodeRole, host_ip: str, log_path: Path, token: str, timeout_s: float
) -> tuple[str, subprocess.Popen]:
    """`ray start --head` on a port found free, joined: (its address, its process). A port that
    another process took before Ray's GCS bound it is picked again, up to PORT_ATTEMPTS times."""
    for _ in range(PORT_ATTEMPTS - 1):
        try:
            return _head_on_free_port(role, host_ip, log_path, token, timeout_s)
        except HeadPortTaken as e:
            log.warning("%s; picking another", e)
    return _head_on_free_port(role, host_ip, log_path, token, timeout_s)  # its error is the caller's


def _head_on_free_port(
    role: NodeRole, host_ip: str, log_path: Path, token: str, timeout_s: float
) -> tuple[str, subprocess.Popen]:
    port = free_port(host_ip)
    address = f"{host_ip}:{port}"
    head_args = ["--head", f"--port={port}", f"--node-ip-address={host_ip}", "--include-dashboard=false"]
    logged = log_path.stat().st_size if log_path.exists() else 0
    proc = _ray_start(role, head_args, log_path, token)
    try:
        _connect(address, proc, log_path, timeout_s)
    except NodeJoinError as e:
        stop(proc)
        if _port_taken(log_path, logged, port):
            raise HeadPortTaken(f"Ray head: port {port} was taken before Ray bound it ({log_path})") from e
        raise
    except BaseException:
        stop(proc)
        raise
    return address, proc


def _port_taken(log_path: Path, start: int, port: int) -> bool:
    """Whether the output of a `ray start --head --port=PORT` (from byte `start` of its log) says
    that its GCS could not bind the port. Ray 2.60: "Failed to start the grpc server. The
    specified port is PORT. ... `Address already in use` ..." after about 40 s of its retries."""
    with open(log_path, "rb") as log_file:
        log_file.seek(start)
        text = log_file.read().decode(errors="replace")
    return f"Failed to start the grpc server. The specified port is {port}." in text


def _publish(path: Path, record: dict) -> None:
    """Write `record` (with the job's token) where the other nodes look, readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.write(json.dumps(record))
    tmp.replace(path)


def _connect(address: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    from rlx.launcher import ray_start  # imports Ray: not when launch.py only validates a config

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise NodeJoinError(
                f"`ray start --head` exited with code {proc.returncode} ({log_path}):\n{_tail(log_path)}"
            )
        try:
            ray_start.join(address)  # a refused token raises at once: waiting would not help
            return
        except ConnectionError:
            if time.monotonic() > deadline:
                raise NodeJoinError(
                    f"the Ray head at {address} did not come up within {timeout_s:g} s"
                ) from None
            time.sleep(POLL_S)


def _wait_for_nodes(role: NodeRole, address: str, timeout_s: float) -> None:
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        alive = [n for n in ray.nodes() if n["Alive"]]
        if len(alive) >= role.num_nodes:
            return
        if time.monotonic() > deadline:
            joined = {n["NodeManagerHostname"] for n in alive} | {n["NodeManagerAddress"] for n in alive}
            missing = [h for h in role.hostnames[1:] if h not in joined and _ip(h) not in joined]
            raise NodeJoinError(
                f"{len(alive)} of {role.num_nodes} nodes joined the Ray head at {address} within "
                f"cluster.ray_join_timeout_s={timeout_s:g} s (SLURM job {role.job_id}); missing: "
                f"{', '.join(missing) or 'unknown'}. Check those nodes' task logs under the sweep's "
                ".submitit/ folder; start one task per node (hydra.launcher.tasks_per_node=1); "
                "raise cluster.ray_join_timeout_s if nodes start slowly"
            )
        time.sleep(POLL_S)


def join(role: NodeRole, run_dir: str | Path, timeout_s: float) -> None:
    """Join the head's Ray from a worker node and stay until the head's Ray is gone."""
    path = rendezvous_path(run_dir, role)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise NodeJoinError(
                f"node {role.node_rank} ({role.hostnames[role.node_rank]}) found no Ray head address at "
                f"{path} within cluster.ray_join_timeout_s={timeout_s:g} s; see node 0's task log"
            )
        time.sleep(POLL_S)
    head = json.loads(path.read_text())
    address = head["address"]
    node_ip = socket.gethostbyname(role.hostnames[role.node_rank])  # the address SLURM knows the node by
    log_path = Path(run_dir) / f"ray_node{role.node_rank}.{role.job_id}.log"
    proc = _ray_start(role, [f"--address={address}", f"--node-ip-address={node_ip}"], log_path, head["token"])
    log.info("node %d joined the Ray head at %s", role.node_rank, address)
    try:
        _stay_while_head_lives(address, proc)
    finally:
        stop(proc)


def _stay_while_head_lives(address: str, proc: subprocess.Popen) -> None:
    host, port = address.rsplit(":", 1)
    gone_since = None
    while proc.poll() is None:
        if _reachable(host, int(port)):
            gone_since = None
        elif gone_since is None:
            gone_since = time.monotonic()
        elif time.monotonic() - gone_since > HEAD_GONE_S:
            return
        time.sleep(POLL_S)


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def _ip(host: str) -> str | None:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def _ray_start(role: NodeRole, args: list[str], log_path: Path, token: str) -> subprocess.Popen:
    """`ray start ... --block`: it owns the Ray processes it starts for this job, and stops them
    when terminated (`stop`), leaving any other Ray on the node alone. Its Ray requires `token`
    (in its environment, not its command line). Output goes to `log_path`."""
    from rlx.launcher import ray_start  # imports Ray: not when launch.py only validates a config

    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **ray_start.token_env(token)}
    env.pop("RAY_AUTH_TOKEN_PATH", None)
    # at the end of the job there is nothing to drain: stop at once, even with the head gone
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    # A temp dir of the job's own: `ray start` records its cluster in <temp dir>/ray_current_cluster,
    # and under the default /tmp/ray every later `ray.init()` on the node would join this job's Ray.
    temp_dir = Path(tempfile.gettempdir()) / f"rlx_ray_{role.job_id}_{role.node_rank}"
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
    cmd += [f"--temp-dir={temp_dir}", *args]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as out:
        return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def stop(proc: subprocess.Popen, timeout_s: float = 30) -> None:
    """Stop a `ray start --block` process (it takes down the Ray processes it started)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _tail(path: Path, num_chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""
