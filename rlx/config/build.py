"""`build`: a component from its config node, by the node's `_target_` (no heavy imports)."""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import types
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
    """The object a dotted path names (`package.module.Name`, `module.Class.method`); one ImportError
    line naming what is missing when there is none: the module not found, the module's own import
    failure, or the name a module lacks (with the closest name it has)."""
    if "/" in path or path.endswith(".py") or ".py:" in path:  # verl's custom_reward_function.path habit
        file, _, name = path.partition(".py")
        directory, _, stem = file.rpartition("/")
        raise ImportError(
            f"{path!r} is a file path; a dotted path is wanted: put the file's directory on the import "
            f"path and name module.function, e.g. PYTHONPATH={directory or '.'} ... "
            f"={stem}.{name.lstrip(':') or 'FUNCTION'}"
        )
    parts = path.split(".")
    if len(parts) < 2 or not all(parts):
        raise ImportError(f"{path!r} is not a dotted path (package.module.Name)")
    obj = _import(parts[0])
    for i, part in enumerate(parts[1:], start=1):
        prefix = ".".join(parts[:i])
        package = isinstance(obj, types.ModuleType) and hasattr(obj, "__path__")
        # a package's submodule before a name it exports (rlx.config.build the module, not the
        # function rlx.config exports), but a path's last part is the name first
        if package and (i < len(parts) - 1 or not hasattr(obj, part)):
            if (module := _import(f"{prefix}.{part}", missing_ok=True)) is not None:
                obj = module
                continue
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        names = [n for n in dir(obj) if not n.startswith("_")]
        what = "name"
        if package:
            names += [m.name for m in pkgutil.iter_modules(obj.__path__)]
            what = "name or submodule"
        kind = "module" if isinstance(obj, types.ModuleType) else type(obj).__name__
        close = difflib.get_close_matches(part, names, n=1, cutoff=0.6)
        hint = f"; did you mean {prefix}.{close[0]}?" if close else ""
        raise ImportError(f"{kind} {prefix!r} has no {what} {part!r}{hint}")
    return obj


def _import(name: str, missing_ok: bool = False) -> Any:
    """Module `name`; None for a missing one when `missing_ok`; else one ImportError line saying why not."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name != name:  # the module is there but imports something that is not
            raise ModuleImportFailed(f"importing {name!r} failed: {e}") from None
        if missing_ok:
            return None
        raise ImportError(
            f"no module named {name!r} (is it installed, or is its directory on PYTHONPATH or the "
            "working directory?)"
        ) from None
    except Exception as e:  # the module's own code raised
        raise ModuleImportFailed(f"importing {name!r} failed: {type(e).__name__}: {e}") from None


class ModuleImportFailed(ImportError):
    """The module is there, but importing it raised: its own code or what it imports is at fault."""


def load_function(key: str, path: str, fix: str) -> Any:
    """The callable `path` names, for config key `key` (reward.fn, say); a ConfigError naming
    the key, the path and the problem, followed by `fix`, when it does not import or is no function."""
    from rlx.errors import ConfigError

    try:
        fn = locate(path)
    except ModuleImportFailed as e:  # the path is right: "give the dotted path" would mislead
        raise ConfigError(
            f"{key}={path!r} cannot be imported: {e}\nfix: the module was found; make its import work "
            "(install what it imports, or correct its code)"
        ) from e
    except ImportError as e:
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
