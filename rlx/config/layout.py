"""The parallel layout and GPU rules of `rlx.config.validate`: Megatron's parallel sizes against
the ranks, the model's shape and the nodes; the trainer's and engines' GPUs against the cluster.
Each rule takes the whole config and the imported component classes, returns its messages.
`check_gpus` holds the config against the machine, which composing cannot see."""

from __future__ import annotations

import math
import os
from typing import Any

from rlx.cluster import ClusterConfig
from rlx.config.schema import RlxConfig
from rlx.errors import ConfigError

Classes = dict[str, Any]  # group -> the class its `_target_` names (None if it did not import)


def get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def positive(cfg: RlxConfig, *keys: str) -> bool:
    """The arithmetic rules need these >= 1 (`_field_rules` reports them when they are not)."""
    return all(get(cfg, key) >= 1 for key in keys)


def model_parallel_sizes(c: ClusterConfig) -> tuple[int, str]:
    """The ranks one data-parallel replica spans (TP × PP × CP), and those keys with their values
    (CP named only when it is set), for messages."""
    keys = f"cluster.tensor_parallel_size={c.tensor_parallel_size} × cluster.pipeline_parallel_size={c.pipeline_parallel_size}"
    if c.context_parallel_size != 1:
        keys += f" × cluster.context_parallel_size={c.context_parallel_size}"
    return c.tensor_parallel_size * c.pipeline_parallel_size * c.context_parallel_size, keys


def parallel_sizes(cfg: RlxConfig, classes: Classes) -> list[str]:
    c, t = cfg.cluster, cfg.train
    keys = ("cluster.num_trainer_procs", "cluster.tensor_parallel_size", "cluster.pipeline_parallel_size",
            "cluster.context_parallel_size")  # fmt: skip
    if not positive(cfg, *keys, "cluster.num_nodes", "train.global_batch_size", "train.micro_batch_size"):
        return []
    errors = []
    model_parallel, sizes = model_parallel_sizes(c)
    if c.num_trainer_procs % model_parallel:
        return errors + [
            f"cluster.num_trainer_procs={c.num_trainer_procs} is not divisible by {sizes} = {model_parallel} "
            f"(the data-parallel size is their quotient); set cluster.num_trainer_procs to a multiple of {model_parallel}"
        ]
    expert_parallel = c.tensor_parallel_size * c.pipeline_parallel_size * c.expert_parallel_size
    if c.num_trainer_procs % expert_parallel:
        errors.append(
            f"cluster.num_trainer_procs={c.num_trainer_procs} is not divisible by "
            f"cluster.tensor_parallel_size × cluster.expert_parallel_size × cluster.pipeline_parallel_size = "
            f"{expert_parallel} (megatron places expert-parallel groups inside data-parallel ones); "
            f"set cluster.num_trainer_procs to a multiple of {expert_parallel}"
        )
    experts = cfg.model.num_moe_experts or 0
    if c.expert_parallel_size > 1 and (experts == 0 or experts % c.expert_parallel_size):
        errors.append(
            f"cluster.expert_parallel_size={c.expert_parallel_size} needs model.num_moe_experts divisible by it "
            f"(model.num_moe_experts={cfg.model.num_moe_experts}); use a MoE model or set cluster.expert_parallel_size=1"
        )
    dp = c.num_trainer_procs // model_parallel
    errors += virtual_stages(cfg, dp)
    if t.logprob_max_tokens_per_micro_batch is not None and t.max_tokens_per_micro_batch is None:
        errors.append(
            f"train.logprob_max_tokens_per_micro_batch={t.logprob_max_tokens_per_micro_batch} is the token budget of "
            "packed forward-only micro-batches, but packing is off (train.max_tokens_per_micro_batch=null); "
            "set train.logprob_micro_batch_size=N instead, or turn packing on"
        )
    if t.max_tokens_per_micro_batch is not None:  # packing: micro-batches by tokens, not samples
        return errors + packing(cfg, dp)
    if t.global_batch_size % (t.micro_batch_size * dp):
        per_rank = t.global_batch_size // dp if t.global_batch_size % dp == 0 else 0
        fits = [m for m in range(min(t.micro_batch_size, per_rank), 0, -1) if per_rank % m == 0]
        fix = (
            f"set train.micro_batch_size={fits[0]}"
            if fits
            else f"make train.global_batch_size a multiple of {dp}"
        )
        errors.append(
            f"train.global_batch_size={t.global_batch_size} is not divisible by train.micro_batch_size="
            f"{t.micro_batch_size} × data-parallel size {dp} (cluster.num_trainer_procs={c.num_trainer_procs} / "
            f"({sizes})) = {t.micro_batch_size * dp}; {fix}"
        )
    return errors


