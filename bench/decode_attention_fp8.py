"""Decode attention over an fp8 KV cache (`kv_cache_dtype=fp8_e4m3`): the engine's kernel at its
own launch settings (`launch_settings`) and at its best of a sweep, against the same kernel on a
bf16 cache and a variant whose V is stored page-transposed; microseconds a call, one JSON line per
(batch, context), on the GPU.

- `engine_bf16`: the engine's kernel on the cache in bf16, its defaults (the time a token costs
  in bf16);
- `engine_fp8_default`: the engine's kernel on the fp8 cache at the settings it chooses for
  one-byte caches (on sm90: 5 stages, 128-token tiles up to four programs an SM, 64 beyond);
- `engine_fp8`: the best of 24 settings (tile 32-128 tokens, 4-8 stages, 1-2 shares);
- `vpages`: K as the engine reads it; V from a copy stored page-transposed ([blocks, KV heads, D,
  page]: the tokens of a page contiguous, so the sum of P·V runs along contiguous bytes, as
  8-bit tensor-core operands want: no `ldmatrix.trans` for 8-bit elements), loaded as a [pages,
  D, page] tile and reshaped to V^T [D, tokens]; its best setting.

Every call reads another layer's cache (`LAYERS` copies in one CUDA graph), as a decode step does;
each setting's output is checked against `engine_fp8_default`'s (one further off than 2e-2 is
listed under `wrong`). Measured (docs/benchmarks.md, Decisions; 1xH200, 2026-11-29): the
page-transposed V lost everywhere (1.35-1.57 TB/s against 1.50-2.04); the bf16 settings (64-token
tiles, 4 stages) were 2-28% slower than the one-byte settings the engine now takes.

    source .whl/install.sh && python3 bench/decode_attention_fp8.py [--batches 32,64,128,256] [--contexts 300,520,1024]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton
import triton.language as tl
from decode_attention import LAYERS, best_of, caches, record, time_layers

from rlx.engine.triton_decode import attend_tile, paged_decode


@triton.jit
def _vpages_kernel(
    Q, K, VT, Out, BT, CL, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_kb, stride_kh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, PAGES: tl.constexpr,
):  # fmt: skip
    """One program a (row, KV head), a tile of PAGES whole pages at a time; K [blocks, heads, page,
    D] as the engine stores it, VT [blocks, heads, D, page]."""
    BLOCK_N: tl.constexpr = PAGES * PAGE
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    context_len = tl.load(CL + row)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    heads = kv_head * GROUP + g
    q_mask = (g < GROUP)[:, None]
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
    q = q.to(tl.float16)
    pages = tl.arange(0, PAGES)
    slots = tl.arange(0, PAGE)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for start in range(0, context_len, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < context_len
        page = tl.load(BT + row * stride_bt + n // PAGE, mask=valid, other=0).to(tl.int64)
        k_at = page * stride_kb + kv_head * stride_kh + (n % PAGE) * D
        k = tl.load(K + k_at[:, None] + d[None, :], mask=valid[:, None], other=0.0).to(tl.float16)
        first = start + pages * PAGE
        tile_pages = tl.load(BT + row * stride_bt + first // PAGE, mask=first < context_len, other=0).to(
            tl.int64
        )
        v_at = (tile_pages * stride_kb + kv_head * stride_kh)[:, None, None] + (d * PAGE)[None, :, None]
        v_ok = (first[:, None, None] + slots[None, None, :]) < context_len
        vt3 = tl.load(VT + v_at + slots[None, None, :], mask=v_ok, other=0.0)  # [PAGES, D, PAGE]
        vt = tl.reshape(tl.permute(vt3, (1, 0, 2)), (D, BLOCK_N)).to(tl.float16)  # V^T [D, tokens]
        m_i, l_i, acc = attend_tile(q, k, tl.trans(vt), valid[None, :], m_i, l_i, acc, scale, False)
    tl.store(
        Out + row * stride_ot + heads[:, None] * stride_oh + d[None, :],
        (acc / l_i[:, None]).to(Out.dtype.element_ty),
        mask=q_mask,
    )


def vpages_decode(q, k_cache, vt_cache, block_tables, lens, scale, pages=4, num_warps=4, num_stages=3):
    """q [rows, heads, D]; k_cache [blocks, kv_heads, page, D]; vt_cache [blocks, kv_heads, D, page]."""
    rows, heads, dim = q.shape
    _, kv_heads, page, _ = k_cache.shape
    out = torch.empty_like(q)
    group = heads // kv_heads
    _vpages_kernel[(rows, kv_heads)](
        q, k_cache, vt_cache, out, block_tables, lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1),
        GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=dim, PAGE=page, PAGES=pages,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


def compare(batch: int, context: int, heads=16, kv_heads=8, head_dim=128, page=16) -> dict:
    kv16, tables, lens = caches(batch, context, 0.0, kv_heads, head_dim, page, LAYERS, torch.bfloat16, "cuda")
    kv8 = [tuple(c.to(torch.float8_e4m3fn) for c in layer) for layer in kv16]
    vt8 = [layer[1].transpose(-1, -2).contiguous() for layer in kv8]
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    scale = head_dim**-0.5
    seconds = lambda call: time_layers(call, LAYERS)  # noqa: E731
    result = {"batch": batch, "context": context, "tokens": int(lens.sum())}
    result["engine_bf16_us"] = round(
        seconds(lambda i: paged_decode(q, *kv16[i], tables, lens, scale)) * 1e6, 2
    )
    result["engine_fp8_default_us"] = round(
        seconds(lambda i: paged_decode(q, *kv8[i], tables, lens, scale)) * 1e6, 2
    )
    reference = paged_decode(q, *kv8[0], tables, lens, scale).float()
    wrong = result["wrong"] = []
    contenders = {
        "engine_fp8": (
            [dict(block_n=n, num_stages=s, num_splits=k) for n, s, k in itertools.product((32, 64, 128), (4, 5, 6, 8), (1, 2))],
            lambda st: lambda i: paged_decode(q, *kv8[i], tables, lens, scale, **st),
        ),
        "vpages": (
            [dict(pages=p, num_warps=w, num_stages=s) for p, w, s in itertools.product((2, 4, 8), (4, 8), (2, 3, 4))],
            lambda st: lambda i: vpages_decode(q, kv8[i][0], vt8[i], tables, lens, scale, **st),
        ),
    }  # fmt: skip
    fp8_bytes = 2 * result["tokens"] * kv_heads * head_dim  # K and V, one byte an element

    def tb_s(num_bytes: int, us: float) -> float:
        return round(num_bytes / us / 1e6, 3)

    for name, (settings, call_for) in contenders.items():
        best = best_of(settings, call_for, reference, seconds, wrong)
        record(result, name, best, fp8_bytes)  # its TB/s and setting
        if best is not None:
            result[f"{name}_us"] = round(best[0] * 1e6, 2)
    result["engine_fp8_default_TB_s"] = tb_s(fp8_bytes, result["engine_fp8_default_us"])
    result["engine_bf16_TB_s"] = tb_s(2 * fp8_bytes, result["engine_bf16_us"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="32,64,128,256")
    parser.add_argument("--contexts", default="300,520,1024")
    args = parser.parse_args()
    start = time.perf_counter()
    name = torch.cuda.get_device_name()
    for batch, context in itertools.product(
        (int(b) for b in args.batches.split(",")), (int(c) for c in args.contexts.split(","))
    ):
        print(json.dumps({"device": name, **compare(batch, context)}), flush=True)
    print(json.dumps({"bench": "decode_attention_fp8", "device": name, "date": time.strftime("%Y-%m-%d"),
                      "wall_s": round(time.perf_counter() - start, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
