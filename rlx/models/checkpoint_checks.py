"""Checks of an HF checkpoint directory, run in the driver before any process starts (reading
config.json and the safetensors headers only, never the tensors):

    check_checkpoint(family, hf_dir, tokenizer)   # what the driver calls once per run

- config.json against `model.*` (the family's `check_hf_config`: wrong family, other shape);
- the weight files: present, every shard the index names exists, no file truncated or corrupt;
- every tensor the model has is in the checkpoint with the shape the config gives (computed from
  transformers' own model class on the meta device; parameters transformers 5 fuses on load,
  such as MoE experts, are not compared);
- the tokenizer's ids fit the model's vocabulary.

Each failure raises CheckpointError naming the file (and tensor) and the fix.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from rlx.cache import cache_dir, write_quietly
from rlx.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_LISTED = 5  # problems of one kind named in a message; the rest are counted
_REDOWNLOAD = "download or copy the checkpoint again"


def check_checkpoint(family: Any, hf_dir: str | Path, tokenizer: Any = None) -> None:
    """All the checks above for `family` (a `ModelFamily`) and the HF directory `hf_dir`;
    the tokenizer's only when `tokenizer` is given."""
    hf_dir = Path(hf_dir)
    family.check_hf_config(hf_dir)
    shapes = safetensors_shapes(hf_dir)
    check_tensor_shapes(family, hf_dir, shapes)
    if tokenizer is not None:
        check_tokenizer(tokenizer, family.cfg.vocab_size, hf_dir)


def safetensors_shapes(hf_dir: Path) -> dict[str, tuple[tuple[int, ...], Path]]:
    """Tensor name -> (shape, file) over the checkpoint's safetensors files, from their headers;
    CheckpointError for a missing, truncated or corrupt file."""
    index = hf_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index ({e}); {_REDOWNLOAD}") from e
        files = sorted(set(weight_map.values()))
        absent = [f for f in files if not (hf_dir / f).is_file()]
        if absent:
            raise CheckpointError(
                f"{index} names {len(files)} weight files, but {len(absent)} are missing from {hf_dir}: "
                f"{', '.join(absent[:MAX_LISTED])}; {_REDOWNLOAD}"
            )
    elif (hf_dir / SINGLE).is_file():
        files = [SINGLE]
    else:
        others = sorted(p.name for p in hf_dir.glob("*.bin")) or ["none"]
        raise CheckpointError(
            f"{hf_dir} has neither {SINGLE} nor {INDEX} (other weight files: {', '.join(others[:3])}); rlx reads "
            "safetensors only: save the model with transformers' save_pretrained (safetensors is its default)"
        )
    shapes = {}
    for name in files:
        for tensor, shape in read_header(hf_dir / name).items():
            shapes[tensor] = (shape, hf_dir / name)
    return shapes


def read_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape from a safetensors file's header, after checking that the file holds
    every byte the header describes (a cut-short download fails here, not on a trainer rank)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < length <= size - 8:
            raise CheckpointError(
                f"{path}: not a safetensors file, or truncated inside its header ({size} bytes); {_REDOWNLOAD}"
            )
        try:
            header = json.loads(f.read(length))
            tensors = {k: v for k, v in header.items() if k != "__metadata__"}
            end = max((v["data_offsets"][1] for v in tensors.values()), default=0)
            shapes = {k: tuple(v["shape"]) for k, v in tensors.items()}
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header ({e}); {_REDOWNLOAD}") from e
    if size < 8 + length + end:
        raise CheckpointError(
            f"{path}: truncated: the file has {size} bytes but its header describes {8 + length + end} "
            f"(the download or copy was cut short); {_REDOWNLOAD}"
        )
    return shapes


def expected_shapes(family: Any) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for `family`'s config, from transformers' model class built on the
    meta device (no memory). Fused parameters that transformers converts on load (names without
    a .weight/.bias suffix, e.g. MoE experts' gate_up_proj) and a tied lm_head are left out.
    Remembered in rlx's cache by the config's class, kwargs and transformers' version
    (`hf_config_key`): importing the config and model classes costs the driver seconds of CPU,
    the shapes are the same every time."""
    key = family.hf_config_key()
    saved = cache_dir() / "hf_shapes" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"
    try:
        shapes = {name: tuple(shape) for name, shape in json.loads(saved.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        shapes = _model_shapes(family.hf_config())
        write_quietly(saved, json.dumps(shapes))
    if family.cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    return shapes


def _model_shapes(hf_config: Any) -> dict[str, tuple[int, ...]]:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items() if k.endswith((".weight", ".bias"))}


def check_tensor_shapes(family: Any, hf_dir: Path, found: dict[str, tuple[tuple[int, ...], Path]]) -> None:
    """CheckpointError listing tensors the model needs that `found` lacks or holds in another shape."""
    expected = expected_shapes(family)
    missing = [name for name in expected if name not in found]
    wrong = [
        f"{name} is {list(found[name][0])} in {found[name][1].name}, the config gives {list(shape)}"
        for name, shape in expected.items()
        if name in found and found[name][0] != shape
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors missing: {', '.join(missing[:MAX_LISTED])}")
    if wrong:
        problems.append(f"{len(wrong)} tensors of another shape: " + "; ".join(wrong[:MAX_LISTED]))
    if problems:
        raise CheckpointError(
            f"{hf_dir}: the weights do not fit its config.json (model._target_={family.cfg._target_}):\n  "
            + "\n  ".join(problems)
            + f"\nthe weights belong to another model or were saved incompletely; {_REDOWNLOAD}, "
            "or point model.hf_checkpoint at the directory these weights came with"
        )


def check_tokenizer(tokenizer: Any, vocab_size: int, hf_dir: str | Path) -> None:
    """CheckpointError when the tokenizer can produce ids with no row in the embedding
    (`vocab_size`, model.vocab_size = config.json's vocab_size): the largest id, and EOS/PAD."""
    num_tokens = len(tokenizer)
    special = {name: getattr(tokenizer, f"{name}_token_id", None) for name in ("eos", "pad", "bos")}
    too_large = {name: i for name, i in special.items() if i is not None and i >= vocab_size}
    if num_tokens <= vocab_size and not too_large:
        return
    ids = ", ".join(f"{name}_token_id={i}" for name, i in too_large.items())
    raise CheckpointError(
        f"the tokenizer in {hf_dir} has {num_tokens} tokens{' (' + ids + ')' if ids else ''} but "
        f"model.vocab_size={vocab_size} (config.json's vocab_size): ids >= {vocab_size} have no embedding; "
        "use the tokenizer saved with these weights, or a checkpoint whose vocab_size covers the tokenizer"
    )
