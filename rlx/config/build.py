"""`build`: a component from its config node, by the node's `_target_` (no heavy imports)."""

from __future__ import annotations

import importlib
from typing import Any


def build(node: Any, *args: Any, **kwargs: Any) -> Any:
    """Construct `node._target_` with the node's dataclass as first argument, then `args`, `kwargs`.

    `node` is a typed config node (e.g. `cfg.algo`) or the dataclass itself (`to_object(cfg).algo`).
    """
    if not hasattr(type(node), "__dataclass_fields__"):  # a DictConfig: only then is omegaconf needed
        from omegaconf import OmegaConf

        node = OmegaConf.to_object(node)
    return locate(node._target_)(node, *args, **kwargs)


def locate(path: str) -> Any:
    """The object a dotted path names (`package.module.Name`); ImportError naming the path if none."""
    module_path, _, name = path.rpartition(".")
    if not module_path:
        raise ImportError(f"{path!r} is not a dotted path (package.module.Name)")
    try:
        return getattr(importlib.import_module(module_path), name)
    except AttributeError:
        raise ImportError(f"module {module_path!r} has no attribute {name!r}") from None


def load_function(key: str, path: str, fix: str) -> Any:
    """The callable `path` names, for config key `key` (reward.fn, say); a ConfigError naming
    the key, the path and the problem, followed by `fix`, when it does not import or is no function."""
    from hydra._internal.utils import _locate  # hydra's get_method, minus its error logging

    from rlx.errors import ConfigError

    try:
        fn = _locate(path)
    except Exception as e:  # any import failure is the same user error
        raise ConfigError(f"{key}={path!r} cannot be imported: {e}\nfix: {fix}") from e
    if not callable(fn):
        raise ConfigError(f"{key}={path!r} is a {type(fn).__name__}, not a function\nfix: {fix}")
    return fn


def verdict(fn: Any, arg: Any, what: str, error: type[Exception], fix: str) -> bool:
    """A user's predicate `fn(arg)` (a row filter, a group filter) as a bool; `error` naming `what`
    where it raises or answers anything but True or False, its message ended by `fix`."""
    try:
        answer = fn(arg)
    except Exception as e:  # a user's function can raise anything
        raise error(f"{what} raised {type(e).__name__}: {e}{fix}") from e
    if answer not in (True, False):
        raise error(f"{what} returned {type(answer).__name__} {answer!r:.80}, not True or False{fix}")
    return bool(answer)
