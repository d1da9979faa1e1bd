"""The per-GPU memory plan of a run, and its refusal of a run that cannot fit.

`plan_memory` lays the trainer's and the engines' terms (`rlx.memory.trainer`, `rlx.memory.engine`)
onto the run's kinds of GPU: a trainer GPU (under pipeline parallelism two: the first stage holds
the most activations, the last the logits; the stages between hold less than the first), an engine
GPU, or, colocated, one GPU that holds the trainer while it trains and the engine while it generates
(each beside what the other leaves behind). `memory_errors` refuses a plan whose peak on some GPU
exceeds the GPU's memory, or whose engines' KV cache cannot hold one sample, with one message per
GPU kind: the predicted and available GiB, the largest terms, and the settings that make it fit
(each tried on the plan: "set train.micro_batch_size=4 (the plan then predicts 61.2 GiB)").
"""

from __future__ import annotations

import math
from dataclasses import replace

from rlx.memory.engine import (
    FRACTION,
    before_cache,
    engine_arg,
    engine_terms,
    kv_bytes_per_token,
    kv_tokens,
    released_term,
    resident_terms,
)
from rlx.memory.params import ModelParams, model_params
from rlx.memory.terms import GIB, Phase, Plan, Role, Setup, count, gib
from rlx.memory.trainer import resident_while_generating, resident_while_syncing, trainer_phases

PLAN_ONLY = "`python launch.py ... run.plan_only=true` prints the whole plan"
TIGHT = 0.10  # less spare than this share of a GPU is flagged in the printed plan


def plan_memory(
    s: Setup, gpu_bytes: int | None, gpu_source: str = "", params: ModelParams | None = None
) -> Plan:
    """Every GPU kind of the run `s` and its phases, against GPUs of `gpu_bytes` (None: unknown);
    `params`: `s.model`'s, when the caller has them already."""
    p, c = params or model_params(s.model), s.cluster
    pp = c.pipeline_parallel_size
    stages = {0: "first pipeline stage", pp - 1: "last pipeline stage"} if pp > 1 else {0: ""}
    roles = []
    for stage, where in stages.items() if s.with_trainer else ():
        trainer = trainer_phases(s, p, stage)
        ranks = c.num_trainer_procs // pp
        if c.colocate and s.with_engines:
            resident = resident_while_generating(s, p, stage)
            generating = engine_terms(s, p, resident, gpu_bytes)
            if no_turns(s):  # the engines stay whole while the trainer trains and the weights cross
                released = resident_terms(s, generating[len(resident) :])
                syncing = [*resident_while_syncing(s, p, stage), *released]
            else:
                released = released_term(s)
                syncing = before_cache(s, p, resident_while_syncing(s, p, stage))  # the engine's weights back
            phases = (
                *(Phase(t.name, (*t.terms, *released)) for t in trainer),
                Phase("weight sync", tuple(syncing)),
                Phase("generating", tuple(generating)),
            )
            name = "colocated GPU (trainer rank + engine" + (f", {where})" if where else ")")
            roles.append(Role(name, ranks, phases, kind="colocated"))
        else:
            roles.append(Role("trainer GPU" + (f" ({where})" if where else ""), ranks, trainer))
    if s.with_engines and not (c.colocate and s.with_trainer):
        engine = Phase("generating", tuple(engine_terms(s, p, [], gpu_bytes)))
        roles.append(Role("engine GPU", c.num_rollout_gpus, (engine,), kind="engine"))
    return Plan(tuple(roles), gpu_bytes, gpu_source, headline(s, p.total), notes(s) + tight(roles, gpu_bytes))


def no_turns(s: Setup) -> bool:
    """Colocated with `cluster.release_memory=false` (the trainer's state kept): trainer and engines
    stay whole on their GPUs, nothing released or moved at a hand-over (`rlx.colocation`)."""
    c = s.cluster
    return c.colocate and c.offload_trainer is False and c.release_memory is False


