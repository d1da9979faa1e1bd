"""Names SGLang's native HTTP API fixes, and the JSON encoding, that both of its sides in rlx use:
the client side (`rlx.rollout`: the pool, the health monitor) and rlx's own server
(`rlx.engine.serve`, and the engine behind it).

One definition, here, rather than one per side: the sides cannot drift apart, and importing it
costs nothing (no torch, no rlx module), so the driver and sglang-router's process never load the
engine to learn a name of the protocol.
"""

from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # rlx's install has it (pyproject); a bare environment (the GPU image) may not
    orjson = None

# what `/release_memory_occupation` and `/resume_memory_occupation` take in `{"tags": [...]}`
# (sglang 0.5.4's GPU_MEMORY_TYPE_WEIGHTS and GPU_MEMORY_TYPE_KV_CACHE); all of them when absent
MEMORY_TAGS = ("weights", "kv_cache")


def dumps(value: Any) -> bytes:
    """JSON bytes, with orjson where installed (as SGLang's server encodes): /generate's bodies and
    answers on both sides, and the rollout dumps (`rlx.tracking`). A rollout batch's answers
    (every token with its logprob) are about a megabyte; on the engine's HTTP thread the standard
    library took 26 ms of the GIL that its scheduler thread's steps wait for, orjson 4.5 (64
    answers of 8 samples, about 60 tokens each; CPU). Keys that are not strings are written as
    strings, as `json.dumps` does; orjson writes a NaN or infinity as null (so do SGLang's
    answers), the standard library as NaN."""
    if orjson is not None:
        return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
    return json.dumps(value).encode()


def loads(data: bytes | str) -> Any:
    """`dumps`' inverse (ValueError on what is not JSON)."""
    return orjson.loads(data) if orjson is not None else json.loads(data)
