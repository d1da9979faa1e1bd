"""The rollout engine's terms of the memory plan: what one engine GPU holds while it generates.

The engine (rlx's own, `rlx.engine`, and SGLang alike) sizes its KV cache from
`mem_fraction_static` (`rollout.engine_args`): once its weights are loaded, the cache gets
`mem_fraction_static x the GPU's memory - the GPU's memory in use` (every process's: a colocated
trainer's leftovers included), capped by `max_total_tokens` and by what its running requests could
ever use (`max_running_requests` sequences of the context). What it allocates afterwards, outside
that fraction: the memory pool of its decode CUDA graphs (captured after the cache) and the
working memory of its eager steps. So while generating a GPU holds

    the others' leftovers + engine weights + KV cache   (= mem_fraction_static x GPU when the
                                                           fraction, not a cap, sized the cache)
    + CUDA graphs + workspace + the engine's CUDA context

Approximate, and stated as such in the printed plan:
- CUDA graphs: the shared pool holds one decode step's intermediates at the largest captured batch
  (`cuda_graph_max_bs`): its logits (batch x vocabulary, counted in fp32; rlx's engine holds one
  buffer of them in the model's dtype for every graph) and one layer's activations;
- workspace: one prefill chunk's (`chunked_prefill_size` tokens) layer activations, and the fp32
  logits of `max_running_requests` rows;
- SGLang picks its own `mem_fraction_static` from the GPU's size when none is given; the plan
  takes the local engine's default (0.88) unless `rollout.engine_args` sets it;
- an engine over several GPUs (SGLang's tensor parallelism) is counted as the weights and KV heads
  split evenly over them; MLA's cache as SGLang's compressed latent (kv_lora_rank + rope per layer).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from rlx.memory.params import ModelParams, engine_params
from rlx.memory.terms import CUDA_CONTEXT_BYTES, Setup, Term, count
from rlx.rollout.config import RolloutConfig

# The engine arguments the plan reads, at the local engine's defaults (rlx.engine.config.EngineArgs,
# which a test holds these to); `rollout.engine_args` overrides them under the same names.
ENGINE_DEFAULTS: dict[str, Any] = {
    "mem_fraction_static": 0.88,
    "max_total_tokens": None,
    "max_running_requests": 256,
    "chunked_prefill_size": 8192,
    "page_size": 16,
    "disable_cuda_graph": False,
    "cuda_graph_max_bs": 256,
    "context_length": None,
    "dtype": "auto",
}
DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2}  # SGLang's --dtype names
FRACTION = "rollout.engine_args.mem_fraction_static"


def engine_arg(s: Setup, name: str) -> Any:
    """`rollout.engine_args[name]`; unset, what the launcher sizes to the batch (rlx's engine: its
    running cap and largest decode graph), else the local engine's default."""
    from rlx.rollout.launchers import engine_args_for_batch

    value = s.rollout.engine_args.get(name)
    if value is None:
        value = engine_args_for_batch(s.rollout).get(name)
    return ENGINE_DEFAULTS.get(name) if value is None else value


def dtype_name(s: Setup) -> str:
    """The engine's weight dtype: `engine_args.dtype`; else ("auto") a half-precision checkpoint's
    own, and an fp32 checkpoint (a tiny or random model) in the trainer's precision
    (`LocalLauncher.for_run`; SGLang would serve it in fp16, of the same size)."""
    dtype = engine_arg(s, "dtype")
    if dtype != "auto":
        return dtype
    if DTYPE_BYTES.get(s.checkpoint_dtype or "float32", 4) == 2:
        return s.checkpoint_dtype
    return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[s.train.precision]


def dtype_bytes(s: Setup) -> int:
    return DTYPE_BYTES.get(dtype_name(s), 2)