def offload_decision(s: Setup, gpu_bytes: int | None) -> tuple[bool, str]:
    """`cluster.offload_trainer=auto`: (offload, why). The trainer's state stays on the GPU (no
    copies over PCIe at each hand-over) where, planned so, every GPU fits with `cluster.memory_margin`
    free and each engine's KV cache holds its share of a step's samples at full length (a smaller
    cache would make the rollout wait for room); else it goes to the host while the engines generate."""
    c = s.cluster
    if not (c.colocate and s.with_trainer and s.with_engines):
        return True, apart(s)
    if gpu_bytes is None:
        return True, "offloaded: the GPU's memory is unknown here (cluster.gpu_memory_gib sets it)"
    fits, tokens, step = kept_fits(replace(s, cluster=replace(c, offload_trainer=False)), gpu_bytes)
    if not fits:
        return (
            True,
            "offloaded: kept on the GPU, it would not fit (run.plan_only=true with cluster.offload_trainer=false says why)",
        )
    if tokens < step:
        return True, (
            f"offloaded: kept on the GPU, it would leave each engine's KV cache {tokens:,} tokens, fewer than its "
            f"share of a step's samples ({step:,})"
        )
    return False, (
        f"kept on the GPU: beside it each engine's KV cache holds {tokens:,} tokens, its share of a step's "
        f"samples {step:,}"
    )


def release_decision(s: Setup, gpu_bytes: int | None) -> tuple[bool, str]:
    """`cluster.release_memory=auto`, for a trainer whose state stays on the GPU (`offload_trainer`
    decided false): (release, why). Nothing is released at a hand-over (the engines keep their
    weights and KV caches, the trainer its gradient buffers and activation memory: `no_turns`)
    where, planned so, every GPU fits and each engine's KV cache beside the trainer's training
    peak holds its share of a step's samples at full length, as `offload_decision`'s rule."""
    c = s.cluster
    if not (c.colocate and s.with_trainer and s.with_engines):
        return True, apart(s)
    if c.offload_trainer is not False:
        return True, "released: the trainer's state is offloaded while the engines generate"
    if gpu_bytes is None:
        return True, "released: the GPU's memory is unknown here (cluster.gpu_memory_gib sets it)"
    fits, tokens, step = kept_fits(replace(s, cluster=replace(c, release_memory=False)), gpu_bytes)
    if not fits:
        return True, "released: trainer and engines would not fit resident together"
    if tokens < step:
        return True, (
            f"released: beside the trainer's training peak each engine's KV cache would hold {tokens:,} tokens, "
            f"fewer than its share of a step's samples ({step:,})"
        )
    return False, (
        f"nothing released: trainer and engines stay resident, the weight sync is the whole hand-over; beside "
        f"the trainer's training peak each engine's KV cache holds {tokens:,} tokens, its share of a step's "
        f"samples {step:,}"
    )


def apart(s: Setup) -> str:
    """Why trainer and engines never hand a GPU over: not colocated, or one side runs alone."""
    if not s.cluster.colocate:
        return "not colocated"
    alone = "the engines run" if s.with_engines else "the trainer runs"
    return f"no hand-over: {alone} alone (debug.rollout_only / debug.train_only)"


def kept_fits(kept: Setup, gpu_bytes: int) -> tuple[bool, int, int]:
    """For `kept`, a colocated run keeping more of the trainer on the GPU: whether its plan fits every
    GPU, the tokens each engine's KV cache then holds beside the trainer, and an engine's share of a
    step's samples in tokens (`step_tokens`)."""
    if memory_errors(kept, plan_memory(kept, gpu_bytes)):
        return False, 0, step_tokens(kept)
    return True, kept_kv_tokens(kept, gpu_bytes), step_tokens(kept)


def step_tokens(s: Setup) -> int:
    """An engine's share of a step's samples, each at the longest length the plan counts."""
    r = s.rollout
    return math.ceil(r.batch_size * r.n_samples_per_prompt / max(r.num_engines, 1)) * s.sample_len


def kept_kv_tokens(s: Setup, gpu_bytes: int) -> int:
    """The tokens each colocated engine's KV cache holds beside a trainer kept on the GPU (its
    weights and optimizer state, or with `release_memory=false` its training peak:
    `resident_while_generating`): the cap `rlx.config.memory_check`
    gives the engines, which size their caches from the memory free when they start, before the
    trainer's first step allocates its optimizer state."""
    kept = replace(s, cluster=replace(s.cluster, offload_trainer=False))
    p = model_params(s.model)
    return kv_tokens(kept, p, resident_while_generating(kept, p, 0), gpu_bytes)


def tight(roles: list[Role], gpu_bytes: int | None) -> tuple[str, ...]:
    """A warning for each GPU kind whose trainer fits with less than TIGHT to spare, the plan being
    approximate. (An engine's KV cache fills the share of the GPU it is given, by design.)"""
    if gpu_bytes is None:
        return ()
    found = []
    for role in roles:
        peak = trainer_peak(role)
        if peak and (1 - TIGHT) * gpu_bytes < peak <= gpu_bytes:
            found.append(
                f"{role.name}: the trainer's peak leaves {1 - peak / gpu_bytes:.0%} of the GPU: too little "
                "for an estimate (it read 1-14% below the peaks measured so far, and fragmentation comes on top: "
                "docs/benchmarks.md); give it more room"
            )
    return tuple(found)


