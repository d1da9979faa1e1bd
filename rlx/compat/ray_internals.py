"""The two private corners of Ray 2.60 that rlx reaches into: a node bound to loopback, and token
authentication switched on after `import ray`.

Loopback. Ray's servers (GCS, raylet, object manager, every worker's gRPC server, the runtime-env
and dashboard agents, metrics export) listen on 127.0.0.1 when the node's address is 127.0.0.1, and
on every interface otherwise; Ray 2.60 has no setting to bind one other address. `ray.init` and
`ray start` turn a node address of 127.0.0.1 into the machine's routable address
(`services.resolve_ip_for_localhost`), except where `ray_constants.ENABLE_RAY_CLUSTER` is off:
Ray's own single-machine mode (the default on macOS and Windows, `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`
elsewhere, read when `ray` is imported). `loopback_node` turns it off while a local Ray starts: the
node then gets 127.0.0.1, which it hands to every process it starts (their node address comes
from it, not from this switch), so the switch is put back at once.

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


def reload_auth() -> None:
    """Read RAY_AUTH_MODE and the token from the environment again (this process only)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def token_auth_enabled() -> bool:
    """Whether this process runs Ray with token authentication (RAY_AUTH_MODE=token)."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return is_token_auth_enabled()
