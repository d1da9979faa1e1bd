"""The trainer's terms of the memory plan: what one trainer rank holds, per pipeline stage.

What the trainer builds (`rlx.trainer.trainable.wrap_for_training`, `rlx.trainer.megatron`):

- the policy's weights in `train.precision` (bf16: megatron's Float16Module casts every
  parameter, norms included, to bf16);
- megatron DDP's gradient buffer, fp32 whatever the precision (`grad_reduce_in_fp32=True`), whole
  on every rank, also under the distributed optimizer (which reduce-scatters into it);
- the optimizer's state: Adam's two moments in fp32, and in bf16/fp16 an fp32 master copy of every
  weight (12 bytes a parameter; fp32 training: 8); `train.distributed_optimizer=true` shards it
  over the data- and context-parallel ranks (experts: over the expert-data-parallel ranks);
- the reference model's weights (algorithms with a KL term) and PPO's critic (weights, gradient
  buffer, optimizer state; its activations, without logits, never exceed the policy's and come
  at another time of the step);
- activations (`rlx.memory.activations`) of the micro-batches a stage holds at once: under
  megatron's 1F1B schedule stage r of P keeps min(P - r, micro-batches) of them (the first stage
  P, i.e. all layers' worth), with virtual stages Korthikanti's L·(1 + (P - 1)/(P·V)) on the first;
- on the last stage, the logits of one micro-batch (this rank's vocabulary shard, activation
  dtype), their gradient written over them (with sequence parallelism beside them: two copies);
- in the forward-only passes (old and reference log-probs, the critic's values), which keep no
  activations: that micro-batch's logits and one layer's activations at a time;
- in the optimizer step, with `train.adam_fused=false`, torch's multi-tensor Adam's temporary sqrt(v)
  (fp32, the size of the state; the fused Adam, the default, holds none).

Predicted is torch's allocated memory (`torch.cuda.max_memory_allocated`, which the loop logs as
`perf/trainer_peak_mem_gib`), plus the process's CUDA context. Not counted: the caching
allocator's reserve beyond it (fragmentation), NCCL's buffers, small temporaries (norms' fp32
statistics, gradient clipping's norms), and an unbalanced MoE routing.
"""

from __future__ import annotations

from rlx.memory.activations import Layout, MicroBatch, layer_bytes, logits_bytes, mask_bytes
from rlx.memory.params import ModelParams, RankParams, lora_params, rank_params, stage_layers
from rlx.memory.terms import CUDA_CONTEXT_BYTES, PRECISION_BYTES, Phase, Setup, Term, count
from rlx.rollout.launchers import flat_tensor_buckets

GRAD_BYTES = 4  # megatron DDP's gradient buffer is fp32 (grad_reduce_in_fp32=True)
TP, PP, CP = "cluster.tensor_parallel_size", "cluster.pipeline_parallel_size", "cluster.context_parallel_size"


def optimizer_bytes_per_param(precision: str) -> int:
    """Adam's m and v in fp32, plus an fp32 master weight when the model is half precision."""
    return 8 if precision == "fp32" else 12


def micro_batch_key(s: Setup, forward_only: bool = False) -> str:
    """The key that sets the size of a (training, or forward-only) micro-batch."""
    t = s.train
    if forward_only:
        if t.max_tokens_per_micro_batch is not None:
            return "train.logprob_max_tokens_per_micro_batch"
        return "train.logprob_micro_batch_size"
    return (
        "train.max_tokens_per_micro_batch"
        if t.max_tokens_per_micro_batch is not None
        else "train.micro_batch_size"
    )