def headline(s: Setup, num_params: int) -> str:
    c, t = s.cluster, s.train
    sizes = f"TP={c.tensor_parallel_size} PP={c.pipeline_parallel_size} CP={c.context_parallel_size}"
    sizes += f" EP={c.expert_parallel_size} DP={s.data_parallel_size}"
    placement = "colocated" + (
        ", trainer offloaded while generating"
        if c.offload_trainer
        else ", trainer and engines resident (nothing released)"
        if no_turns(s)
        else ", trainer kept on the GPU"
    )
    gpus = lambda n, what: f"{n} {what} GPU" + "s" * (n != 1)  # noqa: E731
    split = f"split: {gpus(c.num_trainer_procs, 'trainer')} + {gpus(c.num_rollout_gpus, 'engine')}"
    placement = placement if c.colocate else split
    return (
        f"{s.model.name} ({count(num_params)} parameters), {t.precision}"
        f"{', distributed optimizer' if t.distributed_optimizer else ''}, {sizes}, {placement}"
    )


def notes(s: Setup) -> tuple[str, ...]:
    found = []
    if s.prompt_len == 0:
        found.append(
            f"samples counted as rollout.max_response_len={s.rollout.max_response_len} tokens: data.max_prompt_len "
            "is unset, so prompt tokens are not counted (set it to count them)"
        )
    if s.train.max_tokens_per_micro_batch is not None:
        found.append(
            "packed micro-batches: the L x L mask terms are the plan's least certain (not yet measured)"
        )
    found.append(
        "approximate (rlx/memory/: formulas and assumptions); torch's allocated memory and CUDA contexts, "
        "not the caching allocator's slack"
    )
    return tuple(found)


def trainer_peak_allocated(s: Setup, stage: int = 0) -> int:
    """A trainer rank's predicted peak of `torch.cuda.max_memory_allocated()`: its largest phase,
    less its CUDA context. Stage 0 holds rank 0, whose figure the loop logs (perf/trainer_peak_mem_gib)."""
    return max(phase.bytes for phase in trainer_phases(s, model_params(s.model), stage, context=False))


# ---- refusal ------------------------------------------------------------------------------------


def memory_errors(s: Setup, plan: Plan) -> list[str]:
    """One message per GPU kind whose peak exceeds the GPU's memory, whose trainer leaves less of it
    free than `cluster.memory_margin`, or whose engines' KV cache cannot hold one sample; [] when
    the GPU's memory is unknown."""
    if plan.gpu_bytes is None:
        return []
    errors = []
    for index, role in enumerate(plan.roles):
        if role.peak.bytes > plan.gpu_bytes:
            errors.append(over_message(s, plan, index))
        elif trainer_peak(role) > (1 - s.cluster.memory_margin) * plan.gpu_bytes:
            errors.append(margin_message(s, plan, index))
        if role.kind != "trainer" and (short := kv_message(s, plan, index)):
            errors.append(short)
    return errors


def trainer_phase(role: Role) -> Phase | None:
    """The largest of `role`'s phases that a trainer holds memory in (all but generating: an engine's
    KV cache fills the share it is given, by design); None for an engine GPU."""
    return max((p for p in role.phases if p.name != "generating"), key=lambda p: p.bytes, default=None)


def trainer_peak(role: Role) -> int:
    """`trainer_phase`'s bytes; 0 for an engine GPU."""
    phase = trainer_phase(role)
    return 0 if phase is None else phase.bytes


def over_message(s: Setup, plan: Plan, index: int) -> str:
    role = plan.roles[index]
    peak = role.peak
    return (
        f"memory plan: the {role.name} needs {gib(peak.bytes)} GiB at its peak ({peak.name}), more than the "
        f"{gib(plan.gpu_bytes)} GiB of a GPU ({plan.gpu_source}); {advice(s, plan, index, peak)}. {PLAN_ONLY}"
    )


