"""Composing rlx configs with Hydra (the driver's side; trainer ranks never import this).

    cfg = compose(["algo=grpo", "rollout.n_samples_per_prompt=4"])   # composed and validated
    rc = to_object(cfg)                                             # RlxConfig of dataclasses

Programs launched with `@hydra.main` get the same tree from Hydra and call `validate` themselves.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from pathlib import Path

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.errors import HydraException, MissingConfigException
from hydra.initialize import get_gh_backup, restore_gh_from_backup
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlx.config import store  # noqa: F401  (registers the schemas and resolvers)
from rlx.config.from_checkpoint import apply_checkpoint
from rlx.config.keys import CONF_DIR, explain_override_error
from rlx.config.schema import RlxConfig
from rlx.config.validate import validate
from rlx.errors import ConfigError

__all__ = ["CONF_DIR", "compose", "to_object", "validate"]


def compose(
    overrides: Sequence[str] = (),
    config_dir: str | Path = CONF_DIR,
    config_name: str = "config",
    *,
    validated: bool = True,
) -> DictConfig:
    """Compose `conf/config.yaml` (or `config_dir/config_name.yaml`: a run directory's recorded
    config, say) with Hydra command-line style overrides, take the model from `model.hf_checkpoint`
    (`rlx.config.from_checkpoint`), then `validate` it.

    Works inside a running Hydra app too: the global Hydra state is saved and restored.
    Raises ConfigError (naming the key and the fix) for unknown keys, wrong types, unknown
    options and broken rules.
    """
    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        raise ConfigError(_explain(e, overrides, _search_dirs(config_dir, overrides))) from e
    finally:
        restore_gh_from_backup(backup)
    apply_checkpoint(cfg, overrides)
    if validated:  # else the caller validates (`launch.py`'s pre-flight: the job does, once)
        validate(cfg)
    return cfg


def to_object(cfg: DictConfig) -> RlxConfig:
    """The composed tree as an `RlxConfig` of dataclasses, interpolations resolved."""
    obj = OmegaConf.to_object(cfg)
    if not isinstance(obj, RlxConfig):
        raise TypeError(f"expected a config composed on the RlxConfig schema, got {type(obj).__name__}")
    return obj


def _explain(e: BaseException, overrides: Sequence[str], search_dirs: list[Path]) -> str:
    """Our message for a missing key, a wrong type, an unknown option or an override that does not
    parse; else Hydra's own chain. `search_dirs`: where option files are looked for (to name the
    file a bad key came from)."""
    chain = _error_chain(e)
    if message := explain_override_error(chain, e.__cause__, search_dirs):
        return message
    if "override_grammar" in chain and (bad := _unreadable(overrides)):
        return explain_override_error(f"Error parsing override '{bad[0]}'\n{bad[1]}", None) or chain
    if isinstance(e, MissingConfigException) and e.options:
        missing = Path(e.missing_cfg_file or "")
        group, name = missing.parent.as_posix(), missing.name
        options = [o for o in e.options if not o.startswith("base_")]  # the schemas, not options
        close = difflib.get_close_matches(name, options, n=1, cutoff=0.0)
        if group and close:
            return (
                f"{group}={name}: no option {name} in {group} (conf/{group}/*.yaml and any hydra.searchpath); "
                f"did you mean {group}={close[0]}? the options: {', '.join(options)}"
            )
    return chain


def _unreadable(overrides: Sequence[str]) -> tuple[str, str] | None:
    """The first override Hydra's grammar cannot read, and why (Hydra's message names no override)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for override in overrides:
        try:
            parser.parse_override(override)
        except HydraException as e:
            return override, str(e).splitlines()[0]
    return None


def _search_dirs(config_dir: str | Path, overrides: Sequence[str]) -> list[Path]:
    """The directories option files come from: `config_dir`, then `hydra.searchpath`'s file:// entries."""
    dirs = [Path(config_dir)]
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") == "hydra.searchpath":
            for entry in value.strip("[]").split(","):
                entry = entry.strip().strip("'\"")
                if entry.startswith("file://"):
                    dirs.append(Path(entry.removeprefix("file://")))
    return dirs


def _error_chain(e: BaseException) -> str:
    """Hydra wraps the useful OmegaConf message (which names the key) as the cause; show both."""
    parts = []
    while e is not None:
        text = str(e).split("Config search path:")[0].strip()  # Hydra's search path says nothing here
        if text and text not in parts:
            parts.append(text)
        e = e.__cause__
    return "\n".join(parts)
