"""rlx's one boundary module for SGLang's command line: the flags a server or sglang-router starts with.

Servers (SGLang's, or rlx's own, which takes the same flags) start as child processes; engine
args from the config (`rollout.engine_args`) become `--flags` unchanged, so rlx never mirrors
SGLang's option list, and `module="rlx.engine.serve"` starts rlx's engine through the identical
path. A child's API key (SGLang's and sglang-router's `--api-key`) travels in its environment,
never on its command line (`rlx.rollout.keyed_launch`). What the servers answer is SGLang's
HTTP API: `rlx.rollout.client` speaks it, `rlx.engine.serve.protocol` serves it for rlx's engine.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

from rlx.ports import API_KEY_ENV, free_port
from rlx.rollout.child_process import ChildProcess, ChildService


def cli_flags(args: dict[str, Any] | None) -> list[str]:
    """{"mem_fraction_static": 0.8, "enable_x": True, "urls": [a, b]} -> --mem-fraction-static 0.8 ...

    True is a bare flag, False and None are left out, a list is the flag followed by its items. A
    value that starts with "-" (an API key from `secrets.token_urlsafe`, a negative number) is joined
    to its flag, `--api-key=-x`: apart, argparse would read it as the next flag.
    """
    flags: list[str] = []
    for key, value in (args or {}).items():
        flag = "--" + str(key).replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            flags.append(flag)
        elif isinstance(value, list | tuple):
            flags += [flag, *map(str, value)]
        elif str(value).startswith("-"):
            flags.append(f"{flag}={value}")
        else:
            flags += [flag, str(value)]
    return flags


def module_cmd(module: str, flags: list[str], *, keyed: bool = False) -> list[str]:
    """`python -m module flags...`; `keyed`: through `rlx.rollout.keyed_launch`, which adds
    `--api-key` from the child's environment (`key_env`)."""
    return [sys.executable, "-m", *(["rlx.rollout.keyed_launch"] if keyed else []), module, *flags]


def key_env(api_key: str | None) -> dict[str, str]:
    """The environment that hands `api_key` to a `keyed` child ({} without a key)."""
    return {API_KEY_ENV: api_key} if api_key else {}


def launch_server_cmd(
    model_path: str,
    port: int,
    engine_args: dict[str, Any] | None,
    module: str = "sglang.launch_server",
    host: str = "127.0.0.1",
    *,
    keyed: bool = False,
) -> list[str]:
    """The command line that starts `module` (sglang.launch_server's flags) serving `model_path`;
    `keyed`: see `module_cmd`."""
    args = {"host": host, **(engine_args or {})}
    args.pop("model_path", None)
    args.pop("port", None)
    flags = ["--model-path", str(model_path), "--port", str(port), *cli_flags(args)]
    return module_cmd(module, flags, keyed=keyed)


class ServerProcess(ChildService):
    """An SGLang-API server child process (`sglang.launch_server` or `rlx.engine.serve`);
    with `api_key`, it requires `Authorization: Bearer api_key` on every route but /health."""

    def __init__(
        self,
        model_path: str,
        port: int | None = None,
        engine_args: dict[str, Any] | None = None,
        *,
        module: str = "sglang.launch_server",
        host: str = "127.0.0.1",
        startup_timeout_s: float = 600.0,
        env: dict[str, str] | None = None,
        api_key: str | None = None,
    ):
        self.host = host
        self._own_port = port is None  # picked here: picked again if taken before the server binds it
        self.port = port or free_port(host)
        self._cmd = functools.partial(
            launch_server_cmd,
            model_path,
            engine_args=engine_args,
            module=module,
            host=host,
            keyed=bool(api_key),
        )  # the command line for a port
        self._child_args = dict(
            name=module.replace(".", "-"),
            startup_timeout_s=startup_timeout_s,
            env={**(env or {}), **key_env(api_key)},
        )
        self._child = self._new_child()

    def _new_child(self) -> ChildProcess:
        return ChildProcess(self._cmd(port=self.port), self.url, **self._child_args)

    def _repick_ports(self) -> bool:
        if not self._own_port:
            return False
        self.port = free_port(self.host)
        self._child = self._new_child()
        return True

    @property
    def pid(self) -> int | None:
        return self._child.proc.pid if self._child.proc else None