def margin_message(s: Setup, plan: Plan, index: int) -> str:
    role, margin = plan.roles[index], s.cluster.memory_margin
    peak = trainer_phase(role)
    spare = plan.gpu_bytes - peak.bytes
    lower = math.floor(spare / plan.gpu_bytes * 100) / 100
    return (
        f"memory plan: the {role.name}'s trainer needs {gib(peak.bytes)} GiB at its peak ({peak.name}), leaving "
        f"{gib(spare)} GiB ({spare / plan.gpu_bytes:.0%}) of the {gib(plan.gpu_bytes)} GiB of a GPU "
        f"({plan.gpu_source}), less than cluster.memory_margin={margin:g} of it, which the caching allocator's "
        f"fragmentation and NCCL's buffers take beside what the plan counts (a Qwen3-30B-A3B slice planned with "
        f"9% free ran out of memory with 3.7 GiB fragmented: docs/benchmarks.md); {advice(s, plan, index, peak)}; "
        f"or cluster.memory_margin={lower:g} to start it anyway. {PLAN_ONLY}"
    )


def advice(s: Setup, plan: Plan, index: int, peak: Phase) -> str:
    """The largest terms of `peak` and the settings that fit (`fitting`), else the knobs to combine."""
    largest = ", ".join(f"{t.name.split(' (')[0]} {gib(t.bytes)}" for t in peak.largest(3))
    fixes = [
        f"{key}={value} (the plan then predicts {gib(after)} GiB)"
        for key, value, after in fitting(s, plan, index)
    ]
    named = {f.split("=")[0] for f in fixes}
    knobs = [k for t in peak.largest(3) for k in t.knobs if k.split("=")[0] not in named]
    others = sorted(set(knobs), key=knobs.index)
    found = f"set {' or '.join(fixes[:3])}" if fixes else "no one setting fits alone: combine"
    if others:
        found += f"; {'other knobs' if fixes else 'the knobs'}: {', '.join(others)}"
    return f"largest terms (GiB): {largest}; {found}"


def kv_message(s: Setup, plan: Plan, index: int) -> str | None:
    """The engine's KV cache holding less than one sample of the longest length (the engine would
    refuse it), with the fraction that would hold one."""
    p = model_params(s.model)
    others = resident_while_generating(s, p, 0) if plan.roles[index].kind == "colocated" else []
    tokens = kv_tokens(s, p, others, plan.gpu_bytes)
    if tokens >= s.sample_len:
        return None
    loaded = sum(t.bytes for t in before_cache(s, p, others))
    need = loaded + (s.sample_len + 2 * engine_arg(s, "page_size")) * kv_bytes_per_token(s)
    fraction = math.ceil(need / plan.gpu_bytes * 100) / 100
    raised = plan_memory(engine(s, mem_fraction_static=fraction), plan.gpu_bytes, params=p).roles[index]
    fits = fraction < 1 and raised.phases[-1].bytes <= plan.gpu_bytes  # the graphs and workspace still fit
    fixes = [f"{FRACTION}={fraction}"] if fits else []
    if others and not s.cluster.offload_trainer:
        fixes.append("cluster.offload_trainer=true")
    fixes += ["rollout.gpus_per_engine (an engine over more GPUs, where the launcher allows)"]
    return (
        f"memory plan: the engines' KV cache on each {plan.roles[index].name} holds {tokens:,} tokens, fewer than one "
        f"sample of {s.sample_len:,} (the engine would refuse it): {FRACTION}={engine_arg(s, 'mem_fraction_static')} "
        f"of {gib(plan.gpu_bytes)} GiB ({plan.gpu_source}) less the {gib(loaded)} GiB already in use leaves too "
        f"little; set {' or '.join(fixes)}. {PLAN_ONLY}"
    )


def fitting(s: Setup, plan: Plan, index: int) -> list[tuple[str, object, int]]:
    """(key, value, predicted peak) of each single setting that brings role `index` under the GPU's
    memory with room to spare (`comfortable`)."""
    role, p = plan.roles[index], model_params(s.model)  # no candidate changes the model
    found = []
    for key, candidates in candidates_for(s, role).items():
        for value, changed in candidates:
            after = plan_memory(changed, plan.gpu_bytes, params=p).roles[index]
            if comfortable(after, plan.gpu_bytes, s.cluster.memory_margin):
                found.append((key, value, after.peak.bytes))
                break
    return found


def comfortable(role: Role, gpu_bytes: int, margin: float = TIGHT) -> bool:
    """Whether `role` fits a GPU of `gpu_bytes`, its trainer with `margin` (and at least TIGHT) to
    spare (what neither the refusal nor `tight` would flag; an engine's cache fills the fraction it is
    given, by design)."""
    return role.peak.bytes <= gpu_bytes and trainer_peak(role) <= (1 - max(margin, TIGHT)) * gpu_bytes