VIRTUAL_STAGES = "model.megatron_overrides.virtual_pipeline_model_parallel_size"  # rlx.trainer.pipeline


def virtual_stages(cfg: RlxConfig, dp: int) -> list[str]:
    """Megatron's interleaved schedule (virtual pipeline stages): several stages to interleave,
    as many layers in each virtual stage, micro-batches of one shape in groups of PP."""
    c, t, m = cfg.cluster, cfg.train, cfg.model
    vp = m.megatron_overrides.get(VIRTUAL_STAGES.rsplit(".", 1)[1])
    if vp is None:
        return []
    pp = c.pipeline_parallel_size
    if not isinstance(vp, int) or isinstance(vp, bool) or vp < 2:
        return [
            f"{VIRTUAL_STAGES}={vp!r} must be an integer >= 2 (model chunks per rank); remove it for none"
        ]
    if pp < 2:
        return [
            f"{VIRTUAL_STAGES}={vp} interleaves pipeline stages, but cluster.pipeline_parallel_size={pp}; "
            f"set cluster.pipeline_parallel_size to 2 or more, or remove {VIRTUAL_STAGES}"
        ]
    errors = []
    if m.num_layers % (pp * vp):
        errors.append(
            f"model.num_layers={m.num_layers} is not divisible by cluster.pipeline_parallel_size={pp} × "
            f"{VIRTUAL_STAGES}={vp} = {pp * vp} (each virtual stage holds as many layers); set {VIRTUAL_STAGES}="
            f"{largest_divisor(m.num_layers // pp, vp) if m.num_layers % pp == 0 else 1} or remove it"
        )
    if t.max_tokens_per_micro_batch is not None:
        errors.append(
            f"train.max_tokens_per_micro_batch={t.max_tokens_per_micro_batch} (packing) with {VIRTUAL_STAGES}={vp}: "
            "the interleaved schedule needs micro-batches of one shape and a known count; set "
            f"train.max_tokens_per_micro_batch=null or remove {VIRTUAL_STAGES}"
        )
    elif t.global_batch_size % (t.micro_batch_size * dp) == 0:
        num_mbs = t.global_batch_size // (t.micro_batch_size * dp)
        if num_mbs % pp:
            errors.append(
                f"train.global_batch_size={t.global_batch_size} / (train.micro_batch_size={t.micro_batch_size} × "
                f"data-parallel size {dp}) = {num_mbs} micro-batches per step, not a multiple of "
                f"cluster.pipeline_parallel_size={pp} (the interleaved schedule runs them in groups of {pp}); "
                f"set train.micro_batch_size so that the count is a multiple of {pp}"
            )
    return errors


def packing(cfg: RlxConfig, dp: int) -> list[str]:
    """With `train.max_tokens_per_micro_batch` each DP rank packs its share of a global batch
    (an equal number of samples) into micro-batches, never splitting a sample: the budget must
    hold the longest sample a rollout can make."""
    t, m, r = cfg.train, cfg.model, cfg.rollout
    errors = []
    if t.global_batch_size % dp:
        errors.append(
            f"train.global_batch_size={t.global_batch_size} is not divisible by the data-parallel size {dp} "
            f"(cluster.num_trainer_procs={cfg.cluster.num_trainer_procs} / ({model_parallel_sizes(cfg.cluster)[1]})); "
            f"make train.global_batch_size a multiple of {dp}"
        )
    response = r.max_response_len
    if cfg.data.max_prompt_len is not None:
        longest = cfg.data.max_prompt_len + response
        why = f"data.max_prompt_len={cfg.data.max_prompt_len} + rollout.max_response_len={response}"
    else:  # prompts up to the context less the response (rlx.config.validate.max_prompt_len)
        longest = m.max_position_embeddings - 1
        why = (
            f"model.max_position_embeddings={m.max_position_embeddings} - 1 (data.max_prompt_len=null "
            "allows prompts up to the context less rollout.max_response_len)"
        )
    for key in ("max_tokens_per_micro_batch", "logprob_max_tokens_per_micro_batch"):
        budget = getattr(t, key)
        if budget is not None and 1 <= budget < longest:
            errors.append(
                f"train.{key}={budget} is less than the longest sample, {why} = {longest} "
                f"tokens (packing never splits a sample); set train.{key}={longest} or more, "
                "or lower data.max_prompt_len"
            )
    return errors


def largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, max(at_most, 1) + 1) if n % d == 0)


def model_split(cfg: RlxConfig, classes: Classes) -> list[str]:
    """Megatron gives each tensor-parallel rank whole heads, whole KV groups and an equal share
    of the vocabulary (rlx does not pad it), and each pipeline stage the same number of layers."""
    c, m = cfg.cluster, cfg.model
    keys = ("model.num_attention_heads", "model.num_query_groups", "model.vocab_size", "model.num_layers")
    if not positive(cfg, *keys, "cluster.tensor_parallel_size", "cluster.pipeline_parallel_size"):
        return []
    tp, pp = c.tensor_parallel_size, c.pipeline_parallel_size
    fit = largest_divisor(math.gcd(m.num_attention_heads, m.num_query_groups, m.vocab_size), tp)
    errors = []
    if m.num_attention_heads % tp or m.num_query_groups % tp:
        errors.append(
            f"model.num_attention_heads={m.num_attention_heads} and model.num_query_groups={m.num_query_groups} "
            f"must both be divisible by cluster.tensor_parallel_size={tp} (each tensor-parallel rank holds "
            f"whole heads); set cluster.tensor_parallel_size={fit}"
        )
    if m.vocab_size % tp:
        errors.append(
            f"model.vocab_size={m.vocab_size} is not divisible by cluster.tensor_parallel_size={tp} (each "
            f"tensor-parallel rank holds an equal slice of the vocabulary); set cluster.tensor_parallel_size={fit}"
        )
    if pp > 1 and m.num_moe_experts and m.moe_token_dispatcher_type == "allgather":
        errors.append(
            f"model.moe_token_dispatcher_type=allgather cannot run with cluster.pipeline_parallel_size={pp}: "
            "stages exchange activations of varying length, which megatron's allgather dispatcher refuses; "
            "set model.moe_token_dispatcher_type=alltoall"
        )
    if m.num_layers % pp:
        errors.append(
            f"model.num_layers={m.num_layers} is not divisible by cluster.pipeline_parallel_size={pp} (each "
            f"pipeline stage holds as many layers); set cluster.pipeline_parallel_size="
            f"{largest_divisor(m.num_layers, pp)}"
        )
    return errors


def gpus(cfg: RlxConfig, classes: Classes) -> list[str]:
    """The trainer's GPUs and the engines' (`cluster.num_rollout_gpus`) fit the nodes: beside each
    other (split) or the same GPUs (colocated). On CPU there are no GPUs to give anyone."""
    c, r = cfg.cluster, cfg.rollout
    if (
        not positive(cfg, "cluster.num_nodes", "cluster.num_trainer_procs")
        or min(c.num_rollout_gpus, c.gpus_per_node) < 0
    ):
        return []
    if c.gpus_per_node == 0:
        return cpu_counts(cfg)
    total, trainer, rollout = c.num_nodes * c.gpus_per_node, c.num_trainer_procs, c.num_rollout_gpus
    nodes = f"cluster.num_nodes={c.num_nodes} × cluster.gpus_per_node={c.gpus_per_node}"
    errors = []
    if trainer > total:
        errors.append(
            f"cluster.num_trainer_procs={trainer} is more than the cluster's GPUs ({nodes}); "
            f"set cluster.num_trainer_procs <= {total}"
        )
    if rollout == 0:
        if not cfg.debug.train_only:  # train_only: no engines, a trainer alone from dumped batches
            shared = f"cluster.num_rollout_gpus={trainer} (the trainer's GPUs, shared)"
            own = f"cluster.num_rollout_gpus={r.num_engines * r.gpus_per_engine} (GPUs of their own) or "
            errors.append(
                f"cluster.num_rollout_gpus=0 on a GPU cluster (cluster.gpus_per_node={c.gpus_per_node}): the engines "
                f"need GPUs; set {shared if c.colocate else own + 'cluster.colocate=true ' + shared}"
            )
    elif c.colocate and rollout != trainer:
        errors.append(
            f"cluster.colocate=true puts the engines on the trainer's GPUs, so cluster.num_rollout_gpus={rollout} "
            f"must equal cluster.num_trainer_procs={trainer}; set cluster.num_rollout_gpus={trainer}"
        )
    elif not c.colocate and trainer <= total < trainer + rollout:
        fixes = [f"cluster.num_rollout_gpus={total - trainer}"] * (trainer < total)
        fixes += [f"cluster.num_trainer_procs={total - rollout}"] * (rollout < total)
        fixes.append(f"cluster.num_nodes={-(-(trainer + rollout) // c.gpus_per_node)}")
        errors.append(
            f"cluster.num_trainer_procs={trainer} + cluster.num_rollout_gpus={rollout} = {trainer + rollout} GPUs "
            f"is more than {nodes} = {total} (split placement: the engines get GPUs of their own); "
            f"set {' or '.join(fixes)}"
        )
    return errors


