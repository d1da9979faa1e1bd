"""Where one decode step of rlx's engine spends its time, on the GPU; prints one JSON line.

A Qwen3-0.6B-shaped random bf16 model (`--shape qwen3_1.7b`: 1.7B), 256 sequences (`--batch`),
prompt 256: after the prefill, decode
steps are timed piece by piece (host clock for the CPU work, CUDA events for the GPU work,
one synchronised pass for each piece's own GPU time), then a torch.profiler pass lists the
heaviest kernels, their sum by part (`kernel_groups_ms`: attention, the layers' GEMMs, the LM
head, norms, ...) and the step against its memory roofline (`roofline_ms`: every weight once and
every sequence's KV at the context reached, at the device's bandwidth). Beside it, the attention
of one layer alone: the Triton paged kernel, and torch FlexAttention over the same paged KV with
a block mask built from the block tables (`flex_paged_decode`, also used by
bench/rollout_throughput.py). Under programmatic dependent launch (the engine's default on sm90+,
rlx/engine/pdl.py) a Triton kernel starts early and its time holds its wait for the kernel
before: `RLX_ENGINE_PDL=0` gives each part its own time (the step then a little longer).

`--splits` first times the decode kernel alone by batch, context and split count (flash-decoding
shares, rlx.engine.triton_decode), beside the count it chooses by itself; then the sampler by
shares (`bench/sampler.py`'s timing) and the q/k norm-rotary-store kernel, by rows.

`--context N` decodes until about N tokens of context before timing (the throughput bench's
mean context is 512). `gpu_power` (bench/gpu_power.py) covers those steps and the timed ones: a
step timed at the power cap, or in one of the driver's clock drops, reads slower.

    source .whl/install.sh && python3 bench/engine_step_profile.py [--steps 20] [--splits] [--context N]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from gpu_power import PowerLog
from rollout_throughput import BANDWIDTHS, PROMPT, bandwidth, decode_bytes, write_model


def prefill_all(engine, batch: int) -> list:
    from rlx.engine.sequence import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(batch):
        ids = torch.randint(2, engine.vocab_size, (PROMPT,), generator=g).tolist()
        request = GenerateRequest(ids, SamplingParams(max_new_tokens=1 << 20, ignore_eos=True))
        seqs.append(engine.add(request))
    while any(s.num_output == 0 for s in seqs):
        engine.step()
    return seqs


def wall_steps(engine, steps: int) -> float:
    for _ in range(3):  # the first decode step captures the graphs
        engine.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def piecewise(engine, steps: int) -> dict:
    """Milliseconds per piece of a decode step, each piece synchronised so that it owns its
    GPU time (the sum exceeds an unsynchronised step by what overlapped)."""
    runner, totals = engine.runner, {}
    if hasattr(engine, "_drain"):
        engine._drain()  # the pieces below run without overlap

    def clock(name, fn, *args):
        start = time.perf_counter()
        value = fn(*args)
        torch.cuda.synchronize()
        totals[name] = totals.get(name, 0.0) + (time.perf_counter() - start) / steps * 1e3
        return value

    pieces = _graph_sampler_pieces if hasattr(runner, "_run_graph") else _eager_sampler_pieces
    for _ in range(steps):
        batch = clock("schedule", engine.scheduler.schedule)
        values = pieces(runner, batch, clock)
        clock("bookkeeping", _bookkeeping, engine, batch, values)
    return {k: round(v, 3) for k, v in totals.items()}


def _graph_sampler_pieces(runner, batch, clock) -> list:
    """This tree's engine, overlap off: the graph samples; host fill + copies + replay, then
    one readback."""
    handle = clock("fill_copy_replay_incl_gpu", runner.launch, batch.seqs, [-1] * len(batch.seqs))
    return clock("readback", runner.collect, handle)


def _eager_sampler_pieces(runner, batch, clock) -> list:
    """The engine before this change (commit 3172d00): inputs as new tensors, the graph gives
    logits, the torch sampler runs outside it."""
    from rlx.engine.sampler import SamplingBatch
    from rlx.engine.step_inputs import build_step_inputs

    def readback(tokens, logprobs):
        values = torch.cat([tokens.float(), logprobs]).tolist()
        return [values[: len(tokens)], values[len(tokens) :]]

    inputs = clock(
        "build_inputs_h2d",
        build_step_inputs,
        batch,
        runner.block_size,
        runner.device,
        True,
        runner.flash_prefill,
    )
    logits = clock("graph_copy_replay", runner.graphs.run, inputs.input_ids, inputs.positions, inputs.meta)
    params = clock(
        "sampling_params_h2d", SamplingBatch.build, inputs.sample_seqs, runner.vocab_size, runner.device
    )
    tokens, logprobs = clock("sampler", runner.sampler, logits, params)
    return clock("readback", readback, tokens, logprobs)


def _bookkeeping(engine, batch, values) -> None:
    for seq, token, logprob in zip(batch.seqs, *values, strict=True):
        seq.num_computed += 1
        seq.token_ids.append(int(token))
        seq.output_logprobs.append(logprob)
        engine._check_finished(seq, int(token))


# kernel-name fragments of each part of a decode step (`kernel_groups`); the first match wins
KERNEL_GROUPS = (
    ("attention", ("_paged_decode", "_merge_splits")),
    ("sampler", ("_sample_", "_merge_kernel")),  # today's _sample_blocks/_select; an older tree's two
    ("norms", ("_add_rms_norm",)),
    ("qk_norm_rope_store", ("_qk_norm_rope",)),
    ("swiglu", ("_silu_mul",)),
    ("gemm", ("nvjet", "gemm", "cutlass", "splitK", "xmma", "cublas", "_split_k")),
)


def kernel_groups(rows: list, layers: int) -> dict:
    """ms a step by part, from `kernel_table` rows (all of them): a GEMM kernel that runs fewer
    times a step than there are layers is the LM head's; unmatched kernels are `other`."""
    groups: dict[str, float] = {}
    for row in rows:
        name = next((g for g, keys in KERNEL_GROUPS if any(k in row["kernel"] for k in keys)), "other")
        if name == "gemm" and row["calls"] < layers:
            name = "lm_head"
        groups[name] = groups.get(name, 0.0) + row["ms_per_step"]
    return {k: round(v, 3) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])}


