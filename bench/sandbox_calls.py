"""Tool calls through `rlx.agent.Sandbox` on the CPU: the tool_calc calculator, one call at a time
and 200 at once (the calls of a tool_calc rollout step: about 150 of 256 samples call it once
the model has learned to), with `max_concurrency` 4 (the default on 2 cores) and 16; prints
one JSON line.

    PYTHONPATH=. python bench/sandbox_calls.py
"""

from __future__ import annotations

import asyncio
import json
import time

from examples.tool_calc.generate import CALCULATOR
from rlx.agent import Sandbox

SEQUENTIAL, CONCURRENT = 50, 200


async def measure(max_concurrency: int) -> dict:
    sandbox = Sandbox(time_limit_s=5.0, memory_limit_mb=256, max_concurrency=max_concurrency)
    try:
        await asyncio.gather(*(sandbox.run([CALCULATOR], "1 2 + 3 0") for _ in range(max_concurrency)))
        start = time.perf_counter()
        for _ in range(SEQUENTIAL):
            result = await sandbox.run([CALCULATOR], "1 2 + 3 0")
            assert result.ok and result.output.strip() == "42", result
        sequential_ms = (time.perf_counter() - start) / SEQUENTIAL * 1e3
        start = time.perf_counter()
        results = await asyncio.gather(*(sandbox.run([CALCULATOR], "1 2 + 3 0") for _ in range(CONCURRENT)))
        assert all(r.ok for r in results)
        concurrent_s = time.perf_counter() - start
    finally:
        await sandbox.aclose()
    return {
        "max_concurrency": max_concurrency,
        "network": sandbox.network,
        "sequential_ms_per_call": round(sequential_ms, 2),
        f"{CONCURRENT}_concurrent_s": round(concurrent_s, 3),
    }


def main() -> None:
    print(json.dumps({"bench": "sandbox_calls", "runs": [asyncio.run(measure(n)) for n in (4, 16)]}))


if __name__ == "__main__":
    main()