def cpu_counts(cfg: RlxConfig) -> list[str]:
    c, r = cfg.cluster, cfg.rollout
    errors = []
    if c.num_rollout_gpus > 0:
        errors.append(
            f"cluster.num_rollout_gpus={c.num_rollout_gpus} needs GPUs, but cluster.gpus_per_node=0 (CPU: the "
            "engines run on CPU); set cluster.num_rollout_gpus=0, or cluster.gpus_per_node to the GPUs per node"
        )
    if r.gpus_per_engine > 1:
        errors.append(
            f"rollout.gpus_per_engine={r.gpus_per_engine} needs GPUs, but cluster.gpus_per_node=0 (CPU); "
            "set rollout.gpus_per_engine=1"
        )
    return errors


def engines(cfg: RlxConfig, classes: Classes) -> list[str]:
    """On GPU clusters the engines fill the rollout GPUs exactly, each on one node."""
    c, r = cfg.cluster, cfg.rollout
    if c.gpus_per_node < 1 or c.num_rollout_gpus < 1 or not positive(cfg, "rollout.gpus_per_engine"):
        return []
    gpus, per = c.num_rollout_gpus, r.gpus_per_engine
    errors = []
    if per > c.gpus_per_node:
        errors.append(
            f"rollout.gpus_per_engine={per} is more than cluster.gpus_per_node={c.gpus_per_node} (an engine's "
            f"GPUs are on one node); set rollout.gpus_per_engine={largest_divisor(c.gpus_per_node, per)}"
        )
    # the most GPUs the launcher says one of its engines takes (rlx.rollout.launchers)
    limit = getattr(classes.get("rollout"), "max_gpus_per_engine", None)
    if limit is not None and per > limit:
        errors.append(
            f"rollout.gpus_per_engine={per} with rollout._target_={r._target_!r}: its engine runs on at most "
            f"{limit} GPU{'s' * (limit > 1)}; set rollout.gpus_per_engine={limit} (rollout.num_engines="
            f"{gpus // limit}), or rollout=sglang for engines over several GPUs"
        )
    if gpus % per:
        errors.append(
            f"cluster.num_rollout_gpus={gpus} is not divisible by rollout.gpus_per_engine={per} (each engine "
            f"takes {per} GPUs); set cluster.num_rollout_gpus={max(per, gpus - gpus % per)} or "
            f"rollout.gpus_per_engine={largest_divisor(gpus, per)}"
        )
    elif r.num_engines != gpus // per:
        errors.append(
            f"rollout.num_engines={r.num_engines} must equal cluster.num_rollout_gpus={gpus} / "
            f"rollout.gpus_per_engine={per} = {gpus // per} (the engines fill the rollout GPUs); "
            f"set rollout.num_engines={gpus // per}"
        )
    return errors


