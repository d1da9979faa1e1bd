"""Addresses, ports and the API key of the processes rlx starts (trainer rendezvous, engines, router).

On one node everything binds loopback; across nodes (`cluster.num_nodes > 1`) the engines bind
their node's address (HOST_ENV, through Ray's `runtime_env`). Either way every run has an API key
of its own (`new_api_key`) that its engines and the router require (`Authorization: Bearer KEY`,
SGLang's `--api-key`): on loopback too, where any process of any user on the machine could
otherwise reload the weights or abort the run's requests. `rlx.placement.plan` makes it and puts
it in the driver's environment (API_KEY_ENV) for the driver's own clients; the engines and trainer
ranks get it as an argument of their set-up, and child servers through their environment
(`rlx.rollout.keyed_launch`), never on a command line, which every user of the machine can read.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket

LOOPBACK = "127.0.0.1"
COLLECTIVE_INTERFACE_ENVS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
API_KEY_ENV = "RLX_ENGINE_API_KEY"  # the run's key, in the driver (and a child server) while it runs
HOST_ENV = "RLX_ENGINE_HOST"  # "node": engines bind their Ray node's address; unset: loopback


def held_store(host: str, timeout_s: float):
    """A torch.distributed TCPStore master listening on `host`, on a port the OS picks (`.port`)
    and that it holds from now on: no other process can take the port between its choice and
    the peers' coming, as one could with a port found free first (`free_port`) and bound later."""
    return tcp_store(host, 0, is_master=True, timeout_s=timeout_s, wait_for_workers=False)


def tcp_store(
    host: str,
    port: int,
    *,
    is_master: bool,
    timeout_s: float,
    world_size: int | None = None,
    wait_for_workers: bool = True,
):
    """A torch.distributed TCPStore at `host:port` (port 0 with `is_master`: one the OS picks). A
    master listens on `host` only: TCPStore's own server would listen on every interface whatever
    `host` says, so it gets a socket bound here (`master_listen_fd`)."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
        port = sock.getsockname()[1]
    except OSError:
        sock.close()
        raise
    return dist.TCPStore(
        host, port, world_size, True, timeout=timeout, wait_for_workers=wait_for_workers,
        master_listen_fd=sock.detach(),
    )  # fmt: skip


# a port found free, then taken by another process before the child bound it: a caller whose port
# is its own picks another (its child's start failed naming the port), this many times in all
PORT_ATTEMPTS = 3


def free_port(host: str = LOOPBACK) -> int:
    """A port on `host` that was free a moment ago: the caller's child binds it, and another process
    may take it first (the caller then picks again, up to PORT_ATTEMPTS times)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def node_address() -> str:
    """This process's node address as Ray sees it (what other nodes reach it by)."""
    import ray

    return ray.util.get_node_ip_address()


def route_address(to_host: str) -> str:
    """This machine's address on the interface that routes to `to_host` (loopback for loopback);
    no packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((to_host, 9))
        return sock.getsockname()[0]


def pin_collectives(address: str) -> None:
    """Where `address` (the rendezvous's, or this engine's) is loopback (a one-node run), make gloo
    and NCCL in this process, and the processes it starts, listen on the loopback interface too:
    gloo would listen on the address the machine's hostname resolves to, NCCL's bootstrap on its
    first interface other than loopback, both reachable off the host. NCCL's data stays on NVLink
    or shared memory within a node. Across nodes nothing is changed; an interface the user named
    (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME) is kept."""
    if not is_loopback(address):
        return
    name = loopback_interface()
    for env in COLLECTIVE_INTERFACE_ENVS:
        if name and not os.environ.get(env):
            os.environ[env] = name


def is_loopback(host: str) -> bool:
    """Whether `host` (an address, IPv4-mapped IPv6 too, or a name) is this machine's loopback."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError:
            return False
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def loopback_interface() -> str | None:
    """The name of this machine's loopback interface (Linux: lo), None if it has none."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == LOOPBACK for a in addresses):
            return name
    return None


def engine_host() -> str:
    """The address an engine started in this process binds: its node's (HOST_ENV=node) or loopback."""
    return node_address() if os.environ.get(HOST_ENV) == "node" else LOOPBACK


def api_key() -> str | None:
    """The run's API key from API_KEY_ENV (None when unset or empty)."""
    return os.environ.get(API_KEY_ENV) or None


def auth_headers(key: str | None = None) -> dict[str, str]:
    """`Authorization: Bearer KEY` for `key` (default: the run's, `api_key()`); {} without one."""
    key = key or api_key()
    return {"Authorization": f"Bearer {key}"} if key else {}


def new_api_key() -> str:
    """A fresh API key for one run: 32 random bytes, URL-safe base64 (43 characters)."""
    return secrets.token_urlsafe(32)


def network_env(num_nodes: int) -> dict[str, str]:
    """The environment every engine and trainer rank of a run gets: {} on one node; across nodes,
    bind the node's address."""
    return {HOST_ENV: "node"} if num_nodes > 1 else {}
