"""A checkpoint by path: where `model.hf_checkpoint` points, and the model its config.json describes.

    path = resolve("Qwen/Qwen3-0.6B")    # a local HF directory, or a repo id through huggingface_hub's cache
    keys = model_keys(path)              # {"_target_": "rlx.models.qwen3.Qwen3", "num_layers": 28, ...}

The family comes from config.json's `architectures` and `model_type` (one of `supported()`); every
other key of `ModelConfig` that fixes the model (`SHAPE_KEYS`) from the family's own table of where
that key lives in config.json (`ModelFamily.hf_fields`, the table `check_hf_config` checks a named
model option against), with transformers' defaults for keys the file leaves out and the family's
`pinned` values for what its architecture fixes. Keys that choose how to train rather than what
the model is (kernels, Megatron overrides, the MoE load-balancing loss and dispatcher) are not
read. Everything here runs in the driver at compose time: config.json is read, no tensor is.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from rlx.cache import writer_hint
from rlx.errors import ConfigError
from rlx.models.config import ModelConfig
from rlx.models.hf_config import read_config

# ModelConfig keys that say how to train the model or where it lives, not what it is.
NOT_SHAPE = (
    "_target_",
    "name",
    "hf_checkpoint",
    "tiny",
    "init_seed",
    "kernels",
    "megatron_overrides",
    "moe_aux_loss_coeff",
    "moe_token_dispatcher_type",
    "moe_router_bias_update_rate",
)
SHAPE_KEYS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name not in NOT_SHAPE)
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # "org/name", as the Hub writes them
# What a Hub download fetches: configs, safetensors weights, tokenizer files, chat templates.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]
_GGUF_FIX = (
    "rlx reads HF directories (config.json, *.safetensors, tokenizer files); convert the GGUF "
    "with `python -m rlx.tools.example_model --gguf {path} --out DIR` (needs `pip install 'rlx[example]'`) "
    "and set model.hf_checkpoint=DIR"
)


def resolve(spec: str) -> Path:
    """The local directory `model.hf_checkpoint=spec` names: a directory (relative to where the
    command was run), or a Hugging Face repo id ("org/name") from huggingface_hub's cache,
    downloaded into it first when the Hub can be reached. ConfigError for anything else."""
    path = local_path(spec)
    if errors := local_errors(spec, path):
        if not path.exists() and REPO_ID.match(spec):
            return _from_hub(spec, path)
        raise ConfigError(errors[0])
    return path


def local_path(spec: str) -> Path:
    """`spec` as an absolute path, relative paths taken from the directory the command ran in."""
    from hydra.utils import to_absolute_path  # the original cwd under @hydra.main, else os.getcwd()

    return Path(to_absolute_path(os.path.expanduser(str(spec))))


def local_errors(spec: str, path: Path) -> list[str]:
    """Why `path` (from `model.hf_checkpoint=spec`) is not an HF checkpoint directory; [] if it is one."""
    key = f"model.hf_checkpoint={spec!r}"
    if path.suffix == ".gguf" and path.is_file():
        return [f"{key} is a GGUF file; {_GGUF_FIX.format(path=path)}"]
    if not path.is_dir():
        what = "is a file, not a directory" if path.exists() else "is not a directory"
        hub = " nor a Hugging Face repo id (org/name)" if not REPO_ID.match(spec) else ""
        return [f"{key} {what} ({path}){hub}; point it at an HF model directory{writer_hint(path)}"]
    if not (path / "config.json").is_file():
        ggufs = sorted(path.glob("*.gguf"))
        if ggufs:
            return [f"{key} has no config.json but a GGUF file; {_GGUF_FIX.format(path=ggufs[0])}"]
        return [
            f"{key} has no config.json ({path}); point it at an HF model directory "
            "(config.json, *.safetensors, tokenizer files)"
        ]
    return []


def _from_hub(repo_id: str, local: Path) -> Path:
    """The snapshot directory of `repo_id` in huggingface_hub's cache (offline once cached)."""
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not cached (or cached incompletely): try the Hub below
        pass
    where = (
        f"model.hf_checkpoint={repo_id!r} is neither a local directory ({local}) nor a Hugging Face repo "
        f"in the cache ({constants.HF_HUB_CACHE})"
    )
    fix = (
        f"download it where the Hub is reachable (`hf download {repo_id}`, with HF_HUB_CACHE or HF_HOME "
        "pointing at the cache this machine reads) or point model.hf_checkpoint at a local HF directory"
    )
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{where}, and HF_HUB_OFFLINE is set; {fix}")
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_PATTERNS))
    except Exception as e:  # unreachable, unknown repo, gated: all the same for the user
        raise ConfigError(
            f"{where}, and the Hub did not serve it ({type(e).__name__}: {str(e).splitlines()[0]}); {fix}"
        ) from e


def supported() -> str:
    """'Qwen3ForCausalLM (model_type qwen3), ...' for messages."""
    from rlx.models.family import families

    return ", ".join(f"{cls.hf_architecture} (model_type {cls.hf_model_type})" for cls in families())


def family_of(hf: dict[str, Any], where: Path) -> type:
    """The family class for config.json `hf` (read from `where`), by model_type and architectures."""
    from rlx.models.family import families

    model_type, architectures = hf.get("model_type"), hf.get("architectures") or []
    for cls in families():
        if cls.hf_model_type == model_type and (not architectures or cls.hf_architecture in architectures):
            return cls
    named = f"architectures={architectures} " if architectures else ""
    raise ConfigError(
        f"{where / 'config.json'} has {named}model_type={model_type}, which rlx cannot train; it supports "
        f"{supported()}; use a checkpoint of one of these"
    )


def model_keys(path: Path) -> dict[str, Any]:
    """`_target_` and every `SHAPE_KEYS` value of the model in the checkpoint directory `path`."""
    hf = read_config(path)
    cls = family_of(hf, path)
    from rlx.models.hf_config import MISSING, rope_type

    kind = rope_type(hf)
    if kind not in cls.rope_types:
        raise ConfigError(
            f"{path / 'config.json'} has RoPE scaling of type {kind}; rlx implements "
            f"{', '.join(cls.rope_types)} for {cls.hf_architecture}"
        )
    cfg = ModelConfig(_target_=f"{cls.__module__}.{cls.__name__}", tiny=False, **cls.pinned)
    for _ in range(2):  # the second pass reads the keys that only exist once scaling is known
        missing, values = [], {}
        for key, field in cls(cfg).hf_fields().items():
            value = field.read(hf)
            if value is MISSING:
                missing.append(f"model.{key} ({' or '.join(field.paths)})")
            else:
                values[key] = value
        cfg = dataclasses.replace(cfg, **values)
    if missing:
        raise ConfigError(
            f"{path / 'config.json'} lacks keys rlx reads the model's shape from: {', '.join(missing)}; "
            "download or copy the checkpoint again"
        )
    return {"_target_": cfg._target_} | {key: getattr(cfg, key) for key in SHAPE_KEYS}
