"""How a run reaches Ray: a Ray of its own on loopback (one node), or a Ray cluster that requires
Ray's token (several nodes).

One node (no `cluster.ray_address`): the run starts a Ray of its own whose node address is
127.0.0.1, so that every Ray process (GCS, raylet, object manager, workers, agents) listens on
loopback only (`rlx.compat.ray_internals.loopback_node`), without a dashboard or an autoscaler
(`ray_internals.lean_head`: seconds off every start) and without token authentication (nothing
off the host reaches it).

Several nodes (`cluster.num_nodes > 1`): Ray's servers must listen where the other nodes reach them,
and Ray 2.60 binds every interface then, so the cluster must require Ray's token
(RAY_AUTH_MODE=token, the token in RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token, on
every node and in the driver). A SLURM job's nodes do so with a token of the job's own
(`rlx.launcher.nodes`); a cluster the user started (`cluster.ray_address`) must have been started
so, and the driver given its token. A driver that joins a multi-node cluster without a token
either is refused by the cluster (`RayAuthError`) or, accepted, has found a cluster without
authentication: the run is refused unless `cluster.ray_allow_unauthenticated=true`.
"""

from __future__ import annotations

import logging
import os
import secrets
from typing import Any

import ray

from rlx.compat import ray_internals
from rlx.errors import ConfigError, UserError

AUTH_MODE_ENV = "RAY_AUTH_MODE"
AUTH_TOKEN_ENV = "RAY_AUTH_TOKEN"
HOW_TO_AUTHENTICATE = (
    f"start every node's Ray with {AUTH_MODE_ENV}=token and the cluster's token in {AUTH_TOKEN_ENV} "
    f"(or a file named by RAY_AUTH_TOKEN_PATH, or ~/.ray/auth_token), and run the driver with the same "
    f"two variables"
)


class RayAuthError(UserError):
    """A Ray cluster refused this driver's token (or its lack of one)."""


def local_init_args(num_cpus: int | None = None, **extra: Any) -> dict[str, Any]:
    """`ray.init` arguments of a one-node run's own Ray: a new Ray ("local": never one another
    process started on this machine), no dashboard. Start it with `start_local`."""
    return {"address": "local", "num_cpus": num_cpus, "include_dashboard": False,
            "logging_level": logging.WARNING} | extra  # fmt: skip


PRELOAD = "rlx.trainer.preload"  # a trainer rank's imports, without touching CUDA


def start_local(*, preload: bool = False, **init_args: Any) -> None:
    """Start a Ray of this process's own, every process of it on loopback (`local_init_args`).
    `preload`: its worker processes import a trainer rank's modules (torch, Megatron and rlx's
    trainer: `rlx.trainer.preload`) before they take work, so that later runs' ranks start without
    them; for a Ray that serves several runs (a test session's), since Ray starts a worker per CPU
    at once."""
    if preload:
        init_args["_system_config"] = init_args.get("_system_config", {}) | {
            "preload_python_modules": [PRELOAD]
        }
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # nothing off the host reaches a loopback Ray; RAY_AUTH_MODE=token, if set, is kept
    os.environ.setdefault(AUTH_MODE_ENV, "disabled")
    with ray_internals.loopback_node(), ray_internals.lean_head():
        ray.init(**local_init_args(**init_args))


def connect(cluster) -> bool:
    """Connect this process to the run's Ray: `cluster.ray_address`, or a Ray of its own
    (`start_local`). Whether it did: a Ray the caller already started is used as it is (and left up
    after the run). Raises ConfigError when a multi-node run would use a Ray without token
    authentication (see the module doc), RayAuthError when the cluster refuses the driver."""
    if ray.is_initialized():
        check_authenticated(cluster)
        return False
    if not cluster.ray_address:
        start_local(num_cpus=cluster.ray_num_cpus)
        return True
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    join(cluster.ray_address)
    try:
        check_authenticated(cluster)
    except ConfigError:
        ray.shutdown()
        raise
    return True


def join(address: str) -> None:
    """`ray.init(address=...)` with this process's token, if any (RAY_AUTH_MODE, RAY_AUTH_TOKEN, as
    the environment has them now); a refusal for the token raises RayAuthError at once."""
    from ray.exceptions import AuthenticationError

    ray_internals.reload_auth()
    try:
        ray.init(address=address, logging_level=logging.WARNING)
    except (ConnectionError, AuthenticationError) as e:
        refusal = _token_refusal(e)
        if refusal is None:
            raise
        mode = os.environ.get(AUTH_MODE_ENV, "unset")
        token = "set" if os.environ.get(AUTH_TOKEN_ENV) else "unset"
        raise RayAuthError(
            f"the Ray cluster at cluster.ray_address={address} refused this driver ({AUTH_MODE_ENV}={mode}, "
            f"{AUTH_TOKEN_ENV} {token}): it requires the cluster's token; {HOW_TO_AUTHENTICATE}. Ray said: {refusal}"
        ) from None


def _token_refusal(error: BaseException | None) -> str | None:
    """Ray's words if `error` is, or was raised from, a refusal for the token: ray.init raises
    ConnectionError from a RuntimeError that holds the last AuthenticationError as text."""
    from ray.exceptions import AuthenticationError

    while error is not None:
        if isinstance(error, AuthenticationError):
            return str(error)[:300]
        if "AuthenticationError:" in str(error):
            return str(error).rsplit("AuthenticationError:", 1)[1].strip().splitlines()[0][:300]
        error = error.__cause__ or error.__context__
    return None


def check_authenticated(cluster) -> None:
    """Raise ConfigError if a multi-node run's Ray runs without token authentication (this driver,
    connected, sends no token) and `cluster.ray_allow_unauthenticated` is false."""
    if cluster.num_nodes <= 1 or cluster.ray_allow_unauthenticated or ray_internals.token_auth_enabled():
        return
    raise ConfigError(
        f"cluster.num_nodes={cluster.num_nodes}: the Ray cluster at cluster.ray_address={cluster.ray_address} "
        "runs without token authentication (this driver joined it without a token): anyone who reaches "
        f"one of its nodes can run code on it. To require a token, {HOW_TO_AUTHENTICATE} (SLURM jobs of "
        "several nodes, hydra/launcher=slurm, do this themselves); or set "
        "cluster.ray_allow_unauthenticated=true (unsafe: only on a network nobody else reaches)"
    )


def new_token() -> str:
    """A fresh token for a Ray cluster of this run's own (256 bits, as `ray get-auth-token --generate`)."""
    return secrets.token_hex(32)


def token_env(token: str) -> dict[str, str]:
    """The environment of a Ray process (`ray start`, a driver) that requires and sends `token`."""
    return {AUTH_MODE_ENV: "token", AUTH_TOKEN_ENV: token}


def use_token(token: str) -> None:
    """This process, and what it starts from now on, sends `token` to Ray (and requires it)."""
    os.environ.update(token_env(token))
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)  # RAY_AUTH_TOKEN wins anyway; no stale path
    ray_internals.reload_auth()
