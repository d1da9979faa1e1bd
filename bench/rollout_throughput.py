"""Rollout throughput of rlx's engine against transformers, on the GPU; prints one JSON line.

For a Qwen3-0.6B-shaped and a Qwen3-1.7B-shaped random model (bf16), batch 64 and 256,
prompt 256 tokens, 512 new tokens, ignore_eos, temperature 1: output tokens/s, time to first
token, and the fraction of the memory-bandwidth roofline, of the whole run and of its decode steps
alone (`with_roofline`). Byte model of a decode step: every
weight read once (the tied embedding counted once, as the LM head reads it) plus the K and V
of every sequence's context, at 4.8 TB/s (H200); the roofline time of a run is the sum over
its 512 decode steps. transformers `generate` (bf16, sdpa) runs side by side, with 128 new
tokens only to bound the GPU time (per token it only gets slower with length, so its
figure is an upper bound); `generate_batch` (transformers' continuous batching) once.

Each batch's prefill is also timed alone (the prompts with one new token): prompt tokens/s and
the fraction of the bf16 compute roofline (`prefill_flops`). Each dense run's entry carries
`gpu_power` (bench/gpu_power.py): the SM clock, the power against the limit and the share of the
run at the power cap, which the 1.7B at batch 256 reaches on an H200.

`--moe`: the Qwen3-MoE decode instead, on a Qwen3-30B-A3B layer shape cut to 4 of its 48 layers
(hidden 2048, 32 query / 4 KV heads of 128, 128 experts of FFN width 768, top-8, untied
151,936-word embeddings: 3.1B parameters, 0.5B active; `--moe-layers 18` is the slice
bench/grpo_step.py trains on 4 GPUs), engine only, with CUDA graphs and
without (`disable_cuda_graph`). At batch 64 and 256 every expert is routed to in every step
(512+ draws of 8 among 128), so the byte model above holds as it is. Run it with
`PYTHONPATH=<an older rlx tree>` to measure that tree's engine on the same model.

`--varlen`: rollouts of 128 sequences of 16-512 new tokens, each after a release and resume, with
the engine's memory saver (the decode graphs kept) and without (cleared; padded), and warm (`run_varlen`).

`--kv-cache-dtype fp8_e4m3`: the dense runs with an fp8 KV cache (the roofline then counts its
one-byte elements). `--top-p 0.9` / `--top-k 50`: every request of the dense runs samples so
(the engine draws those rows again after each decode graph: rlx/engine/triton_truncate.py).

`--decode-launch 64,3,1`: every decode-attention launch of the dense runs takes that tile
(tokens), pipeline stages and KV heads a program instead of the engine's rule
(`rlx.engine.triton_decode.launch_settings`; its context shares stay the rule's). A setting is
judged here, in the whole step, not by `bench/decode_attention.py` alone, whose ranking at 256
rows is not the rollout's (docs/benchmarks.md, Decisions).

`--handover`: the engine's side of a colocated step on the 1.7B shape (0.6B with `--quick`):
release, resume, weights received, and the rollout of 128 x 512 tokens after it against a warm
one, with the engine's CPU weight backup on and off (`run_handover`).

    source .whl/install.sh && python3 bench/rollout_throughput.py [--quick | --moe | --handover | --varlen]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from gpu_power import PowerLog

# HBM bandwidth by device (datasheet, bytes/s): the roofline uses the device it runs on
BANDWIDTHS = {"H200": 4.8e12, "H100": 3.35e12}
# dense bf16 tensor-core peak (datasheet, SXM, FLOP/s): the prefill's compute roofline; a large
# bf16 GEMM reaches about 790 TFLOP/s on either (../shared/device/README.md)
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12}
PROMPT, NEW = 256, 512
SHAPES = {
    "qwen3_0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28),
    "qwen3_1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28),
}
MOE_SHAPE = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=4, num_attention_heads=32,
    num_key_value_heads=4, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
    norm_topk_prob=True, tie_word_embeddings=False,
)  # fmt: skip
MOE_NAME = "qwen3_30b_a3b_{}_layers"  # --moe-layers (default 4)


def write_model(name: str, root: Path) -> Path:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    from rlx.models.tiny import write_word_tokenizer

    path = root / name
    if (path / "config.json").exists():  # --model-root: written by an earlier run
        return path
    common = dict(
        vocab_size=151936, head_dim=128, max_position_embeddings=4096, eos_token_id=1, pad_token_id=0
    )
    if name.startswith("qwen3_30b_a3b_"):
        layers = int(name.split("_")[3])
        config = Qwen3MoeConfig(**common, **(MOE_SHAPE | {"num_hidden_layers": layers}))
    else:
        config = Qwen3Config(**common, num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
                             **SHAPES[name])  # fmt: skip
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(path))
    write_word_tokenizer(path)
    return path


def for_device(table: dict[str, float], device_name: str) -> float:
    """`table`'s figure for the GPU named `device_name` (the H200's for one not in it)."""
    return next((v for k, v in table.items() if k in device_name), table["H200"])


def bandwidth(device_name: str) -> float:
    return for_device(BANDWIDTHS, device_name)


def decode_bytes(engine) -> tuple[int, int]:
    """(every weight's bytes, KV bytes a token of context) that a decode step reads."""
    cfg = engine.hf_config
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    kv_bytes = engine.kv_cache.data.element_size()  # 1 with an fp8 kv_cache_dtype
    return weights, 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_bytes


def roofline_s(engine, batch: int) -> float:
    weights, kv_per_token = decode_bytes(engine)
    tokens_read = batch * sum(PROMPT + t + 1 for t in range(NEW))
    return (NEW * weights + tokens_read * kv_per_token) / bandwidth(torch.cuda.get_device_name())


def with_roofline(engine, batch: int, ours: dict) -> dict:
    """`ours` (a `run_engine` result of NEW tokens a sequence) with its fraction of the roofline:
    of the whole run (prefill and first tokens included) and of the decode steps alone (decode
    tokens/s against the roofline's tokens/s; `decode_roofline_fraction`)."""
    ideal = roofline_s(engine, batch)
    ours["roofline_tokens_per_s"] = batch * NEW / ideal
    ours["roofline_fraction"] = ideal / ours["wall_s"]
    ours["decode_roofline_fraction"] = ours["decode_tokens_per_s"] / ours["roofline_tokens_per_s"]
    return ours


def prefill_flops(cfg, batch: int, prompt: int = PROMPT) -> float:
    """FLOPs of prefilling `batch` prompts of `prompt` tokens: 2 per active matmul weight a token
    (attention's projections; the MLP's, or the router's and its top-k experts' for a MoE), causal
    attention's QK and PV (2 x 2 x heads x head dim a token and earlier key, half the square on
    average), and the LM head once a sequence (the first sampled token's logits)."""
    hidden, d = cfg.hidden_size, cfg.head_dim
    attention = hidden * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    if getattr(cfg, "num_experts", 0):
        mlp = cfg.num_experts_per_tok * 3 * hidden * cfg.moe_intermediate_size + cfg.num_experts * hidden
    else:
        mlp = 3 * hidden * cfg.intermediate_size
    tokens = batch * prompt
    per_token = 2 * cfg.num_hidden_layers * (attention + mlp)
    causal = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * d * batch * prompt * (prompt + 1) / 2
    return tokens * per_token + causal + 2 * batch * cfg.vocab_size * hidden


def run_prefill(engine, batch: int) -> dict:
    """Prefill alone: `batch` prompts of PROMPT tokens, one new token each; its tokens/s and its
    fraction of the compute roofline (`prefill_flops` at the device's peak)."""
    wall = run_engine(engine, batch, new=1, seed=PREFILL_SEED + batch)["wall_s"]
    peak = for_device(PEAK_BF16_FLOPS, torch.cuda.get_device_name())
    flops = prefill_flops(engine.hf_config, batch)
    return {
        "prefill_tokens_per_s": round(batch * PROMPT / wall),
        "prefill_tflops_per_s": round(flops / wall / 1e12, 1),
        "compute_roofline_fraction": round(flops / wall / peak, 3),
    }


# each run its own prompts: the engine's prefix cache would serve a repeated prompt's prefill
WARMUP_SEED, PREFILL_SEED = 10_000, 20_000


def warm_up(engine, batches: list[int], sampling: dict | None = None) -> None:
    """What a timed run must not pay: every decode graph of the ladder (a run's batch shrinks
    through smaller sizes at its end, the sequences whose prefill came in a later chunk finishing
    later; each size is otherwise captured at its first need, inside the timing) and the Triton
    kernels each batch's prefill compiles (the sampler's and attention's variants by rows)."""
    if engine.runner.graphs is not None:
        engine.runner.graphs.capture()
    for batch in batches:
        run_engine(engine, batch, new=4, seed=WARMUP_SEED + batch, sampling=sampling)


def run_engine(
    engine, batch: int, new: int | list[int] = NEW, seed: int | None = None, sampling: dict | None = None
) -> dict:
    """`batch` random prompts of PROMPT tokens (drawn from `seed`, default the batch size), `new`
    tokens each (or `new[i]` for prompt i), sampled at `sampling`'s settings (top_p, top_k; none:
    temperature 1 over the whole vocabulary); tokens/s, decode tokens/s (after every first
    token), time to first token."""
    from rlx.engine.sequence import GenerateRequest, SamplingParams

    g = torch.Generator().manual_seed(batch if seed is None else seed)
    seqs = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(batch):
        ids = torch.randint(2, engine.vocab_size, (PROMPT,), generator=g).tolist()
        n = new[i] if isinstance(new, list) else new
        params = SamplingParams(max_new_tokens=n, ignore_eos=True, **(sampling or {}))
        seqs.append(engine.add(GenerateRequest(ids, params)))
    first: dict[int, float] = {}
    decode_start = None
    while engine.has_work():
        engine.step()
        now = time.perf_counter()
        for s in seqs:
            if s.output_logprobs and s.seq_id not in first:  # read back (num_output counts pending)
                first[s.seq_id] = now - start
        if decode_start is None and len(first) == batch:
            decode_start, decode_tokens0 = now, sum(len(s.output_logprobs) for s in seqs)
    total = time.perf_counter() - start
    out_tokens = sum(s.num_output for s in seqs)
    decode_s = time.perf_counter() - decode_start
    return {
        "tokens_per_s": out_tokens / total,
        "decode_tokens_per_s": (out_tokens - decode_tokens0) / decode_s,
        "ttft_mean_s": sum(first.values()) / batch,
        "ttft_max_s": max(first.values()),
        "wall_s": total,
        "output_tokens": out_tokens,
    }


def run_transformers(path: Path, batch: int, new: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.bfloat16, attn_implementation="sdpa"
    ).cuda()
    ids = torch.randint(2, 151936, (batch, PROMPT), device="cuda")
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, top_k=0, pad_token_id=0)
    model.generate(ids[:, :16], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    result = {"tokens_per_s": batch * (out.shape[1] - PROMPT) / seconds, "new_tokens": new}
    del model
    torch.cuda.empty_cache()
    return result


def run_generate_batch(path: Path, batch: int, new: int) -> dict:
    """transformers' own continuous batching with paged attention (the library option), under
    the first attention name the installed transformers accepts for it."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    errors = {}
    for attn in ("paged|sdpa", "sdpa", "paged|eager"):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=torch.bfloat16, attn_implementation=attn
            ).cuda()
            g = GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=-1, pad_token_id=0)
            prompts = torch.randint(2, 151936, (batch, PROMPT)).tolist()
            model.generate_batch(prompts[:4], generation_config=g)
            torch.cuda.synchronize()
            start = time.perf_counter()
            outs = model.generate_batch(prompts, generation_config=g)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.generated_tokens) for o in outs.values())
            del model
            torch.cuda.empty_cache()
            return {"attn_implementation": attn, "tokens_per_s": tokens / seconds, "new_tokens": new}
        except Exception as exc:  # report, do not fail the bench
            errors[attn] = f"{type(exc).__name__}: {exc}"[:200]
    return {"errors": errors}


def make_engine(path: Path, **kwargs):
    from rlx.engine import Engine, EngineArgs

    defaults = dict(
        max_running_requests=256,
        cuda_graph_max_bs=256,
        mem_fraction_static=0.8,
        context_length=PROMPT + NEW + 16,
    )
    return Engine(EngineArgs(model_path=str(path), dtype="bfloat16", **(defaults | kwargs)))


def run_moe(root: Path, results: dict, batches: list[int], layers: int = 4) -> None:
    import rlx

    name = MOE_NAME.format(layers)
    path = write_model(name, root)
    results["rlx"] = str(Path(rlx.__file__).parent)
    for graphs in (True, False):
        engine = make_engine(path, disable_cuda_graph=not graphs)
        if graphs and engine.runner.graphs is None:  # a tree whose MoE decode is never graphed
            results["cuda_graphs_captured"] = False
            graphs = False
        warm_up(engine, batches)
        for batch in batches:
            prefill = run_prefill(engine, batch)
            ours = with_roofline(engine, batch, run_engine(engine, batch))
            entry = {"model": name, "batch": batch, "cuda_graphs": graphs, "rlx": ours, "prefill": prefill}
            results["runs"].append(entry)
            print(json.dumps(entry), flush=True)
        engine.release_memory()
        del engine
        torch.cuda.empty_cache()
        if results.get("cuda_graphs_captured") is False:
            break
    print(json.dumps(results))


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def run_handover(root: Path, results: dict, name: str, batch: int = 128) -> None:
    """The engine's side of a colocated step, as the loop drives it: release everything, resume
    the weights, receive every tensor (from GPU tensors, as CUDA IPC hands them over), resume the
    KV cache, roll out `batch` x 512 tokens; with and without `enable_weights_cpu_backup`. The
    rollout after the resume captures its decode graphs again: with the sizes it needs (now), and
    with the whole ladder first (before: every release cost a ladder capture at the next decode)."""
    from safetensors.torch import load_file

    from rlx.engine.models.weights import safetensors_files

    path = write_model(name, root)
    tensors = {n: t for file in safetensors_files(path) for n, t in load_file(str(file)).items()}
    named = [(n, t.cuda()) for n, t in sorted(tensors.items())]
    for backup in (True, False):
        entry = {"model": name, "batch": batch} | handover(
            make_engine(path, enable_weights_cpu_backup=backup), named, batch
        )
        results["runs"].append(entry)
        print(json.dumps(entry), flush=True)
        torch.cuda.empty_cache()


def run_varlen(root: Path, results: dict, name: str, batch: int = 128, rounds: int = 3) -> None:
    """A colocated engine's rollouts: sequences ending at different lengths (uniform 16-512 new
    tokens, as EOS ends an RL rollout's), the batch shrinking as they finish, each rollout after
    a release and resume of the weights and KV cache (the weights back from the CPU copy; the
    loop's weight sync is not timed here), `rounds` times; then one warm, with no release. With
    the memory saver (`enable_memory_saver`, rlx's default when colocated) the addresses and the
    decode graphs stay, so a batch size is captured once per engine; without it each release
    clears the graphs and a rollout pads a step to a captured graph of up to twice its rows
    (`rlx.engine.cuda_graph.graph_size`) rather than capture one at every size it meets."""
    path = write_model(name, root)
    lengths = torch.randint(16, NEW + 1, (batch,), generator=torch.Generator().manual_seed(0)).tolist()
    for saver in (False, True):
        engine = make_engine(path, enable_memory_saver=saver, enable_weights_cpu_backup=True)
        graphs = engine.runner.graphs
        run_engine(engine, 8, new=8, seed=WARMUP_SEED)  # Triton kernels compiled
        entry = {"model": name, "batch": batch, "new_tokens": "uniform 16-512", "memory_saver": saver}
        runs = [f"after_release_{index}" for index in range(rounds)] + ["warm"]
        for index, run in enumerate(runs):
            if run != "warm":
                entry[f"{run}_release_s"] = round(timed(engine.release_memory), 4)
                entry[f"{run}_resume_s"] = round(timed(engine.resume_memory), 4)
            captured, capture_s = graphs.num_captured, graphs.capture_s
            out = run_engine(engine, batch, new=lengths, seed=PREFILL_SEED + index)  # new prompts each
            entry[f"{run}_rollout_s"] = round(out["wall_s"], 3)
            entry[f"{run}_tokens_per_s"] = round(out["tokens_per_s"])
            entry[f"{run}_graphs_captured"] = graphs.num_captured - captured
            entry[f"{run}_capture_s"] = round(graphs.capture_s - capture_s, 3)
        results["runs"].append(entry)
        print(json.dumps(entry), flush=True)
        engine.release_memory()
        del engine, graphs
        torch.cuda.empty_cache()
    print(json.dumps(results))


def handover(engine, named: list, batch: int) -> dict:
    graphs = engine.runner.graphs
    entry = {"enable_weights_cpu_backup": engine.args.enable_weights_cpu_backup}
    entry["ladder_capture_s"], entry["ladder_sizes"] = timed(graphs.capture), len(graphs.graphs)
    run_engine(engine, 8, new=8)  # Triton kernels compiled
    run_engine(engine, batch, seed=WARMUP_SEED + batch)
    entry["warm_rollout_s"] = run_engine(engine, batch)["wall_s"]
    for ladder in (False, True):
        key = "after_resume_with_ladder" if ladder else "after_resume"
        entry[f"{key}_release_s"] = timed(engine.release_memory)
        entry[f"{key}_resume_weights_s"] = timed(lambda: engine.resume_memory(["weights"]))
        entry[f"{key}_load_weights_s"] = timed(lambda: engine.load_named_weights(named))
        entry[f"{key}_resume_kv_cache_s"] = timed(lambda: engine.resume_memory(["kv_cache"]))
        captured, capture_s = graphs.num_captured, graphs.capture_s
        fresh = run_engine(engine, batch, seed=PREFILL_SEED + ladder)["wall_s"]  # new prompts, as a step's
        rollout_s = (timed(graphs.capture) if ladder else 0.0) + fresh
        entry[f"{key}_rollout_s"] = rollout_s
        entry[f"{key}_graphs_captured"] = graphs.num_captured - captured
        entry[f"{key}_capture_s"] = graphs.capture_s - capture_s
    engine.release_memory()
    return entry


def override_decode_launch(spec: str) -> None:
    """`--decode-launch N,S,H`: every decode launch in this process takes N-token tiles, S stages
    and H KV heads a program (the rule's shares kept)."""
    from rlx.engine import triton_decode

    block_n, stages, heads = (int(x) for x in spec.split(","))
    rule = triton_decode.launch_settings

    def fixed(*args, **kwargs) -> dict:
        return rule(*args, **kwargs) | {"block_n": block_n, "num_stages": stages, "heads_per_program": heads}

    triton_decode.launch_settings = fixed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="0.6B only, batch 256")
    parser.add_argument("--hf-new-tokens", type=int, default=128)
    parser.add_argument("--engine-only", action="store_true", help="skip the transformers and flex runs")
    parser.add_argument("--moe", action="store_true", help="Qwen3-MoE decode, graphs on and off (docstring)")
    parser.add_argument("--moe-batches", default="64,256", help="--moe: the batch sizes")
    parser.add_argument("--moe-layers", type=int, default=4, help="--moe: layers of the 48 kept")
    parser.add_argument("--handover", action="store_true", help="release/resume and the rollout after (1.7B)")
    parser.add_argument(
        "--varlen", action="store_true", help="a rollout of mixed lengths, graphs padded or not"
    )
    parser.add_argument("--model-root", help="where the random models are written (default: a new temp dir)")
    parser.add_argument("--batches", default="64,256", help="the batch sizes of the dense runs")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="the dense shapes run")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="the dense runs' engine argument (fp8_e4m3: one byte an element)",
    )
    parser.add_argument("--top-p", type=float, help="the dense runs sample with this top_p (default 1: off)")
    parser.add_argument("--top-k", type=int, help="the dense runs sample with this top_k (default -1: off)")
    parser.add_argument(
        "--decode-launch", help="the dense runs' decode attention: tile,stages,heads (docstring)"
    )
    args = parser.parse_args()
    if args.decode_launch:
        override_decode_launch(args.decode_launch)
    sampling = {k: v for k, v in (("top_p", args.top_p), ("top_k", args.top_k)) if v is not None}
    results = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "runs": []}
    root = Path(args.model_root or tempfile.mkdtemp())
    if args.moe:
        return run_moe(root, results, [int(b) for b in args.moe_batches.split(",")], args.moe_layers)
    if args.varlen:
        return run_varlen(root, results, "qwen3_0.6b" if args.quick else "qwen3_1.7b")
    if args.handover:
        run_handover(root, results, "qwen3_0.6b" if args.quick else "qwen3_1.7b")
        return print(json.dumps(results))
    for name in ["qwen3_0.6b"] if args.quick else args.shapes.split(","):
        path = write_model(name, root)
        engine = make_engine(path, kv_cache_dtype=args.kv_cache_dtype)
        batches = [256] if args.quick else [int(b) for b in args.batches.split(",")]
        warm_up(engine, batches, sampling)
        for batch in batches:
            prefill = run_prefill(engine, batch)
            with PowerLog() as power:
                ours = with_roofline(engine, batch, run_engine(engine, batch, sampling=sampling))
            entry = {"model": name, "batch": batch, "kv_cache_dtype": args.kv_cache_dtype, "rlx": ours}
            entry["gpu_power"] = power.summary()
            entry["sampling"] = sampling
            if args.decode_launch:
                entry["decode_launch"] = args.decode_launch
            entry["prefill"] = prefill
            results["runs"].append(entry)
            print(json.dumps(entry), flush=True)
        engine.release_memory()
        del engine
        torch.cuda.empty_cache()
        if args.engine_only:
            continue
        for batch in [256] if args.quick else [64, 256]:
            hf = run_transformers(path, batch, args.hf_new_tokens)
            entry = next(e for e in results["runs"] if e["model"] == name and e["batch"] == batch)
            entry["transformers_generate"] = hf
            entry["speedup"] = entry["rlx"]["tokens_per_s"] / hf["tokens_per_s"]
        if name == "qwen3_0.6b":
            results["transformers_generate_batch_b256"] = run_generate_batch(path, 256, args.hf_new_tokens)
            from engine_step_profile import flex_dense_decode, flex_paged_decode, triton_decode

            ctx = PROMPT + NEW // 2  # the run's mean context
            results[f"attention_one_layer_b256_ctx{ctx}"] = {
                "rlx_triton": triton_decode(256, ctx),
                "flex_attention_paged": flex_paged_decode(256, ctx),
                "flex_attention_paged_page128": flex_paged_decode(256, ctx, page=128),
                "flex_attention_contiguous_kv": flex_dense_decode(256, ctx),
            }
    print(json.dumps(results))


if __name__ == "__main__":
    main()