def micro_batch(s: Setup, forward_only: bool = False) -> MicroBatch:
    """The largest micro-batch the trainer makes: `rows` samples of the longest sample (right-padded
    to the pad multiple), or one packed row of the token budget."""
    from rlx.trainer.batch import pad_multiple  # the trainer's own padding rule

    c, t = s.cluster, s.train
    pad = pad_multiple(c.tensor_parallel_size, c.context_parallel_size)
    budget = t.max_tokens_per_micro_batch
    if forward_only and t.logprob_max_tokens_per_micro_batch is not None:
        budget = t.logprob_max_tokens_per_micro_batch
    if budget is not None:
        return MicroBatch(1, -(-budget // pad) * pad, packed=True)
    rows = (t.logprob_micro_batch_size if forward_only else None) or t.micro_batch_size
    return MicroBatch(rows, -(-s.sample_len // pad) * pad)


def layout(s: Setup) -> Layout:
    m, c = s.model, s.cluster
    moe_or_mla = bool(m.num_moe_experts or m.kv_lora_rank)
    sp = m.megatron_overrides.get("sequence_parallel", bool(m.num_moe_experts) and c.tensor_parallel_size > 1)
    return Layout(
        tp=c.tensor_parallel_size,
        cp=c.context_parallel_size,
        sequence_parallel=bool(sp),
        dtype_bytes=PRECISION_BYTES[s.train.precision],
        # MoE and MLA families keep megatron's unfused layers (rlx.models.moe_family.fusion_kwargs)
        fused_swiglu=not moe_or_mla and m.kernels != "torch",
    )


def micro_batches_per_step(s: Setup) -> int:
    """A rank's micro-batches per optimizer step (packed: as many as samples of the longest length need)."""
    t = s.train
    samples = max(t.global_batch_size // s.data_parallel_size, 1)
    if t.max_tokens_per_micro_batch is not None:
        return -(-samples * s.sample_len // t.max_tokens_per_micro_batch)
    return max(samples // t.micro_batch_size, 1)


def in_flight(s: Setup, stage: int) -> tuple[int, str]:
    """(layers x micro-batches, in words) whose activations stage `stage` holds at once under
    megatron's schedule: 1F1B's warm-up keeps min(P - stage, M) micro-batches of the stage's layers;
    the interleaved one (V virtual stages) min(2(P - stage - 1) + (V - 1)P + 1, M·V) chunks of
    L / (P·V) layers."""
    pp, num_layers = s.cluster.pipeline_parallel_size, s.model.num_layers
    vp = s.model.megatron_overrides.get("virtual_pipeline_model_parallel_size") or 1
    m = micro_batches_per_step(s)
    if vp == 1:
        layers, mbs = len(stage_layers(num_layers, pp, stage)), min(pp - stage, m)
        return layers * mbs, f"{layers} layers" + (f" × {mbs} micro-batches" if mbs > 1 else "")
    chunks, chunk_layers = min(2 * (pp - stage - 1) + (vp - 1) * pp + 1, m * vp), num_layers // (pp * vp)
    return chunks * chunk_layers, f"{chunks} chunks of {chunk_layers} layers in flight"


def rank_share(s: Setup, p: ModelParams, stage: int, *, value_head: bool = False) -> RankParams:
    """A trainer rank's share of `p` (of PPO's critic with `value_head`) under the cluster's layout."""
    c = s.cluster
    return rank_params(
        p, tp=c.tensor_parallel_size, pp=c.pipeline_parallel_size, ep=c.expert_parallel_size, stage=stage,
        value_head=value_head,
    )  # fmt: skip


def static_terms(s: Setup, p: ModelParams, stage: int, *, gradients: bool = True) -> list[Term]:
    """What the rank holds all step: weights, gradient buffer, optimizer state; reference; critic.
    `gradients=False`: without the gradient buffers (a colocated trainer frees them for the engine)."""
    t = s.train
    e = PRECISION_BYTES[t.precision]
    policy = rank_share(s, p, stage)
    trainable = trainable_params(s, policy, stage)
    terms = [
        Term(f"policy weights ({t.precision}, {count(policy.total)} parameters)", policy.total * e, (TP, PP))
    ]
    if gradients:
        what = f"LoRA adapters' {count(trainable.total)} parameters" if t.lora.enabled else "fp32 grad buffer"
        terms.append(Term(f"gradients ({what})", trainable.total * GRAD_BYTES, (TP, PP)))
    terms.append(optimizer_term(s, trainable, "optimizer state"))
    if s.needs_ref and not t.lora.enabled:  # under LoRA the reference is the base: no copy
        terms.append(Term(f"reference model ({t.precision} weights)", policy.total * e, (TP, PP)))
    if s.needs_critic:
        critic = rank_share(s, p, stage, value_head=True)
        kept = critic.total * (e + GRAD_BYTES * gradients) + optimizer_term(s, critic, "").bytes
        what = "weights, gradients, optimizer state" if gradients else "weights, optimizer state"
        terms.append(Term(f"critic ({what})", kept, (TP, PP)))
    return terms


def trainable_params(s: Setup, policy: RankParams, stage: int) -> RankParams:
    """The rank's parameters that have a gradient buffer and optimizer state: all of the policy's,
    or under LoRA (train.lora) its adapters alone (rlx.memory.params.lora_params): the frozen base
    keeps its weights but no gradient buffer, no optimizer state and no step temporary."""
    if not s.train.lora.enabled:
        return policy
    c = s.cluster
    return lora_params(
        s.model, s.train.lora, tp=c.tensor_parallel_size, pp=c.pipeline_parallel_size,
        ep=c.expert_parallel_size, stage=stage,
    )  # fmt: skip


def optimizer_term(s: Setup, params: RankParams, name: str) -> Term:
    c, t = s.cluster, s.train
    per_param = optimizer_bytes_per_param(t.precision)
    what = "Adam m, v" if t.precision == "fp32" else "fp32 master + Adam m, v"
    dense_shards = expert_shards = 1
    if t.distributed_optimizer:
        dense_shards = max(c.num_trainer_procs // (c.tensor_parallel_size * c.pipeline_parallel_size), 1)
        expert_shards = max(
            c.num_trainer_procs
            // (c.tensor_parallel_size * c.expert_parallel_size * c.pipeline_parallel_size),
            1,
        )
    num_bytes = round(per_param * (params.dense / dense_shards + params.expert / expert_shards))
    sharded = f"; a 1/{dense_shards} shard" if dense_shards > 1 else ""
    return Term(f"{name} ({what}{sharded})", num_bytes, optimizer_knobs(s))


def optimizer_knobs(s: Setup) -> tuple[str, ...]:
    """What shrinks the optimizer state: sharding it, where there are data-parallel ranks to share it."""
    c = s.cluster
    shardable = not s.train.distributed_optimizer and s.data_parallel_size * c.context_parallel_size > 1
    return ("train.distributed_optimizer=true", TP, PP) if shardable else (TP, PP)


def training_terms(s: Setup, p: ModelParams, stage: int) -> list[Term]:
    """What a training micro-batch adds: activations of the micro-batches in flight, packed masks,
    on the last stage the logits and their gradient."""
    lay, mb = layout(s), micro_batch(s)
    key, recompute = micro_batch_key(s), s.train.recompute
    layers, held = in_flight(s, stage)
    stage_moe = [p.moe_layers[i] for i in stage_layers(p.num_layers, s.cluster.pipeline_parallel_size, stage)]
    frac_moe = sum(stage_moe) / len(stage_moe)
    per_layer = (1 - frac_moe) * layer_bytes(s.model, lay, mb, moe=False, recompute=recompute)
    per_layer += frac_moe * layer_bytes(s.model, lay, mb, moe=True, recompute=recompute)
    shape = f"{mb.rows} × {mb.seq_len:,} tokens" if not mb.packed else f"packed {mb.seq_len:,}-token rows"
    act_knobs = (key, "train.recompute=full", CP, TP)
    terms = [Term(f"activations ({shape}, {held})", round(per_layer * layers), act_knobs)]
    if recompute == "full":  # the layer being rebuilt in the backward holds all of its activations
        whole = layer_bytes(s.model, lay, mb, moe=frac_moe >= 0.5)
        terms.append(Term("activations of the layer being recomputed", whole, act_knobs))
    if mb.packed:
        # the micro-batches in flight, each with its own mask (packing runs 1F1B only: no virtual stages)
        mbs = layers // len(stage_moe)
        terms.append(Term("packed attention masks (boolean, L × L)", mask_bytes(mb, lay.cp) * mbs, (key, CP)))
    if stage == s.cluster.pipeline_parallel_size - 1:
        # the backward writes the gradient over the logits (rlx.trainer.logprobs); under sequence
        # parallelism GPTModel's batch-first copy of them and the output layer's contiguous copy of
        # the gradient make it two (rlx.trainer.logits_layout)
        logits = logits_bytes(s.model, mb, tp=lay.tp, cp=lay.cp, dtype_bytes=lay.dtype_bytes)
        copies, name = (
            (2, "logits and their gradient")
            if lay.sequence_parallel
            else (1, "logits, their gradient written over them")
        )
        vocab = f"{s.model.vocab_size // lay.tp:,}-way vocabulary shard"
        terms.append(Term(f"{name} ({vocab})", copies * logits, (key, TP, CP)))
    return terms


def forward_only_terms(s: Setup, p: ModelParams, stage: int) -> list[Term]:
    """What a forward-only micro-batch adds: one layer's activations at a time, the last stage's logits."""
    lay, mb = layout(s), micro_batch(s, forward_only=True)
    key = micro_batch_key(s, forward_only=True)
    moe = any(p.moe_layers)
    shape = (
        f"{mb.rows} × {mb.seq_len:,} tokens" if not mb.packed else f"a packed row of {mb.seq_len:,} tokens"
    )
    terms = [Term(f"one layer's activations ({shape})", layer_bytes(s.model, lay, mb, moe=moe), (key,))]
    if mb.packed:
        terms.append(Term("packed attention mask (boolean, L × L)", mask_bytes(mb, lay.cp), (key, CP)))
    if stage == s.cluster.pipeline_parallel_size - 1:
        logits = logits_bytes(s.model, mb, tp=lay.tp, cp=lay.cp, dtype_bytes=lay.dtype_bytes)
        terms.append(Term("logits (forward only)", logits, (key, TP)))
    return terms


def context_term(who: str) -> Term:
    return Term(f"CUDA context ({who})", CUDA_CONTEXT_BYTES)


def step_terms(s: Setup, p: ModelParams, stage: int) -> list[Term]:
    """What the optimizer step adds: nothing with torch's fused Adam (`train.adam_fused`, the
    default); torch's multi-tensor Adam (megatron's fallback without apex) computes sqrt(v) for all
    of its weights at once, one fp32 temporary of the state's size; with `train.adam_foreach=false`,
    of one tensor at a time (the largest one's)."""
    if s.train.adam_fused:
        return []
    trainable = trainable_params(s, rank_share(s, p, stage), stage)
    moments = optimizer_term(s, trainable, "").bytes * 4 // optimizer_bytes_per_param(s.train.precision)
    if not s.train.adam_foreach:
        one = min(moments, largest_tensor(s, stage) * 4)
        return [
            Term(
                "Adam's step temporary (sqrt of v of its largest tensor, fp32)",
                one,
                ("train.adam_fused=true", "train.adam_foreach"),
            )
        ]
    knobs = (*optimizer_knobs(s), "train.adam_fused=true", "train.adam_foreach=false")
    return [Term("Adam's step temporary (sqrt of v, fp32)", moments, knobs)]


def largest_tensor(s: Setup, stage: int) -> int:
    """Elements of the largest weight a rank of pipeline stage `stage` holds: the vocabulary's
    shard (embedding on the first stage, output layer on the last), else a layer's largest matrix
    (the gated MLP's fc1, an expert's, the fused QKV), each split over TP. The distributed
    optimizer's shard of a tensor is no larger."""
    m, c = s.model, s.cluster
    tp, pp = c.tensor_parallel_size, c.pipeline_parallel_size
    h = m.hidden_size
    head_dim = m.kv_channels or h // m.num_attention_heads
    heads = (m.num_attention_heads + 2 * (m.num_query_groups or m.num_attention_heads)) * head_dim
    candidates = [2 * m.ffn_hidden_size * h // tp, heads * h // tp]
    if m.num_moe_experts:
        # an expert's fc1: experts are split over EP, each one whole
        candidates.append(2 * (m.moe_ffn_hidden_size or m.ffn_hidden_size) * h)
    if stage == 0 or stage == pp - 1:
        candidates.append(m.vocab_size * h // tp)
    return max(candidates)


def trainer_phases(s: Setup, p: ModelParams, stage: int, *, context: bool = True) -> tuple[Phase, ...]:
    """(training, forward-only passes, optimizer step) of a rank of pipeline stage `stage`;
    `context=False`: torch's allocated memory alone, without the process's CUDA context."""
    static, context = static_terms(s, p, stage), [context_term("trainer")] * context
    return (
        Phase("training", tuple(static + training_terms(s, p, stage) + context)),
        Phase("forward-only passes", tuple(static + forward_only_terms(s, p, stage) + context)),
        Phase("optimizer step", tuple(static + step_terms(s, p, stage) + context)),
    )


def resident_while_generating(s: Setup, p: ModelParams, stage: int) -> list[Term]:
    """What a colocated trainer rank leaves on the GPU while its engine generates: its CUDA context,
    and with `cluster.offload_trainer=false` its weights and optimizer state (the gradient buffer and
    the allocator's cache are freed: `rlx.trainer.offload`), or with `cluster.release_memory=false`
    everything its largest phase holds (nothing is released: `rlx.colocation`)."""
    if s.cluster.offload_trainer:
        return [context_term("trainer, offloaded to CPU")]
    if s.cluster.release_memory is False:
        peak = max(trainer_phases(s, p, stage), key=lambda phase: phase.bytes)
        knob = ("cluster.release_memory=true",)
        return [
            t
            if t.name.startswith("CUDA context")
            else Term(
                f"trainer's {t.name.split(' (')[0].split(',')[0]} (kept at its {peak.name} peak)",
                t.bytes,
                knob,
            )
            for t in peak.terms
        ]
    kept = static_terms(s, p, stage, gradients=False)
    knob = ("cluster.offload_trainer=true",)
    return [Term(f"trainer's {t.name.split(' (')[0]}, kept on the GPU", t.bytes, knob) for t in kept] + [
        context_term("trainer")
    ]


def resident_while_syncing(s: Setup, p: ModelParams, stage: int) -> list[Term]:
    """What a colocated trainer rank holds while its engine takes the new weights
    (`rlx.colocation.GpuTurns.publish`): its parameters (the policy's, which the sync reads; the
    reference's and the critic's), the sync's bucket of gathered tensors and its CUDA context. Its
    gradients and optimizer state left before the engine's weights came back. With
    `cluster.offload_trainer=false`, what it keeps while generating, and the bucket: twice where
    the engines read a bucket as one flat buffer (rlx's: `flat_tensor_buckets`), the gathered
    tensors and their flat copy."""
    flat = s.rollout.weight_sync in ("auto", "tensor") and flat_tensor_buckets(s.rollout)
    what = "gathered tensors, and their flat copy" if flat else "gathered tensors"
    bucket = Term(f"weight sync bucket ({what})", (1 + flat) * s.rollout.weight_bucket_mb * 2**20,
                  ("rollout.weight_bucket_mb",))  # fmt: skip
    if not s.cluster.offload_trainer:
        return [*resident_while_generating(s, p, stage), bucket]
    t = s.train
    e = PRECISION_BYTES[t.precision]
    policy = rank_share(s, p, stage).total * e
    terms = [Term(f"trainer's policy weights ({t.precision}), read by the sync", policy, (TP, PP))]
    if s.needs_ref and not t.lora.enabled:
        terms.append(Term(f"trainer's reference model ({t.precision} weights)", policy, (TP, PP)))
    if s.needs_critic:
        critic = rank_share(s, p, stage, value_head=True).total * e
        terms.append(Term(f"trainer's critic weights ({t.precision})", critic, (TP, PP)))
    return [*terms, bucket, context_term("trainer")]
