"""A checkpoint's tokenizer, the class `AutoTokenizer.from_pretrained` picks, without importing
transformers' auto classes once that choice is known.

    tokenizer = load_tokenizer(hf_dir)

AutoTokenizer picks the class from config.json, tokenizer_config.json and tokenizer.json, by
rules that change between transformers releases (v5: model types whose hub class is wrong, Llama
classes over a byte-level tokenizer.json, ...), so rlx does not restate them. Importing it loads
transformers' auto-model factory, and with it the generation and masking modules (scikit-learn
where installed, torch's dynamo): 6.4 s of a launch's preparation on a 1×H200 host (transformers
5.17), 0.5-0.9 s on CI's CPU. The first load asks AutoTokenizer and remembers its class in rlx's
cache (`tokenizer_classes/`), under a key of those three files' bytes and transformers' version;
a later load with the same key imports that class alone and calls its `from_pretrained`, which is
what AutoTokenizer ends with. A tokenizer of remote code (`auto_map`) always goes through
AutoTokenizer.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

from rlx.cache import cache_dir, write_quietly

DECIDING_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json")


def load_tokenizer(hf_dir: str | Path):
    """The tokenizer of the HF checkpoint directory `hf_dir`, as AutoTokenizer loads it."""
    hf_dir = Path(hf_dir)
    key = _key(hf_dir)
    remembered = _remembered(key) if key else None
    if remembered is not None:
        return remembered.from_pretrained(str(hf_dir))
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    if key:
        _remember(key, type(tokenizer))
    return tokenizer


def _key(hf_dir: Path) -> str | None:
    """A hash of what AutoTokenizer's choice depends on; None where it runs remote code (auto_map)
    or a file cannot be read."""
    import transformers

    digest = hashlib.sha256(transformers.__version__.encode())
    try:
        for name in DECIDING_FILES:
            path = hf_dir / name
            data = path.read_bytes() if path.is_file() else b""
            if name == "tokenizer_config.json" and data and "auto_map" in json.loads(data):
                return None
            digest.update(f"{name}:{len(data)}:".encode() + data)
    except (OSError, ValueError):
        return None
    return digest.hexdigest()


def _record(key: str) -> Path:
    return cache_dir() / "tokenizer_classes" / f"{key}.txt"


def _remembered(key: str) -> type | None:
    """The class remembered under `key` ("module:qualname"), None if none or it no longer imports."""
    try:
        module, _, name = _record(key).read_text().strip().partition(":")
        return getattr(importlib.import_module(module), name)
    except (OSError, ImportError, AttributeError, ValueError):
        return None


def _remember(key: str, cls: type) -> None:
    write_quietly(_record(key), f"{cls.__module__}:{cls.__qualname__}\n")
