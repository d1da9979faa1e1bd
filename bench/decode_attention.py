"""Decode attention over the paged KV cache: the engine's kernel against a persistent one that
streams fixed-size chunks of every sequence; one JSON line per (batch, context), on the GPU.

The engine's kernel (`rlx.engine.triton_decode.paged_decode`) runs a program a (sequence, KV
head), or, from 15 such pairs an SM on sm90, a program a sequence and four KV heads (its sweep
here: `heads_per_program`): at RL's batches each program reads 150-500 KB, so its pipeline's fill and drain (about a
microsecond each; at 4 stages a program takes 128 registers a thread and 39 KB of shared memory,
so four share an SM, compiled for sm90 with the strides divisible by 16 as they are at run time)
are a large part of its life: 66% of the HBM bandwidth at batch 64 and context 300, 78% at 256
(1×H200, docs/benchmarks.md). Here:

- a step's table of units (`_unit_table_kernel`, once a step: every layer shares it): a unit is
  CHUNK tokens of one sequence (the last one shorter), numbered sequence by sequence; per unit
  its row and token range;
- the persistent kernel (`_persistent_decode_kernel`): `programs` programs (a few an SM), program
  p takes units p, p + programs, ... of every KV head, and walks all its units' tiles in ONE
  loop, so the software pipeline runs across unit boundaries and fills once a program; at a
  unit's last tile it writes the unit's normalised output and log-sum-exp (fp32) and starts over;
- a merge (`_merge_units_kernel`) a (sequence, query head) over its units, as flash-decoding's;
- and the engine kernel's loop a page at a time with each page's K and V fetched by TMA
  (`_tma_decode_kernel`: host-side descriptors over the caches, one bulk copy a tile).

Every call reads another layer's cache (`LAYERS` copies, cycled inside the CUDA graph), as a
decode step does, so that the L2 holds no layer's KV from the call before. Both kernels' launch
settings are swept, the engine's to 8 stages: compiled for sm90, its loop at 3-4 stages holds one
K and one V tile (the page-index load takes the other stages), so a tile's load never overlaps
the tile before's arithmetic within a program; at 5-6 it holds two, at 8 three. Correctness:
each setting's output against the engine kernel's defaults; one further off than 2e-2 is listed
under `wrong`, not timed. Measured (docs/benchmarks.md, Decisions): the engine's defaults within
1.7% of its best setting, the persistent kernel 9-28% slower, the TMA one 3-11% slower at batch
64 and within -1.4 to +3.7% at 256 (1×H200).

The kernel alone does not rank settings as a rollout does at many rows: at 256 rows this bench
puts one KV head a program with 64-token tiles above the engine's four heads with 16-token
tiles, and a rollout the other way round (the 1.7B: 67.2% of the roofline against 64.5%;
not the pages' order, not PDL: docs/benchmarks.md, Decisions). A setting found here is kept only
after `bench/rollout_throughput.py --engine-only` runs it against the current one.

    source .whl/install.sh && python3 bench/decode_attention.py [--batches 64,256] [--contexts 300,520] \
        [--spread 0.5] [--kernels engine,tma,persistent] [--pages 16,64] [--kernels engine --kv-dtype fp8_e4m3]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import triton
import triton.language as tl
from engine_step_profile import time_cuda

from rlx.engine.triton_decode import attend_tile, group_queries, store_output

LAYERS = 4  # distinct caches cycled by the timed calls


@triton.jit
def _unit_table_kernel(
    CL, Units, RowStart, ROWS, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_U: tl.constexpr
):
    """One program: Units[0] = the count of units; Units[1 + 3u : 4 + 3u] = (row, lo, hi) of unit u;
    RowStart[r] = the first unit of row r."""
    r = tl.arange(0, BLOCK_R)
    lens = tl.load(CL + r, mask=r < ROWS, other=0)
    chunks = (lens + CHUNK - 1) // CHUNK
    ends = tl.cumsum(chunks, 0)
    starts = ends - chunks
    tl.store(RowStart + r, starts, mask=r < ROWS)
    total = tl.sum(chunks, 0)
    tl.store(Units, total)
    for base in range(0, total, BLOCK_U):
        u = base + tl.arange(0, BLOCK_U)
        row = tl.sum((ends[None, :] <= u[:, None]).to(tl.int32), 1)  # first row ending past u
        hit = r[None, :] == row[:, None]
        start = tl.sum(tl.where(hit, starts[None, :], 0), 1)
        length = tl.sum(tl.where(hit, lens[None, :], 0), 1)
        lo = (u - start) * CHUNK
        hi = tl.minimum(lo + CHUNK, length)
        ok = u < total
        tl.store(Units + 1 + 3 * u, row, mask=ok)
        tl.store(Units + 2 + 3 * u, lo, mask=ok)
        tl.store(Units + 3 + 3 * u, hi, mask=ok)


@triton.jit
def _persistent_decode_kernel(
    Q, K, V, Part, Lse, BT, Units, scale,
    stride_qt, stride_qh, stride_bt, stride_kb, stride_kh,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Part [units x KV_HEADS, GROUP, D] and Lse [units x KV_HEADS, GROUP], fp32: (unit u, KV
    head h) at index u * KV_HEADS + h, which is also the order the programs take them in."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    TILES: tl.constexpr = CHUNK // BLOCK_N
    work = tl.load(Units) * KV_HEADS
    mine = tl.cdiv(tl.maximum(work - pid, 0), programs)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    q_mask = (g < GROUP)[:, None]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for t in range(0, mine * TILES):
        item = pid + (t // TILES) * programs
        tile = t % TILES
        unit = item // KV_HEADS
        kv_head = item % KV_HEADS
        row = tl.load(Units + 1 + 3 * unit)
        hi = tl.load(Units + 3 + 3 * unit)
        n = tl.load(Units + 2 + 3 * unit) + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = n < hi
        page = tl.load(BT + row * stride_bt + n // PAGE, mask=valid, other=0).to(tl.int64)
        offset = page * stride_kb + kv_head * stride_kh + (n % PAGE) * D
        k = tl.load(K + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(V + offset[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        heads = kv_head * GROUP + g
        q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)
        # finite from the first tile on: a unit's first tile holds a key
        m_i, l_i, acc = attend_tile(q, k, v, valid[None, :], m_i, l_i, acc, scale, IEEE)
        last = tile == TILES - 1
        at = item * GROUP + g
        tl.store(Part + at[:, None] * D + d[None, :], acc / l_i[:, None], mask=q_mask & last)
        tl.store(Lse + at, m_i + tl.log(l_i), mask=(g < GROUP) & last)
        m_i = tl.where(last, float("-inf"), m_i)
        l_i = tl.where(last, 0.0, l_i)
        acc = tl.where(last, 0.0, acc)


@triton.jit
def _merge_units_kernel(
    Part, Lse, Out, RowStart, CL, stride_ot, stride_oh,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Out[row, head] = the units' outputs weighted by softmax over their log-sum-exps."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    d = tl.arange(0, D)
    first = tl.load(RowStart + row)
    count = tl.cdiv(tl.load(CL + row), CHUNK)
    m = tl.full([1], float("-inf"), tl.float32)
    w_sum = tl.zeros([1], tl.float32)
    acc = tl.zeros([D], tl.float32)
    for c in range(0, count):
        at = ((first + c) * KV_HEADS + kv_head) * GROUP + head % GROUP
        lse = tl.load(Lse + at + tl.zeros([1], tl.int32))
        m_new = tl.maximum(m, lse)
        alpha = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)
        acc = acc * alpha + w * tl.load(Part + at * D + d)
        w_sum = w_sum * alpha + w
        m = m_new
    tl.store(Out + row * stride_ot + head * stride_oh + d, (acc / w_sum).to(Out.dtype.element_ty))


def unit_table(lens: torch.Tensor, chunk: int, max_context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Units, RowStart) for `lens` (int32 on the GPU); sized for contexts up to `max_context` so
    that a CUDA graph captured once holds any step's table."""
    rows = lens.shape[0]
    units = torch.empty(1 + 3 * rows * triton.cdiv(max_context, chunk), dtype=torch.int32, device=lens.device)
    row_start = torch.empty(rows, dtype=torch.int32, device=lens.device)
    _unit_table_kernel[(1,)](
        lens, units, row_start, rows, CHUNK=chunk, BLOCK_R=max(16, triton.next_power_of_2(rows)), BLOCK_U=128
    )
    return units, row_start


