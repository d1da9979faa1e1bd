"""`model.hf_checkpoint=DIR` alone is enough: the family and shape come from DIR's config.json.

    apply_checkpoint(cfg, overrides)   # on the composed DictConfig, before `validate`

A checkpoint given to a tiny model option (the default `tiny_qwen3`, or any `tiny_*`, which exist
to be written at random) replaces that option's family and shape with the checkpoint's
(`rlx.models.hf_checkpoint.model_keys`), so `python launch.py model.hf_checkpoint=/path/to/Qwen3-8B`
needs nothing restated. A shape key also given on the command line must agree with config.json.
A named full-size option (`model=qwen3_8b`, `tiny: false`) states the shape itself: the checkpoint
is then checked against it before any process starts (`rlx.models.checkpoint_checks`), not read.
A Hugging Face repo id resolves to its snapshot directory in the local cache
(`rlx.models.hf_checkpoint.resolve`), which is what the run records and every process loads.
"""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig

from rlx.errors import ConfigError


def apply_checkpoint(cfg: DictConfig, overrides: Sequence[str] = ()) -> None:
    """Resolve `cfg.model.hf_checkpoint` and, for a tiny option, take the model from it (in place).
    `overrides`: the command line's, to tell shape keys the user set from the option's."""
    spec = cfg.model.hf_checkpoint
    if spec is None:
        return
    from rlx.models.family import same_value
    from rlx.models.hf_checkpoint import model_keys, resolve

    path = resolve(spec)
    cfg.model.hf_checkpoint = str(path)
    if not cfg.model.tiny:
        return
    keys = model_keys(path)
    given = _model_keys_given(overrides)
    conflicts = [
        f"model.{key}={cfg.model[key]} but {path / 'config.json'} gives {value}"
        for key, value in keys.items()
        if key in given and not same_value(cfg.model[key], value)
    ]
    if conflicts:
        raise ConfigError(
            "the checkpoint's config.json fixes the model's shape:\n  "
            + "\n  ".join(conflicts)
            + "\ndrop these overrides (model.hf_checkpoint alone reads every shape key), or point "
            "model.hf_checkpoint at a checkpoint of the shape you want"
        )
    changed = {key: value for key, value in keys.items() if not same_value(cfg.model[key], value)}
    if changed:  # else the option already is this checkpoint (a tiny model's own cached directory)
        cfg.model.update(changed)
        cfg.model.tiny = False
        cfg.model.name = path.name


def _model_keys_given(overrides: Sequence[str]) -> set[str]:
    """The `model.KEY` names set by command-line overrides (`model.num_layers=4` -> num_layers)."""
    keys = set()
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.startswith("model."):
            keys.add(key.split(".")[1])
    return keys