def kv_bytes_per_token(s: Setup) -> int:
    """KV cache bytes one token takes on one of the engine's GPUs (`kv_cache_dtype` fp8_*: 1 byte)."""
    m, tp = s.model, s.rollout.gpus_per_engine
    e = 1 if str(s.rollout.engine_args.get("kv_cache_dtype", "auto")).startswith("fp8") else dtype_bytes(s)
    if m.kv_lora_rank:
        return m.num_layers * (m.kv_lora_rank + (m.qk_pos_emb_head_dim or 0)) * e
    return 2 * m.num_layers * max(m.num_query_groups // tp, 1) * m.kv_channels * e


def kv_cache(s: Setup, budget_bytes: int) -> tuple[int, int]:
    """(bytes, tokens) of the KV cache a budget of `budget_bytes` buys, in blocks of `page_size`
    tokens as the local engine allocates them (`rlx.engine.kv_cache.num_blocks_for_budget`: capped
    by max_total_tokens and by every running request at full context, plus one reserved block)."""
    from rlx.engine.kv_cache import num_blocks_for_budget  # the engine's own arithmetic

    page = engine_arg(s, "page_size")
    per_block = kv_bytes_per_token(s) * page
    context = engine_arg(s, "context_length") or s.model.max_position_embeddings
    most_useful = engine_arg(s, "max_running_requests") * -(-context // page)
    blocks = num_blocks_for_budget(
        max(budget_bytes, 0), per_block, page, engine_arg(s, "max_total_tokens"), most_useful
    )
    return blocks * per_block, (blocks - 1) * page


def layer_workspace_bytes(s: Setup, tokens: int) -> int:
    """One layer's intermediates for `tokens` tokens on one engine GPU (q/k/v, attention output,
    the MLP's gate and up projections and its activation, a few hidden-sized tensors)."""
    m, tp = s.model, s.rollout.gpus_per_engine
    heads = (2 * m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels  # q, k, v; attention output
    ffn = m.moe_router_topk * (m.moe_ffn_hidden_size or 0) if m.num_moe_experts else m.ffn_hidden_size
    return tokens * (heads // tp + 3 * ffn // tp + 4 * m.hidden_size) * dtype_bytes(s)


def cache_budget(s: Setup, loaded: list[Term], gpu_bytes: int) -> int:
    """The bytes the engine gives its KV cache: its fraction of the GPU less what is in use (`loaded`)."""
    return round(engine_arg(s, "mem_fraction_static") * gpu_bytes) - sum(t.bytes for t in loaded)


def before_cache(s: Setup, p: ModelParams, others: list[Term]) -> list[Term]:
    """What is on an engine GPU when the engine sizes its KV cache: `others` (a colocated trainer's
    leftovers), the engine's weights and its CUDA context."""
    weights_n = engine_params(p, s.rollout.gpus_per_engine)
    weights = Term(
        f"engine weights ({dtype_name(s)}, {count(weights_n)} parameters)", weights_n * dtype_bytes(s),
        ("rollout.gpus_per_engine",),
    )  # fmt: skip
    return [*others, weights, Term("CUDA context (engine)", CUDA_CONTEXT_BYTES)]


def engine_terms(s: Setup, p: ModelParams, others: list[Term], gpu_bytes: int | None) -> list[Term]:
    """What one engine GPU holds while generating, `others` (a colocated trainer's leftovers)
    included; the KV cache sized from `gpu_bytes` (None: unknown, the cache left out)."""
    loaded = before_cache(s, p, others)
    fraction = engine_arg(s, "mem_fraction_static")
    if gpu_bytes is None:
        kv = Term(f"KV cache (mem_fraction_static {fraction} of a GPU of unknown size: not counted)", 0)
    else:
        num_bytes, tokens = kv_cache(s, cache_budget(s, loaded, gpu_bytes))
        samples = tokens // max(s.sample_len, 1)
        cap, page = engine_arg(s, "max_total_tokens"), engine_arg(s, "page_size")
        by = f"mem_fraction_static {fraction}"
        if cap is not None and tokens == -(-cap // page) * page:  # the cap, not the fraction, sized it
            by = f"max_total_tokens {cap:,}"
        kv = Term(f"KV cache ({by}: {tokens:,} tokens, {samples:,} samples)", num_bytes, (FRACTION,))
    terms = [*loaded, kv, *graphs_term(s)]
    chunk, rows = engine_arg(s, "chunked_prefill_size"), engine_arg(s, "max_running_requests")
    workspace = layer_workspace_bytes(s, chunk) + rows * s.model.vocab_size * 4
    terms.append(Term(f"workspace (prefill chunks of {chunk:,} tokens, {rows} rows' logits)", workspace,
                      ("rollout.engine_args.chunked_prefill_size", "rollout.engine_args.max_running_requests")))  # fmt: skip
    return terms


def requests_tokens(running: int, page: int, prompt_len: int, r: RolloutConfig) -> int:
    """KV tokens of `running` requests at full length: `prompt_len` plus the longest response
    (evaluation's included), in whole pages of `page` tokens. What a colocated engine's cache is
    sized to (`rlx.config.memory_check.size_engine_cache`), so that none is ever preempted."""
    longest = prompt_len + max(r.max_response_len, r.eval_max_response_len or 0)
    return running * -(-longest // page) * page


def resident_terms(s: Setup, engine: list[Term]) -> list[Term]:
    """What a colocated engine holds while the trainer trains where nothing is released
    (`cluster.release_memory=false`): its `engine` terms of the generating phase, the KV cache
    as the run sizes it (`rlx.config.memory_check.size_engine_cache`: every running request at
    the longest prompt and response, in pages, and a reserved block; at most what its fraction gave)."""
    page = engine_arg(s, "page_size")
    tokens = requests_tokens(engine_arg(s, "max_running_requests"), page, s.prompt_len, s.rollout)
    sized = (tokens // page + 1) * page * kv_bytes_per_token(s)
    return [
        Term(
            f"KV cache (resident: {tokens:,} tokens, the running requests at full length)",
            min(sized, t.bytes),
        )
        if t.name.startswith("KV cache")
        else t
        for t in engine
    ]


def kv_tokens(s: Setup, p: ModelParams, others: list[Term], gpu_bytes: int) -> int:
    """The tokens the engine's KV cache holds beside `others` (the reserved block excluded)."""
    return kv_cache(s, cache_budget(s, before_cache(s, p, others), gpu_bytes))[1]


def graphs_term(s: Setup) -> list[Term]:
    """The decode CUDA graphs' memory pool, when the engine captures graphs."""
    if engine_arg(s, "disable_cuda_graph"):
        return []
    bs = engine_arg(s, "cuda_graph_max_bs")
    graphs = bs * s.model.vocab_size * 4 + layer_workspace_bytes(s, bs)
    return [
        Term(f"CUDA graphs (decode batches up to {bs})", graphs, ("rollout.engine_args.cuda_graph_max_bs",))
    ]


def released_term(s: Setup) -> list[Term]:
    """What a colocated engine keeps while it has released its memory to the trainer: its CUDA
    context, and its decode graphs' pool unless `enable_memory_saver=false` (with the saver the
    graphs survive the release: rlx's engine keeps them, SGLang's may; without it rlx's free
    them). The weights and KV cache are given back."""
    context = Term("CUDA context (engine, released)", CUDA_CONTEXT_BYTES)
    if s.rollout.engine_args.get("enable_memory_saver") is False:
        return [context]
    return [context, *(replace(t, name=t.name + ", kept while released") for t in graphs_term(s))]
