"""Where rlx writes what it makes once and reuses: `RLX_CACHE`, default ~/.cache/rlx.

Tiny random checkpoints (`rlx.models.tiny`), the converted example model
(`python -m rlx.tools.example_model`) and generated task files (`python -m rlx.data.arithmetic`)
live here. Config files name paths inside it as `${rlx.cache:SUBPATH}` (a resolver registered by
`rlx.config.store`). Torch-free: config composition imports it.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`RLX_CACHE`, default ~/.cache/rlx."""
    return Path(os.environ.get("RLX_CACHE", Path.home() / ".cache" / "rlx"))
