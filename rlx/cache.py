"""Where rlx writes what it makes once and reuses: `RLX_CACHE`, default ~/.cache/rlx.

Tiny random checkpoints (`rlx.models.tiny`), the converted example model
(`python -m rlx.tools.example_model`) and generated task files (`python -m rlx.data.arithmetic`)
live here. Config files name paths inside it as `${rlx.cache:SUBPATH}` (a resolver registered by
`rlx.config.store`). Torch-free: config composition imports it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

# what rlx's tools write into the cache, by the first part of the path: the command that writes it
WRITERS = {
    "SmolLM2-135M-Instruct": "python -m rlx.tools.example_model",
    "arithmetic": "python -m rlx.data.arithmetic",
}


def cache_dir() -> Path:
    """`RLX_CACHE`, default ~/.cache/rlx."""
    return Path(os.environ.get("RLX_CACHE", Path.home() / ".cache" / "rlx"))


def writer_hint(path: Path) -> str:
    """'; python -m ... writes it' when `path` (missing) is one a tool of rlx writes into the cache, else ''."""
    try:
        first = Path(path).relative_to(cache_dir()).parts[0]
    except (ValueError, IndexError):
        return ""
    return f"; `{WRITERS[first]}` writes it" if first in WRITERS else ""


def write_quietly(path: Path, text: str) -> None:
    """`text` into `path` whole (a reader never sees half of it; runs may write it together); a
    cache that cannot be written is skipped: the next reader only computes it again."""
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging.write_text(text)
        staging.replace(path)
    except OSError:
        with contextlib.suppress(OSError):
            staging.unlink()
