"""How fast this GPU reads its memory, streamed and in pages, against the nominal bandwidth that the
decode roofline counts (`rollout_throughput.BANDWIDTHS`); prints one JSON line.

- `stream_TB_s`: a Triton kernel summing a 4 GB bf16 tensor in order (the best of a few tile
  shapes), the read ceiling a memory-bound kernel can aim at; `torch_sum_TB_s` and `copy_TB_s`
  (read + write counted) beside it.
- `paged_random_TB_s`: the same sum over the decode attention's access pattern: every (sequence,
  KV heads) program walks its sequence's 16-token pages in its block table, K and V from their
  two halves of the cache (4 KB a head a page, a program's heads together), the pages scattered
  over the cache; `paged_in_order_TB_s` with each sequence's pages one after another. Each the
  best of a few settings (heads a program, pages a step, warps, stages): what paging alone
  costs, without attention's arithmetic, for the bytes the paged kernel
  (`rlx.engine.triton_decode`) reads.

    source .whl/install.sh && python3 bench/hbm_read.py [--rows 256] [--context 512]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton
import triton.language as tl
from engine_step_profile import time_cuda
from rollout_throughput import bandwidth

GB4 = 2 << 30  # bf16 elements: 4 GB
STREAM_TILES = (
    (4096, 16, 8, 3),
    (8192, 8, 8, 3),
    (2048, 32, 4, 4),
    (1024, 64, 4, 4),
)  # elements, loads, warps, stages


@triton.jit
def _stream_sum(X, Out, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * BLOCK * ITERS
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(ITERS):
        acc += tl.load(X + base + i * BLOCK + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(Out + tl.program_id(0), tl.sum(acc, 0))


@triton.jit
def _paged_sum(
    K, V, BT, Out, pages, stride_bt, stride_kb,
    HEADS: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, UNROLL: tl.constexpr,
):  # fmt: skip
    """Program (row, head group): the sum of its HEADS heads' K and V over the row's `pages`
    pages (a multiple of UNROLL), UNROLL pages a step."""
    row = tl.program_id(0)
    group = tl.program_id(1)
    cols = tl.arange(0, HEADS * PAGE * D)  # the group's heads of one page: contiguous
    acc = tl.zeros([UNROLL, HEADS * PAGE * D], tl.float32)
    for p in range(0, pages, UNROLL):
        page = tl.load(BT + row * stride_bt + p + tl.arange(0, UNROLL)).to(tl.int64)
        at = (page * stride_kb + group * HEADS * PAGE * D)[:, None] + cols[None, :]
        acc += tl.load(K + at).to(tl.float32) + tl.load(V + at).to(tl.float32)
    tl.store(Out + row * tl.num_programs(1) + group, tl.sum(tl.sum(acc, 1), 0))


def stream(x: torch.Tensor) -> float:
    best = 0.0
    for block, iters, warps, stages in STREAM_TILES:
        programs = x.numel() // (block * iters)
        out = torch.empty(programs, device="cuda")
        seconds = time_cuda(
            lambda b=block, i=iters, w=warps, s=stages, o=out, p=programs: _stream_sum[(p,)](
                x, o, BLOCK=b, ITERS=i, num_warps=w, num_stages=s
            ),
            iters=10,
        )
        best = max(best, x.numel() * 2 / seconds / 1e12)
    return best


def streamed() -> dict:
    x = torch.randn(GB4, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    return {
        "stream_TB_s": round(stream(x), 3),
        "torch_sum_TB_s": round(x.numel() * 2 / time_cuda(lambda: x.sum(), iters=10) / 1e12, 3),
        "copy_TB_s": round(2 * x.numel() * 2 / time_cuda(lambda: y.copy_(x), iters=10) / 1e12, 3),
    }


def paged(rows: int, context: int, kv_heads: int = 8, head_dim: int = 128, page: int = 16) -> dict:
    """The paged read's best of a few launch settings (heads a program, pages a step, warps,
    stages), its pages in random order and in order; each call reads a layer's worth of distinct
    pages (28 copies' worth, so that the L2 holds none of a call's)."""
    pages = context // page
    blocks = rows * pages * 28
    cache = torch.randn(2, blocks, kv_heads, page, head_dim, device="cuda", dtype=torch.bfloat16)
    orders = {
        "random": torch.randperm(blocks, device="cuda", dtype=torch.int32).view(28, rows, pages),
        "in_order": torch.arange(blocks, device="cuda", dtype=torch.int32).view(28, rows, pages),
    }
    kv_bytes = rows * pages * 2 * kv_heads * page * head_dim * 2
    result = {}
    for name, order in orders.items():
        best = (0.0, None)
        for heads, unroll, warps, stages in itertools.product((4, 8), (1, 2, 4), (4, 8), (2, 3, 4)):
            out = torch.empty(rows, kv_heads // heads, device="cuda")
            turn = iter(range(1 << 30))

            def call(heads=heads, unroll=unroll, warps=warps, stages=stages, out=out, order=order, turn=turn):
                table = order[next(turn) % 28]
                _paged_sum[(rows, kv_heads // heads)](
                    cache[0], cache[1], table, out, pages, table.stride(0), cache.stride(1),
                    HEADS=heads, PAGE=page, D=head_dim, UNROLL=unroll, num_warps=warps, num_stages=stages,
                )  # fmt: skip

            rate = kv_bytes / time_cuda(call, iters=28, graph=True) / 1e12
            if rate > best[0]:
                best = (rate, dict(heads=heads, pages_a_step=unroll, warps=warps, stages=stages))
        result[f"paged_{name}_TB_s"], result[f"paged_{name}_setting"] = round(best[0], 3), best[1]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--context", type=int, default=512, help="tokens of KV a row (a multiple of 16)")
    args = parser.parse_args()
    name = torch.cuda.get_device_name()
    result = {"device": name, "nominal_TB_s": bandwidth(name) / 1e12, **streamed()}
    result.update(rows=args.rows, context=args.context)
    result.update(paged(args.rows, args.context))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