def candidates_for(s: Setup, role: Role) -> dict[str, list[tuple[object, Setup]]]:
    """Settings to try, each key's values from the least change to the most."""
    c, t = s.cluster, s.train
    train = lambda **kw: replace(s, train=replace(t, **kw))  # noqa: E731
    cluster = lambda **kw: replace(s, cluster=replace(c, **kw))  # noqa: E731
    phase = role.peak.name
    found: dict[str, list] = {}
    if phase == "generating":
        if role.kind == "colocated" and not c.offload_trainer:
            found["cluster.offload_trainer"] = [("true", cluster(offload_trainer=True))]
        fraction = engine_arg(s, "mem_fraction_static")
        found[FRACTION] = [
            (f / 100, engine(s, mem_fraction_static=f / 100))
            for f in range(round(fraction * 100) - 2, 29, -2)
        ]
        bs = engine_arg(s, "cuda_graph_max_bs")
        found["rollout.engine_args.cuda_graph_max_bs"] = [
            (b, engine(s, cuda_graph_max_bs=b)) for b in halves(bs, 1)
        ]
        return found
    if phase == "weight sync":  # the trainer's weights beside the engine's
        if role.kind == "colocated" and not c.offload_trainer:
            found["cluster.offload_trainer"] = [("true", cluster(offload_trainer=True))]
        bucket = s.rollout.weight_bucket_mb
        found["rollout.weight_bucket_mb"] = [
            (b, replace(s, rollout=replace(s.rollout, weight_bucket_mb=b))) for b in halves(bucket, 64)
        ]
        if tensor_parallel_fits(s, tp := c.tensor_parallel_size * 2):
            found["cluster.tensor_parallel_size"] = [(tp, cluster(tensor_parallel_size=tp))]
        return found
    forward = phase == "forward-only passes"
    if phase == "optimizer step":
        # the state alone: sharding or splitting it helps, and the fused Adam (no temporary) or
        # Adam one tensor at a time (a smaller one); smaller micro-batches do not
        if not t.adam_fused:
            found["train.adam_fused"] = [("true", train(adam_fused=True))]
            if t.adam_foreach:
                found["train.adam_foreach"] = [("false", train(adam_foreach=False))]
    elif t.max_tokens_per_micro_batch is not None:
        key = "logprob_max_tokens_per_micro_batch" if forward else "max_tokens_per_micro_batch"
        budget = getattr(t, key) or t.max_tokens_per_micro_batch
        found[f"train.{key}"] = [(b, train(**{key: b})) for b in halves(budget, s.sample_len)]
    else:
        key = "logprob_micro_batch_size" if forward else "micro_batch_size"
        rows = getattr(t, key) or t.micro_batch_size
        per_rank = t.global_batch_size // s.data_parallel_size
        sizes = [m for m in range(rows - 1, 0, -1) if forward or per_rank % m == 0]
        found[f"train.{key}"] = [(m, train(**{key: m})) for m in sizes]
    if phase == "training" and t.recompute != "full":
        found["train.recompute"] = [("full", train(recompute="full"))]
    if (
        not t.distributed_optimizer
        and c.num_trainer_procs // (c.tensor_parallel_size * c.pipeline_parallel_size) > 1
    ):
        found["train.distributed_optimizer"] = [("true", train(distributed_optimizer=True))]
    if tensor_parallel_fits(s, tp := c.tensor_parallel_size * 2):
        found["cluster.tensor_parallel_size"] = [(tp, cluster(tensor_parallel_size=tp))]
    return found


def tensor_parallel_fits(s: Setup, tp: int) -> bool:
    """Whether the layout rules (rlx.config.layout) would accept TP = `tp`: within a node, dividing
    the ranks (with PP, CP, and EP's groups), the heads, the KV groups and the vocabulary."""
    c, m = s.cluster, s.model
    ranks = (
        tp * c.pipeline_parallel_size * c.context_parallel_size,
        tp * c.pipeline_parallel_size * c.expert_parallel_size,
    )
    sizes = (m.num_attention_heads, m.num_query_groups, m.vocab_size)
    return (
        c.gpus_per_node % tp == 0
        and all(c.num_trainer_procs % r == 0 for r in ranks)
        and all(n % tp == 0 for n in sizes)
    )


def engine(s: Setup, **args) -> Setup:
    return replace(s, rollout=replace(s.rollout, engine_args={**s.rollout.engine_args, **args}))


def halves(value: int, at_least: int) -> list[int]:
    """value // 2, value // 4, ... down to `at_least` (which ends the list when halving skips it)."""
    found, v = [], value // 2
    while v > at_least:
        found.append(v)
        v //= 2
    return found + ([at_least] if at_least < value else [])


__all__ = ["GIB", "memory_errors", "plan_memory", "trainer_peak_allocated"]
