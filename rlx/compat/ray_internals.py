"""The private corners of Ray 2.60 that rlx reaches into: a node bound to loopback, a one-node head
without the processes it does not use, and token authentication switched on after `import ray`.

Loopback. Ray's servers (GCS, raylet, object manager, every worker's gRPC server, the runtime-env
and dashboard agents, metrics export) listen on 127.0.0.1 when the node's address is 127.0.0.1, and
on every interface otherwise; Ray 2.60 has no setting to bind one other address. `ray.init` and
`ray start` turn a node address of 127.0.0.1 into the machine's routable address
(`services.resolve_ip_for_localhost`), except where `ray_constants.ENABLE_RAY_CLUSTER` is off:
Ray's own single-machine mode (the default on macOS and Windows, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`
elsewhere, read when `ray` is imported). `loopback_node` turns it off while a local Ray starts: the
node then gets 127.0.0.1, which it hands to every process it starts (their node address comes
from it, not from this switch), so the switch is put back at once.

Lean head. A head started by `ray.init` also starts the autoscaler's monitor and the API server
(the dashboard's head process; with `include_dashboard=False` it loads only the usage-stats
module, and usage stats are off), and `ray.init` polls until the API server has registered:
about 2.3 s of CPU and 2.5-3 s of the start's 5-8 s on the 2-core CPU machine, and 0.7 s of
`ray.shutdown`. A run's own one-node Ray autoscales nothing and serves no dashboard, so
`lean_head` leaves both out while it starts (Ray's own `RayParams.no_monitor`, and the state a
head is in when its API server fails to start, which Ray carries on from); the GCS, the raylet
and its agents start as before. A Ray started by `ray start` (a multi-node job's) keeps them.

Authentication. Ray reads `RAY_AUTH_MODE` and its token (`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH`,
`~/.ray/auth_token`) into a process-wide config when `ray` is imported; `reload_auth` reads them
again, as Ray's own `_enable_token_auth` does, after a launcher has set them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def loopback_node() -> Iterator[None]:
    """A local Ray started in this block takes 127.0.0.1 as its node address (see the module doc)."""
    from ray._private import ray_constants

    before = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = before


@contextlib.contextmanager
def lean_head() -> Iterator[None]:
    """A head started in this block by `ray.init` starts no autoscaler monitor and no API server
    (see the module doc)."""
    from ray._private.node import Node

    before = Node.start_monitor, Node.start_api_server
    Node.start_monitor = lambda self: None
    Node.start_api_server = lambda self, **kwargs: None
    try:
        yield
    finally:
        Node.start_monitor, Node.start_api_server = before


def reload_auth() -> None:
    """Read RAY_AUTH_MODE and the token from the environment again (this process only)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def token_auth_enabled() -> bool:
    """Whether this process runs Ray with token authentication (RAY_AUTH_MODE=token)."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return is_token_auth_enabled()