def nodes(cfg: RlxConfig, classes: Classes) -> list[str]:
    """Ray spans the nodes; a tensor-parallel group (all-reduces in every layer) stays within one."""
    c = cfg.cluster
    errors = []
    if c.num_nodes > 1 and not c.ray_address:
        errors.append(
            f"cluster.num_nodes={c.num_nodes} needs cluster.ray_address (a Ray this process starts spans one "
            "machine); start Ray on every node (`ray start --head` on one, `ray start --address=HEAD:6379` on "
            "the others) and set cluster.ray_address=auto"
        )
    tp = c.tensor_parallel_size
    if c.gpus_per_node > 0 and tp >= 1 and c.gpus_per_node % tp:
        errors.append(
            f"cluster.tensor_parallel_size={tp} must divide cluster.gpus_per_node={c.gpus_per_node} (a "
            f"tensor-parallel group stays within one node); set cluster.tensor_parallel_size="
            f"{largest_divisor(c.gpus_per_node, tp)}"
        )
    return errors


def placement(cfg: RlxConfig, classes: Classes) -> list[str]:
    """Colocation alternates trainer and engines on GPUs: there must be GPUs, one engine on each.
    CUDA IPC (rollout.weight_sync=tensor) needs the engine on the sender's GPU: colocated."""
    c = cfg.cluster
    if cfg.rollout.weight_sync == "tensor" and c.gpus_per_node > 0 and not c.colocate:
        return [
            "rollout.weight_sync=tensor hands the engines CUDA IPC handles, which only an engine on the "
            "trainer's own GPU can open, but cluster.colocate=false; set rollout.weight_sync=distributed "
            "(or auto), or cluster.colocate=true"
        ]
    if not c.colocate:
        return []
    if c.gpus_per_node == 0:
        return [
            "cluster.colocate=true shares GPUs between the trainer and the engines, but cluster.gpus_per_node=0 "
            "(CPU); set cluster.colocate=false, or cluster=1gpu on a GPU machine"
        ]
    if c.offload_trainer is True and c.release_memory is False:
        return [
            "cluster.release_memory=false keeps the trainer and the engines resident on their GPUs together, "
            "but cluster.offload_trainer=true moves the trainer's state to the CPU; set one of them to auto"
        ]
    if cfg.rollout.gpus_per_engine != 1:
        return [
            f"cluster.colocate=true puts one engine on each trainer GPU, but rollout.gpus_per_engine="
            f"{cfg.rollout.gpus_per_engine}; set rollout.gpus_per_engine=1 or cluster.colocate=false"
        ]
    check = getattr(classes.get("rollout"), "placement_errors", None)  # the launcher's own
    return check(cfg.rollout, colocated=True) if check is not None else []


def check_gpus(cluster: ClusterConfig) -> None:
    """Raise ConfigError if there are fewer GPUs than `cluster` asks for, before Ray waits forever
    for them. Without `cluster.ray_address` it counts this machine's visible GPUs
    (torch.cuda.device_count()); with one, the Ray cluster's, so call it after `ray.init`.
    A CPU config (`cluster.gpus_per_node=0`) needs none."""
    if cluster.gpus_per_node == 0:
        return
    if cluster.ray_address:
        import ray

        per_node = [n["Resources"].get("GPU", 0.0) for n in ray.nodes() if n.get("Alive")]
        where = f"the Ray cluster at cluster.ray_address={cluster.ray_address} (GPUs per node: {per_node})"
    else:
        import torch

        per_node = [float(torch.cuda.device_count())]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = (
            "this machine (torch.cuda.device_count()"
            + (f", CUDA_VISIBLE_DEVICES={visible}" * (visible is not None))
            + ")"
        )
    if message := gpu_shortfall(cluster, per_node, where):
        raise ConfigError(message)


def gpu_shortfall(cluster: ClusterConfig, per_node: list[float], where: str) -> str | None:
    """The message when the nodes' GPUs (`per_node`) are fewer than the run needs, else None."""
    needed = cluster.num_trainer_procs + (0 if cluster.colocate else cluster.num_rollout_gpus)
    have = sum(per_node)
    if have >= needed:
        return None
    counts = f"cluster.num_trainer_procs={cluster.num_trainer_procs}" + (
        "" if cluster.colocate else f" + cluster.num_rollout_gpus={cluster.num_rollout_gpus}"
    )
    fix = (
        "set cluster=local (CPU) or cluster.gpus_per_node=0"
        if have == 0
        else "lower " + counts.replace(" + ", " or ")
    )
    return (
        f"cluster.gpus_per_node={cluster.gpus_per_node}: the run needs {needed:g} GPU{'s' * (needed != 1)} ({counts}) but {where} "
        f"has {have:g}; {fix}, or run where the GPUs are"
    )