def persistent_decode(
    q, k_cache, v_cache, block_tables, lens, scale, units, row_start, max_context: int,
    chunk: int = 256, block_n: int = 64, programs: int | None = None, num_warps: int = 4, num_stages: int = 4,
) -> torch.Tensor:  # fmt: skip
    rows, num_heads, head_dim = q.shape
    _, kv_heads, page, _ = k_cache.shape
    group = num_heads // kv_heads
    most = rows * triton.cdiv(max_context, chunk) * kv_heads
    part = torch.empty(most, group, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(most, group, dtype=torch.float32, device=q.device)
    out = torch.empty_like(q)
    if programs is None:
        programs = 2 * torch.cuda.get_device_properties(q.device).multi_processor_count
    _persistent_decode_kernel[(programs,)](
        q, k_cache, v_cache, part, lse, block_tables, units, scale,
        q.stride(0), q.stride(1), block_tables.stride(0), k_cache.stride(0), k_cache.stride(1),
        KV_HEADS=kv_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=head_dim,
        PAGE=page, BLOCK_N=block_n, CHUNK=chunk, IEEE=q.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _merge_units_kernel[(rows, num_heads)](
        part, lse, out, row_start, lens, out.stride(0), out.stride(1),
        KV_HEADS=kv_heads, GROUP=group, D=head_dim, CHUNK=chunk,
    )  # fmt: skip
    return out


@triton.jit
def _tma_decode_kernel(
    Q, Kd, Vd, Out, Part, Lse, BT, CL, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    KV_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    PAGE: tl.constexpr, IEEE: tl.constexpr, NUM_SPLITS: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """The engine kernel's loop a page at a time, each page's K and V fetched by the tensor
    memory accelerator (TMA: one bulk copy a tile, issued by one thread) through descriptors over
    the caches viewed as [blocks x KV heads x page, D]; the rows of a page past the context are
    stale cache contents, masked in the scores and zeroed in V (0 x NaN is NaN)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(CL + row)
    pages = tl.cdiv(context_len, PAGE)
    if NUM_SPLITS == 1:
        lo, hi = 0, pages
    else:
        share = tl.cdiv(pages, NUM_SPLITS)
        lo = split * share
        hi = tl.minimum(lo + share, pages)
    t = tl.arange(0, PAGE)
    q, heads = group_queries(Q, row, kv_head, stride_qt, stride_qh, GROUP, BLOCK_G, D)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for p in tl.range(lo, hi, num_stages=STAGES):
        page = tl.load(BT + row * stride_bt + p)
        at = (page * KV_HEADS + kv_head) * PAGE
        valid = p * PAGE + t < context_len
        k = Kd.load([at, 0])
        v = tl.where(valid[:, None], Vd.load([at, 0]), 0.0)
        m_i, l_i, acc = attend_tile(q, k, v, valid[None, :], m_i, l_i, acc, scale, IEEE)
    store_output(
        Out, Part, Lse, row, split, heads, m_i, l_i, acc, stride_ot, stride_oh, GROUP, BLOCK_G, D, NUM_SPLITS
    )


def tma_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor):
    """Host-side TMA descriptors of the caches as [blocks x KV heads x page, D], a page a tile."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    page, head_dim = k_cache.shape[2], k_cache.shape[3]
    return tuple(
        TensorDescriptor.from_tensor(c.view(-1, head_dim), block_shape=[page, head_dim])
        for c in (k_cache, v_cache)
    )


def tma_decode(
    q, k_cache, v_cache, descriptors, block_tables, lens, scale,
    num_warps: int = 4, num_stages: int = 4, num_splits: int = 1,
) -> torch.Tensor:  # fmt: skip
    from rlx.engine.triton_decode import _merge_splits_kernel

    rows, num_heads, head_dim = q.shape
    _, kv_heads, page, _ = k_cache.shape
    group = num_heads // kv_heads
    out = torch.empty_like(q)
    part = lse = out
    if num_splits > 1:
        part = torch.empty(rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(rows, num_heads, num_splits, dtype=torch.float32, device=q.device)
    _tma_decode_kernel[(rows, kv_heads, num_splits)](
        q, *descriptors, out, part, lse, block_tables, lens, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        KV_HEADS=kv_heads, GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=head_dim,
        PAGE=page, IEEE=q.dtype == torch.float32, NUM_SPLITS=num_splits, STAGES=num_stages,
        num_warps=num_warps,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(rows, num_heads)](
            part, lse, out, out.stride(0), out.stride(1), D=head_dim, NUM_SPLITS=num_splits
        )
    return out


def caches(
    batch: int,
    context: int,
    spread: float,
    kv_heads: int,
    head_dim: int,
    page: int,
    layers: int,
    dtype,
    device,
):
    """`layers` KV caches of `batch` sequences in shuffled pages, one table; the sequences hold
    `context` tokens each, or with `spread` s, uniformly 1 - s to 1 + s times as many (a rollout's
    rows after different prompts and outputs)."""
    g = torch.Generator(device=device).manual_seed(0)
    scale = 1 + spread * (2 * torch.rand(batch, device=device, generator=g) - 1)
    lens = (context * scale).round().clamp(min=1).to(torch.int32)
    per_seq = -(-int(lens.max()) // page)
    blocks = batch * per_seq + 1
    kv = [
        tuple(
            torch.randn(blocks, kv_heads, page, head_dim, device=device, generator=g).to(dtype) for _ in "kv"
        )
        for _ in range(layers)
    ]
    tables = torch.randperm(blocks - 1, device=device, generator=g)[: batch * per_seq] + 1
    return kv, tables.view(batch, per_seq).to(torch.int32), lens


def time_layers(call, layers: int, rounds: int = 8) -> float:
    """Seconds a call, `rounds` rounds over the `layers` caches (`call(layer)`) in one CUDA graph."""
    layer = itertools.cycle(range(layers))
    return time_cuda(lambda: call(next(layer)), iters=rounds * layers, graph=True)


def best_of(settings, call_for, reference, seconds_for, wrong: list) -> tuple[float, dict] | None:
    """The fastest setting whose output is within 2e-2 of `reference`: (seconds, setting); the
    others are appended to `wrong` with their difference (a kernel bug shows there)."""
    best = None
    for setting in settings:
        call = call_for(setting)
        try:
            diff = (call(0).float() - reference).abs().max().item()
        except triton.runtime.errors.OutOfResources:
            continue
        if not diff <= 2e-2:  # NaN too
            wrong.append({**setting, "max_abs_diff": diff})
            continue
        seconds = seconds_for(call)
        if best is None or seconds < best[0]:
            best = (seconds, {**setting, "max_abs_diff": round(diff, 5)})
    return best


def record(result: dict, name: str, best: tuple[float, dict] | None, kv_bytes: int) -> None:
    """A contender's best (`best_of`) into `result`: its TB/s of KV read and its setting."""
    if best is not None:
        result[f"{name}_TB_s"] = round(kv_bytes / best[0] / 1e12, 3)
        result[f"{name}_setting"] = best[1]


def compare(
    batch: int,
    context: int,
    spread: float = 0.0,
    kernels=("engine", "tma", "persistent"),
    heads=16,
    kv_heads=8,
    head_dim=128,
    page=16,
    kv_dtype=torch.bfloat16,
) -> dict:
    """The engine kernel with its defaults, the engine kernel's best tile / stages / shares, and
    the persistent kernel's best chunk / programs / tile / stages, on the same caches."""
    from rlx.engine.triton_decode import paged_decode

    kv, tables, lens = caches(
        batch, context, spread, kv_heads, head_dim, page, LAYERS, torch.bfloat16, "cuda"
    )
    kv = [tuple(c.to(kv_dtype) for c in layer) for layer in kv]  # `--kv-dtype`: fp8 rounds them
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    scale = head_dim**-0.5
    kv_bytes = 2 * int(lens.sum()) * kv_heads * head_dim * kv_dtype.itemsize
    seconds = lambda call: time_layers(call, LAYERS)  # noqa: E731
    result = {"batch": batch, "context": context, "spread": spread, "page": page, "kv_dtype": str(kv_dtype)}
    result["engine_TB_s"] = round(
        kv_bytes / seconds(lambda i: paged_decode(q, *kv[i], tables, lens, scale)) / 1e12, 3
    )
    reference = paged_decode(q, *kv[0], tables, lens, scale).float()
    # 3-4 stages hold one K and one V tile (the page-index load takes the other stages), 5-6
    # two, 8 three: compiled for sm90, the tile buffers' count is the memdesc's first dimension
    tiles = (32, 64, 128) if kv_dtype.itemsize == 1 else (16, 32, 64)  # a one-byte tile: half the bytes
    engine = [
        dict(block_n=n, num_stages=st, num_splits=k)
        for n, st, k in itertools.product(tiles, (4, 5, 6, 8), (1, 2))
    ] + [  # several KV heads a program (`launch_settings` from 15 pairs an SM on sm90)
        dict(block_n=n, num_stages=st, num_splits=1, heads_per_program=h)
        for n, st, h in itertools.product((16, 32), (2, 3, 4), (2, 4))
    ]
    wrong = result["wrong"] = []
    if "tma" in kernels:
        descriptors = [tma_descriptors(*layer) for layer in kv]
        best = best_of(
            [
                dict(num_warps=w, num_stages=st, num_splits=k)
                for w, st, k in itertools.product((2, 4), (2, 3, 4, 6, 8), (1, 2))
            ],
            lambda st: lambda i: tma_decode(q, *kv[i], descriptors[i], tables, lens, scale, **st),
            reference,
            seconds,
            wrong,
        )
        record(result, "tma", best, kv_bytes)
    if "engine" not in kernels:
        return result
    best = best_of(
        engine,
        lambda st: lambda i: paged_decode(q, *kv[i], tables, lens, scale, **st),
        reference,
        seconds,
        wrong,
    )
    record(result, "engine_best", best, kv_bytes)
    max_context = int(lens.max()) + 256  # the graph's table holds a context this far grown
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tables_by_chunk = {chunk: unit_table(lens, chunk, max_context) for chunk in (128, 256, 512)}
    persistent = [
        dict(chunk=c, programs=p * sms, block_n=n, num_stages=st)
        for c, p, n, st in itertools.product((128, 256, 512), (1, 2, 3), (32, 64), (4, 5, 8))
    ]

    def persistent_call(setting):
        units, row_start = tables_by_chunk[setting["chunk"]]
        return lambda i: persistent_decode(
            q, *kv[i], tables, lens, scale, units, row_start, max_context, **setting
        )

    if "persistent" not in kernels:
        return result
    best = best_of(persistent, persistent_call, reference, seconds, wrong)
    record(result, "persistent", best, kv_bytes)
    table_s = time_layers(lambda i: unit_table(lens, 256, max_context), 1)
    result["unit_table_us"] = round(table_s * 1e6, 2)  # once a step, shared by every layer
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="32,64,128,256")
    parser.add_argument("--contexts", default="300,520,1024,2048")
    parser.add_argument(
        "--spread", type=float, default=0.0, help="contexts uniform in (1 ± spread) x context"
    )
    parser.add_argument("--kernels", default="engine,tma,persistent", help="the contenders swept")
    parser.add_argument("--pages", default="16", help="KV page sizes (the engine's page_size) compared")
    parser.add_argument(
        "--kv-dtype",
        default="bf16",
        help="the cache's dtype: bf16, or an fp8 kv_cache_dtype (the engine kernel alone)",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    name = torch.cuda.get_device_name()
    from rlx.engine.config import KV_CACHE_DTYPES

    kv_dtype = KV_CACHE_DTYPES[args.kv_dtype]
    for batch in (int(b) for b in args.batches.split(",")):
        for context, page in itertools.product(
            (int(c) for c in args.contexts.split(",")), (int(p) for p in args.pages.split(","))
        ):
            kernels = args.kernels.split(",")
            print(
                json.dumps(
                    {
                        "device": name,
                        **compare(batch, context, args.spread, kernels, page=page, kv_dtype=kv_dtype),
                    }
                ),
                flush=True,
            )
    print(json.dumps({"bench": "decode_attention", "device": name, "date": time.strftime("%Y-%m-%d"),
                      "wall_s": round(time.perf_counter() - start, 1)}))  # fmt: skip


if __name__ == "__main__":
    main()
