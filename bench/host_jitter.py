"""How steady this machine is for host-bound work: one JSON line, milliseconds (min, median, p90, max).

    python bench/host_jitter.py

A short RL step (a small model's rollout, hundreds of tiny kernels) is bound by its host
threads, which sleep and wake between requests and steps. Before reading a spread of step times
as rlx's, check the machine's own:
- `cpu_busy`: a fixed Python loop (about 5 ms), back to back;
- `cpu_after_sleep`: the same loop, each right after a 20 ms sleep (a thread that waited);
- with CUDA, `graph_after_<gap>_s_idle`: one CUDA graph of 200 bf16 GEMMs replayed after an idle
  gap (the GPU's clocks), and `small_launches`: 300 one-element kernels launched eagerly.

1xH200 (2026-11-30, docs/benchmarks.md): busy 4.6-6.7 ms, after a sleep up to 10.3 (p90 8.8-9.6),
the graph within 3% whatever the gap, 300 launches 2.2 ms median and 14-18 ms at worst: there a
spread of step times is the host's CPU waking, not the GPU.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

ROUNDS = 60


def spread(seconds: list[float]) -> dict[str, float]:
    xs = sorted(seconds)
    return {
        "min_ms": round(xs[0] * 1e3, 2),
        "med_ms": round(statistics.median(xs) * 1e3, 2),
        "p90_ms": round(xs[int(0.9 * len(xs))] * 1e3, 2),
        "max_ms": round(xs[-1] * 1e3, 2),
    }


def timed(work, rounds: int, before=None) -> dict[str, float]:
    seconds = []
    for _ in range(rounds):
        if before is not None:
            before()
        start = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - start)
    return spread(seconds)


def main() -> None:
    loop = lambda: sum(range(400_000))  # noqa: E731
    out = {
        "cpu_busy": timed(loop, ROUNDS),
        "cpu_after_sleep": timed(loop, ROUNDS, before=lambda: time.sleep(0.02)),
    }
    if torch.cuda.is_available():
        a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(3):  # warm-up on a side stream, as graph capture requires
                a @ a
            with torch.cuda.graph(graph):
                for _ in range(200):
                    a @ a
        torch.cuda.synchronize()

        def replay() -> None:
            graph.replay()
            torch.cuda.synchronize()

        for gap in (0.0, 0.02, 0.2):
            out[f"graph_after_{gap}_s_idle"] = timed(replay, 30, before=lambda gap=gap: time.sleep(gap))
        x = torch.zeros(1, device="cuda")

        def launches() -> None:
            for _ in range(300):
                x.add_(1)
            torch.cuda.synchronize()

        out["small_launches"] = timed(launches, 30)
        out["gpu"] = torch.cuda.get_device_name()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