def step_roofline_ms(
    weight_bytes: int, kv_bytes_per_token: int, batch: int, context: int, bw: float
) -> float:
    """A decode step's memory roofline: every weight once, every sequence's context of KV once."""
    return (weight_bytes + batch * context * kv_bytes_per_token) / bw * 1e3


def kernel_table(engine, steps: int, top: int | None = 15) -> list:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        device_us = getattr(event, "device_time_total", 0) or getattr(event, "cuda_time_total", 0)
        if device_us and event.device_type.name == "CUDA":
            rows.append((device_us / steps / 1e3, event.count // steps, event.key[:90]))
    rows.sort(reverse=True)
    return [
        {"ms_per_step": round(ms, 3), "calls": n, "kernel": k} for ms, n, k in rows[:top]
    ]  # top None: all


def paged_kv(batch: int, context: int, kv_heads: int, head_dim: int, page: int, layout: str):
    """A KV cache with `batch` sequences of `context` tokens in shuffled pages, and its tables."""
    per_seq = -(-context // page)
    num_blocks = batch * per_seq + 1
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (
        (num_blocks, kv_heads, page, head_dim) if layout == "bhsd" else (kv_heads, num_blocks, page, head_dim)
    )
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn_like(k)
    tables = (torch.randperm(num_blocks - 1, device="cuda", generator=g)[: batch * per_seq] + 1).view(
        batch, per_seq
    )
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    return k, v, tables.to(torch.int32), lens


def time_cuda(fn, iters: int = 20, graph: bool = False) -> float:
    """Seconds a call, from CUDA events around `iters` calls; `graph`: the calls captured in one
    CUDA graph, as the engine runs them, so that no host launch cost is counted."""
    fn()
    torch.cuda.synchronize()
    run = lambda: [fn() for _ in range(iters)]  # noqa: E731
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            run()
        run = cuda_graph.replay
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters / 1e3


def triton_decode(batch: int, context: int, heads=16, kv_heads=8, head_dim=128, page=16, **launch) -> dict:
    """The kernel alone on one layer's KV, in a CUDA graph (as the engine's decode runs it)."""
    from rlx.engine.triton_decode import paged_decode

    k, v, tables, lens = paged_kv(batch, context, kv_heads, head_dim, page, "bhsd")
    q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    seconds = time_cuda(lambda: paged_decode(q, k, v, tables, lens, head_dim**-0.5, **launch), graph=True)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
    return {"ms": round(seconds * 1e3, 4), "TB_per_s": round(kv_bytes / seconds / 1e12, 3)}


def sweep_decode_launch(batch: int, context: int, splits=(1,)) -> dict:
    """The Triton kernel's tile, pipeline and split settings, one line each; `default` is what
    paged_decode chooses by itself."""
    results = {"default": triton_decode(batch, context)["TB_per_s"]}
    for block_n in (32, 64, 128):
        for num_warps in (4, 8):
            for num_stages in (2, 3, 4):
                for num_splits in splits:
                    key = f"n{block_n}_w{num_warps}_s{num_stages}_k{num_splits}"
                    try:
                        launch = dict(
                            block_n=block_n, num_warps=num_warps, num_stages=num_stages, num_splits=num_splits
                        )
                        results[key] = triton_decode(batch, context, **launch)["TB_per_s"]
                    except Exception as exc:  # e.g. out of shared memory
                        results[key] = type(exc).__name__
    return results


def split_table(batches=(32, 64, 128, 256), contexts=(300, 520, 770, 2048), splits=(1, 2, 4, 8)) -> dict:
    """TB/s of the decode kernel (in a graph) by batch, context and split count, beside the count
    it chooses by itself; then the fused sampler's microseconds by rows and vocabulary shares, and
    the q/k norm-rotary-store kernel's by rows."""
    table = {}
    for batch in batches:
        for context in contexts:
            row = {f"k{k}": triton_decode(batch, context, num_splits=k)["TB_per_s"] for k in splits}
            row["default"] = triton_decode(batch, context)["TB_per_s"]
            table[f"b{batch}_ctx{context}"] = row
    from sampler import VOCAB, sampler_us  # bench/sampler.py

    from rlx.engine.triton_sample import default_splits

    device = torch.device("cuda")
    for rows in batches:
        row = {f"k{k}": sampler_us(rows, VOCAB, device, k)["us"] for k in (1, 2, 4, 8, 16)}
        row["default"] = default_splits(rows, device, VOCAB)
        table[f"sampler_us_rows{rows}"] = row
    for rows in batches:
        table[f"qk_norm_rope_store_us_rows{rows}"] = qk_kernel_us(rows)
    return table


def qk_kernel_us(rows: int, heads=16, kv_heads=8, head_dim=128) -> float:
    """Microseconds a call of the q/k norm, rotary and KV-store kernel (Qwen3's heads), 28 calls
    in a graph as a decode step makes them."""
    from types import SimpleNamespace

    from rlx.engine.triton_layers import qk_norm_rope_store

    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, device="cuda", dtype=torch.bfloat16)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    k, v = qkv[:, heads * head_dim :].view(rows, 2, kv_heads, head_dim).unbind(1)
    cos, sin = torch.randn(2, 40960, head_dim, device="cuda").unbind(0)
    weight = torch.randn(head_dim, device="cuda", dtype=torch.bfloat16)
    cache = torch.zeros(2, 4096, kv_heads, 16, head_dim, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(4096 * 16, device="cuda")[:rows]
    meta = SimpleNamespace(slot_block=slots // 16, slot_offset=slots % 16)
    positions = torch.randint(0, 40960, (rows,), device="cuda")
    args = (q, k, v, (weight, weight), 1e-6, cos, sin, positions, tuple(cache.unbind(0)), meta)
    return round(time_cuda(lambda: qk_norm_rope_store(*args), iters=28, graph=True) * 1e6, 2)


def flex_paged_decode(
    batch: int, context: int, heads=16, kv_heads=8, head_dim=128, page=16, q_block=128
) -> dict:
    """FlexAttention decode over a paged cache [1, kv_heads, blocks x page, D]: the block mask's
    KV blocks are the pages of each row's block table (full pages, then the partial last page
    under a mask_mod), so no KV is gathered; compiled, as flex must be to be fast. A query block
    of 1 fails to lower on torch 2.11 (NoValidChoicesError); 128 (flex's default) works."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    try:
        k, v, tables, lens = paged_kv(batch, context, kv_heads, head_dim, page, "hbsd")
        k = k.reshape(1, kv_heads, -1, head_dim)
        v = v.reshape(1, kv_heads, -1, head_dim)
        q = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=torch.bfloat16)
        num_pages = (lens + page - 1) // page
        last_len = lens - (num_pages - 1) * page

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx % page < last_len[b]

        # flex sizes the mask's KV extent from the index width: pad it to every page
        width = k.shape[2] // page

        def build() -> BlockMask:
            rows = torch.arange(batch, device="cuda")
            full = torch.zeros(batch, 1, 1, width, dtype=torch.int32, device="cuda")
            full[:, 0, 0, : tables.shape[1]] = tables
            last = torch.zeros_like(full)
            last[:, 0, 0, 0] = tables[rows, (num_pages - 1).long()]
            return BlockMask.from_kv_blocks(
                kv_num_blocks=torch.ones(batch, 1, 1, dtype=torch.int32, device="cuda"),
                kv_indices=last,
                full_kv_num_blocks=(num_pages - 1).view(batch, 1, 1).to(torch.int32),
                full_kv_indices=full,
                BLOCK_SIZE=(q_block, page),
                mask_mod=mask_mod,
                seq_lengths=(1, k.shape[2]),
                compute_q_blocks=False,  # only the backward needs them
            )

        mask = build()
        compiled = torch.compile(flex_attention, dynamic=False)
        start = time.perf_counter()
        out = compiled(q, k, v, block_mask=mask, enable_gqa=True, scale=head_dim**-0.5)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - start
        seconds = time_cuda(lambda: compiled(q, k, v, block_mask=mask, enable_gqa=True, scale=head_dim**-0.5))
        mask_s = time_cuda(build)
        ref = triton_reference(q, k, v, tables, lens, page, kv_heads)
        kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
        return {
            "ms": round(seconds * 1e3, 4),
            "TB_per_s": round(kv_bytes / seconds / 1e12, 3),
            "block_mask_build_ms": round(mask_s * 1e3, 4),
            "compile_s": round(compile_s, 1),
            "max_abs_diff_vs_triton": round((out[:, :, 0].float() - ref.float()).abs().max().item(), 4),
        }
    except Exception as exc:  # report, do not fail the bench
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}


def flex_dense_decode(batch: int, context: int, heads=16, kv_heads=8, head_dim=128) -> dict:
    """FlexAttention decode over contiguous per-sequence K/V [batch, kv_heads, context, D] (no
    pages, no mask): flex's own decode kernel at its best, the ceiling of a paged variant."""
    from torch.nn.attention.flex_attention import flex_attention

    try:
        k = torch.randn(batch, kv_heads, context, head_dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=torch.bfloat16)
        compiled = torch.compile(flex_attention, dynamic=False)
        seconds = time_cuda(lambda: compiled(q, k, v, enable_gqa=True, scale=head_dim**-0.5))
        kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
        return {"ms": round(seconds * 1e3, 4), "TB_per_s": round(kv_bytes / seconds / 1e12, 3)}
    except Exception as exc:  # report, do not fail the bench
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}


def triton_reference(q, k_flat, v_flat, tables, lens, page, kv_heads):
    from rlx.engine.triton_decode import paged_decode

    head_dim = q.shape[-1]
    k = k_flat.view(kv_heads, -1, page, head_dim).transpose(0, 1).contiguous()
    v = v_flat.view(kv_heads, -1, page, head_dim).transpose(0, 1).contiguous()
    return paged_decode(q[:, :, 0], k, v, tables, lens, head_dim**-0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--no-attention", action="store_true", help="skip the one-layer attention runs")
    parser.add_argument("--sweep", action="store_true", help="sweep the decode kernel's launch settings")
    parser.add_argument("--splits", action="store_true", help="the decode kernel by batch, context, splits")
    parser.add_argument("--shape", default="qwen3_0.6b", choices=["qwen3_0.6b", "qwen3_1.7b"])
    parser.add_argument(
        "--context", type=int, help="decode until about this context before timing (default: the prompt's)"
    )
    parser.add_argument("--model-root", help="where the random model is written (default: a new temp dir)")
    args = parser.parse_args()
    from rlx.engine import Engine, EngineArgs

    name = torch.cuda.get_device_name()
    result = {"device": name, "bandwidth_TB_s": bandwidth(name) / 1e12, "date": time.strftime("%Y-%m-%d")}
    result["bandwidths_known"] = {k: v / 1e12 for k, v in BANDWIDTHS.items()}
    result["shape"], result["batch"] = args.shape, args.batch
    if args.splits:
        result["decode_kernel_TB_s"] = split_table()
    path = write_model(args.shape, Path(args.model_root or tempfile.mkdtemp()))
    engine = Engine(EngineArgs(
        model_path=str(path), dtype="bfloat16", context_length=2048, max_running_requests=256,
        cuda_graph_max_bs=256, mem_fraction_static=0.8,
    ))  # fmt: skip
    seqs = prefill_all(engine, args.batch)
    with PowerLog() as power:  # the decode steps up to the timed ones, and those
        if args.context:  # the timed steps below add about 3 * steps + 8 tokens
            while engine.scheduler.running[0].num_tokens < args.context - 3 * args.steps - 8:
                engine.step()
        result["step_ms"] = round(wall_steps(engine, args.steps) * 1e3, 3)
    result["gpu_power"] = power.summary()
    result["pieces_ms"] = piecewise(engine, args.steps)
    kernels = kernel_table(engine, 5, top=None)
    result["kernels"] = kernels[:15]
    result["kernel_groups_ms"] = kernel_groups(kernels, engine.hf_config.num_hidden_layers)
    result["context_at_end"] = context = engine.scheduler.running[0].num_tokens
    weights, kv_per_token = decode_bytes(engine)
    result["roofline_ms"] = round(
        step_roofline_ms(weights, kv_per_token, args.batch, context, bandwidth(name)), 3
    )
    result["roofline_fraction"] = round(result["roofline_ms"] / result["step_ms"], 3)
    for seq in seqs:
        engine.abort(seq)
    engine.release_memory()
    del engine
    torch.cuda.empty_cache()
    if args.sweep:
        result["decode_launch_sweep_TB_s"] = {
            c: sweep_decode_launch(args.batch, c, splits=(1, 2, 4)) for c in (300, 770)
        }
    if args.no_attention:
        print(json.dumps(result), flush=True)
        return
    # the mean context of the throughput bench (512) is measured there; here a long one
    result[f"attention_one_layer_b{args.batch}_ctx2048"] = {
        "rlx_triton": triton_decode(args.batch, 2048),
        "flex_attention_paged": flex_paged_decode(args.batch, 2048),
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
