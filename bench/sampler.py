"""The engine's fused sampler (`rlx.engine.triton_sample.fused_sample`) alone, in CUDA graphs as
the decode graphs run it: microseconds a call by rows, over Qwen3's 151,936-word vocabulary in
bf16 (logits randn * 4, `--scale` to change it; temperature 1, no greedy rows). Successive calls read different logits
buffers, 256 MB of them in all, so that the L2 does not hold a call's logits from the last.
Prints one JSON line. Run it with `PYTHONPATH=<an older rlx tree>` to measure that tree's.

    source .whl/install.sh && python3 bench/sampler.py [--rows 32,64,128,256] [--splits 4,16,75] \
        [--truncate 0.9,-1]   # every row with top_p 0.9 (top_k -1: off), sampled as the engine does
        [--scale 1]           # logits randn * 1: flatter rows (a random model's), top-p's boundary deep
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from engine_step_profile import time_cuda

VOCAB = 151936  # Qwen3's


def logits_copies(
    rows: int, vocab: int, device: torch.device, g: torch.Generator, scale: float = 4.0
) -> list[torch.Tensor]:
    """bf16 logits (randn * scale), enough copies (256 MB, at least 2) that the L2 holds none from
    the call before when the calls take them in turn."""
    copies = max(2, math.ceil((256 << 20) / (rows * vocab * 2)))
    return [(torch.randn(rows, vocab, device=device, generator=g) * scale).bfloat16() for _ in range(copies)]


def sampler_us(rows: int, vocab: int, device: torch.device, splits: int | None = None) -> dict:
    from rlx.engine.triton_sample import fused_sample

    g = torch.Generator(device=device).manual_seed(rows)
    logits = logits_copies(rows, vocab, device, g)
    copies = len(logits)
    inv_t = torch.ones(rows, device=device)
    greedy = torch.zeros(rows, dtype=torch.int32, device=device)
    seed = torch.randint(0, 1 << 62, (rows,), device=device, generator=g)
    step = torch.zeros(rows, dtype=torch.int64, device=device)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, device=device)
    turn = iter(range(1 << 30))

    def call():
        fused_sample(logits[next(turn) % copies], inv_t, greedy, seed, step, tokens, logprobs, splits=splits)

    seconds = time_cuda(call, iters=4 * copies, graph=True)
    return {"us": round(seconds * 1e6, 2), "logits_tb_s": round(rows * vocab * 2 / seconds / 1e12, 2)}


def truncated_us(
    rows: int,
    vocab: int,
    device: torch.device,
    top_p: float,
    top_k: int,
    scale: float = 4.0,
    profile: bool = False,
) -> dict:
    """The decode graph's sampling plus what rows with top-p / top-k pay after it: every row
    truncating, drawn again by `Sampler.resample_truncated` (eager, as after a decode graph)."""
    from rlx.engine.sampler import Sampler, SamplingBatch, search_sums
    from rlx.engine.triton_sample import fused_sample

    g = torch.Generator(device=device).manual_seed(rows)
    logits = logits_copies(rows, vocab, device, g, scale)
    copies = len(logits)
    ones = torch.ones(rows, device=device)
    ints = torch.zeros(rows, dtype=torch.int64, device=device)
    batch = SamplingBatch(
        temperature_N=ones, inv_temperature_N=ones, greedy_N=ints.bool(),
        top_k_N=torch.full((rows,), top_k if top_k > 0 else vocab, device=device),
        top_p_N=torch.full((rows,), top_p, device=device), min_p_N=torch.zeros(rows, device=device),
        seed_N=torch.randint(0, 1 << 62, (rows,), device=device, generator=g), step_N=ints,
        seeded_rows=torch.arange(rows, device=device), all_greedy=False, truncate=True,
        truncate_rows=list(range(rows)), truncate_sums=search_sums([top_k if top_k > 0 else vocab], [top_p], vocab),
    )  # fmt: skip
    sampler = Sampler(0, device)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    logprobs = torch.empty(rows, device=device)
    turn = iter(range(1 << 30))

    def call():
        x = logits[next(turn) % copies]
        fused_sample(x, ones, ints.int(), batch.seed_N, ints, tokens, logprobs)
        sampler.resample_truncated(x, batch, tokens, logprobs)

    seconds = time_cuda(call, iters=2 * copies)
    result = {"us": round(seconds * 1e6, 2), "top_p": top_p, "top_k": top_k, "scale": scale}
    if profile:
        result["kernels_us"] = kernel_us(call, calls=2 * copies)
    return result


def kernel_us(call, calls: int) -> dict:
    """GPU microseconds a call by kernel (torch.profiler), and the GPU's busy time a call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    per = {e.key: e.device_time_total / calls for e in prof.key_averages() if e.device_time_total > 0}
    out = {k[:40]: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])}
    out["total"] = round(sum(per.values()), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default="32,64,128,256")
    parser.add_argument("--vocab", type=int, default=VOCAB)
    parser.add_argument("--splits", help="also time these share counts a row (comma-separated)")
    parser.add_argument(
        "--truncate", help="also time every row with top_p,top_k (e.g. 0.9,-1) sampled as the engine does"
    )
    parser.add_argument("--scale", type=float, default=4.0, help="--truncate's logits: randn * this")
    parser.add_argument("--profile", action="store_true", help="--truncate's GPU time by kernel too")
    args = parser.parse_args()
    device = torch.device("cuda")
    result = {"gpu": torch.cuda.get_device_name(device), "vocab": args.vocab}
    for rows in map(int, args.rows.split(",")):
        result[f"rows_{rows}"] = sampler_us(rows, args.vocab, device)
        for splits in map(int, filter(None, (args.splits or "").split(","))):
            result[f"rows_{rows}"][f"splits_{splits}"] = sampler_us(rows, args.vocab, device, splits)["us"]
        if args.truncate:
            top_p, top_k = args.truncate.split(",")
            result[f"rows_{rows}"]["truncated"] = truncated_us(
                rows, args.vocab, device, float(top_p), int(top_k), args.scale, args.profile
            )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
