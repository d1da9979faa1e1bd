"""rlx's own engine as `rollout=local` runs it: `rlx.engine.Engine` with the constructor the
server's command line, its in-process start and tests call (`LocalEngine(model_path, seed=...,
**engine_args)`, SGLang's server-argument names).

It is always served by `rlx.engine.serve`, which speaks SGLang's native HTTP API, so the client,
the router and the weight-sync code are the same for it as for real SGLang engines. On a GPU it
runs there (paged KV cache, continuous batching, decode CUDA graphs); on CPU the same code path
runs in fp32. Sampling and stopping follow SGLang (see `rlx.engine.sequence`).
"""

from __future__ import annotations

from typing import Any

from rlx.engine.config import EngineArgs
from rlx.engine.engine import Engine


class LocalEngine(Engine):
    """The engine built from SGLang-style keyword arguments (`rollout.engine_args`)."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "auto",
        seed: int = 0,
        max_batch_size: int = 256,
        num_threads: int = 1,
        **engine_args: Any,
    ):
        engine_args.setdefault("max_running_requests", max_batch_size)
        args = EngineArgs.from_kwargs(
            model_path, dtype=dtype, random_seed=seed, num_threads=num_threads, **engine_args
        )
        super().__init__(args)
        self.dtype = dtype
        self.seed = seed
        self.max_batch_size = args.max_running_requests
