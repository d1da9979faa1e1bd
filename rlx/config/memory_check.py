"""The memory plan (`rlx.memory`) of a composed config: what it reads from the whole config (the
data's prompt length, the algorithm's extra models, the checkpoint's dtype, the GPU's memory),
the compose-time rule of `rlx.config.validate`, and the plan `run.plan_only=true` prints and
every GPU run logs first. CPU configs (`cluster.gpus_per_node=0`) have no plan."""

from __future__ import annotations

import json
from dataclasses import replace

from rlx.config.build import build
from rlx.config.layout import Classes
from rlx.config.schema import RlxConfig
from rlx.errors import ConfigError
from rlx.memory import GIB, Plan, Setup, memory_errors, plan_memory, report, trainer_peak_allocated
from rlx.memory.gpus import visible_gpu_bytes
from rlx.memory.plan import kept_kv_tokens, offload_decision, release_decision


def memory_setup(rc: RlxConfig) -> Setup:
    """The plan's inputs from the composed config (`cluster.offload_trainer=auto` and
    `cluster.release_memory=auto` decided)."""
    setup = _setup(rc)
    if setup.cluster.offload_trainer == "auto":
        setup = replace(setup, cluster=replace(setup.cluster, offload_trainer=_decide(setup, rc)[0]))
    if setup.cluster.release_memory == "auto":
        release = release_decision(setup, gpu_memory(rc)[0])[0]
        setup = replace(setup, cluster=replace(setup.cluster, release_memory=release))
    return setup


def resolve_offload(rc: RlxConfig) -> str | None:
    """Set `rc.cluster.offload_trainer` to what `auto` (the default) decides (`offload_decision`;
    true on a CPU run or a model the plan cannot count); the reason, for the run's log (None: it was
    not auto, or the run is not colocated, where nothing is offloaded either way)."""
    if rc.cluster.offload_trainer != "auto":
        return None
    if not rc.cluster.colocate:
        rc.cluster.offload_trainer = True
        return None
    if no_plan(rc):
        rc.cluster.offload_trainer = True
        return "offloaded: no memory plan for this run"
    rc.cluster.offload_trainer, why = _decide(_setup(rc), rc)
    return why


def resolve_release(rc: RlxConfig) -> str | None:
    """Set `rc.cluster.release_memory` to what `auto` (the default) decides
    (`release_decision`), once `resolve_offload` has decided `offload_trainer`; the reason, for the
    run's log (None: not auto, or not colocated). `false` is refused where the state is offloaded."""
    c = rc.cluster
    if c.release_memory is False and c.offload_trainer is True and c.colocate:
        raise ConfigError(
            "cluster.release_memory=false keeps the trainer and the engines resident on their GPUs together, "
            "but cluster.offload_trainer=auto moves the trainer's state to the CPU (the plan does not fit it "
            "kept, or the run has no plan: run.plan_only=true with cluster.offload_trainer=false says which); "
            "set cluster.release_memory=auto"
        )
    if c.release_memory != "auto":
        return None
    if not c.colocate or no_plan(rc):
        c.release_memory = True
        return None
    c.release_memory, why = release_decision(_setup(rc), gpu_memory(rc)[0])
    return why


def cap_engine_cache(rc: RlxConfig) -> str | None:
    """A colocated trainer kept on the GPU (`cluster.offload_trainer=false`, or `auto` decided so)
    allocates its optimizer state at its first step, after the engines have sized their KV caches
    from the memory then free: each engine's cache is capped (`rollout.engine_args.max_total_tokens`)
    at what the plan gives it beside the trainer's whole state, or the first resume runs out of
    memory. Returns the line for the run's log; None where nothing is capped (offloaded, not
    colocated, no plan or no GPU seen, or max_total_tokens set by the user)."""
    if rc.cluster.offload_trainer is not False or not rc.cluster.colocate or no_plan(rc):
        return None
    if rc.rollout.engine_args.get("max_total_tokens") is not None:
        return None
    setup, gpu_bytes = _setup(rc), gpu_memory(rc)[0]
    if gpu_bytes is None or not (setup.with_trainer and setup.with_engines):
        return None
    tokens = kept_kv_tokens(setup, gpu_bytes)
    rc.rollout.engine_args["max_total_tokens"] = tokens
    return (
        f"the trainer stays on the GPU while the engines generate: each engine's KV cache is capped at "
        f"{tokens:,} tokens beside it (rollout.engine_args.max_total_tokens={tokens})"
    )


def size_engine_cache(rc: RlxConfig, longest_prompt: int, user_cap: bool) -> str | None:
    """A colocated engine's KV cache holds what its running requests can use at once and no more
    (`rollout.engine_args.max_total_tokens`, or the cap `cap_engine_cache` set if smaller): every
    running request at the longest prompt plus the longest response, in whole pages, so none is
    ever preempted; within a step nothing else is kept (each weight update drops the cached
    prefixes). Sized by the free memory instead, the cache would be released and mapped again at
    every hand-over whole: about 0.5 ms a GiB (SmolLM2-135M's 120 GiB: 0.08 s a step, 1×H200).
    Returns the run's log line; None where nothing changes (split or CPU engines, a launcher that
    sizes its own running cap, max_total_tokens set by the user or smaller already)."""
    from rlx.memory.engine import ENGINE_DEFAULTS, requests_tokens
    from rlx.rollout.launchers import engine_args_for_batch

    r = rc.rollout
    if user_cap or not rc.cluster.colocate or rc.cluster.gpus_per_node == 0:
        return None
    running = r.engine_args.get("max_running_requests") or engine_args_for_batch(r).get(
        "max_running_requests"
    )
    if not running:
        return None
    page = r.engine_args.get("page_size") or ENGINE_DEFAULTS["page_size"]
    response = max(r.max_response_len, r.eval_max_response_len or 0)
    tokens = requests_tokens(running, page, longest_prompt, r)
    if (capped := r.engine_args.get("max_total_tokens")) is not None and capped <= tokens:
        return None
    r.engine_args["max_total_tokens"] = tokens
    return (
        f"each engine's KV cache holds its {running:,} running requests at full length: {running:,} × "
        f"({longest_prompt:,} prompt + {response:,} response tokens, in pages of {page}) = {tokens:,} tokens "
        f"(rollout.engine_args.max_total_tokens={tokens}); a hand-over moves no more"
    )


def eager_decode_line(rc: RlxConfig) -> str | None:
    """The run's log line where rlx's engine on GPUs runs more requests at once than its largest
    decode graph holds (the user's `rollout.engine_args.cuda_graph_max_bs` below the running cap,
    `max_running_requests` set or sized to the batch; unset, the graphs go up to the cap): a decode
    step of more rows runs eagerly, launch-bound, and no step is queued behind it. None otherwise
    (CPU engines have no graphs; SGLang sizes its own)."""
    from rlx.rollout.launchers import engine_args_for_batch

    r = rc.rollout
    sized = engine_args_for_batch(r)
    if (
        rc.cluster.gpus_per_node == 0
        or "cuda_graph_max_bs" not in sized
        or r.engine_args.get("disable_cuda_graph")
    ):
        return None
    running = sized["max_running_requests"]  # the user's where set (`engine_args_for_batch`)
    graphs = r.engine_args.get("cuda_graph_max_bs") or sized["cuda_graph_max_bs"]
    if graphs >= running:
        return None
    return (
        f"decode graphs hold up to {graphs:,} of each engine's {running:,} running requests "
        f"(rollout.engine_args.cuda_graph_max_bs={graphs}): a decode step of more rows runs eagerly, "
        "launch-bound, with no step queued behind it (SmolLM2-135M, 1,024 samples: 2.49 s, against 0.54 "
        f"in graphs, 1xH200); rollout.engine_args.cuda_graph_max_bs={running} graphs them all "
        "(the graphs' memory pool grows with it; the plan counts it)"
    )


def roomier_micro_batch(rc: RlxConfig) -> tuple[int, float, bool] | None:
    """The largest `train.micro_batch_size` above the configured one (doubling it while it divides a
    data-parallel rank's share of `train.global_batch_size`) that the plan fits on this run's GPUs
    with the trainer's state where it goes now (kept on the GPU where `auto` keeps it at the
    configured size), its planned trainer peak in GiB, and whether at it `cluster.release_memory=auto`
    would release what it keeps resident at the configured size (trainer and engines no longer fit
    together). Fewer, longer micro-batches spend less host time a step (Qwen3-1.7B on 1×H100: 8 ->
    16 took the train phase from 2.37 to 1.63 s, docs/benchmarks.md). None: packing, pipeline
    parallelism, no plan or GPU size, or none larger fits. Call it before `resolve_offload` (it
    reads `auto`)."""
    t, c = rc.train, rc.cluster
    if no_plan(rc) or t.max_tokens_per_micro_batch is not None or c.pipeline_parallel_size > 1:
        return None
    gpu_bytes = gpu_memory(rc)[0]
    if gpu_bytes is None:
        return None
    setup = _setup(rc)
    keep = c.offload_trainer == "auto" and c.colocate and not _decide(setup, rc)[0]

    def released(s: Setup) -> bool:  # what release_memory=auto decides with the state kept
        return release_decision(replace(s, cluster=replace(s.cluster, offload_trainer=False)), gpu_bytes)[0]

    resident = keep and c.release_memory == "auto" and not released(setup)
    share, best = t.global_batch_size // setup.data_parallel_size, None
    size = t.micro_batch_size * 2
    while size <= share and share % size == 0:
        trial = replace(setup, train=replace(setup.train, micro_batch_size=size))
        if c.offload_trainer == "auto":  # as `auto` decided at the configured size
            trial = replace(trial, cluster=replace(trial.cluster, offload_trainer=not keep))
        # kept: `offload_decision` plans it (it would not fit, or would leave the KV cache short)
        if _decide(trial, rc)[0] if keep else memory_errors(trial, plan_memory(trial, gpu_bytes)):
            break
        best = (size, trainer_peak_allocated(trial) / GIB, resident and released(trial))
        size *= 2
    return best


def roomier_line(rc: RlxConfig, roomier: tuple[int, float, bool]) -> str:
    """The run's log line for `roomier_micro_batch`'s answer."""
    size, peak, released = roomier
    line = (
        f"train.micro_batch_size={rc.train.micro_batch_size}: the plan fits {size} as well (trainer peak "
        f"{peak:.3g} GiB); fewer, longer micro-batches spend less host time a step "
        f"(train.micro_batch_size={size})"
    )
    if released:
        line += (
            f", though at {size} trainer and engines no longer fit resident together: "
            "cluster.release_memory=auto then releases their memory at each hand-over (the 1.7B shape on "
            "1×H200: 0.10 s a step, docs/benchmarks.md)"
        )
    return line


def _decide(setup: Setup, rc: RlxConfig) -> tuple[bool, str]:
    """`offload_decision` for `setup`, whose cluster.offload_trainer is still `auto`."""
    return offload_decision(
        replace(setup, cluster=replace(setup.cluster, offload_trainer=True)), gpu_memory(rc)[0]
    )


def _setup(rc: RlxConfig) -> Setup:
    try:  # the algorithm says which models it adds (checked by its own rules first)
        algo = build(rc.algo)
        needs_ref, needs_critic = bool(algo.needs_ref), bool(algo.needs_critic)
    except Exception:  # a user's class that does not build or declare them: the policy alone
        needs_ref = needs_critic = False
    return Setup(
        model=rc.model,
        train=rc.train,
        cluster=rc.cluster,
        rollout=rc.rollout,
        prompt_len=rc.data.max_prompt_len or 0,
        needs_ref=needs_ref,
        needs_critic=needs_critic,
        checkpoint_dtype=checkpoint_dtype(rc.model.hf_checkpoint),
        with_trainer=not rc.debug.rollout_only,
        with_engines=not rc.debug.train_only,
    )


def checkpoint_dtype(hf_checkpoint: str | None) -> str | None:
    """config.json's dtype of a local checkpoint directory; None for a tiny model or an unreadable one."""
    if not hf_checkpoint:
        return None
    from rlx.models.hf_checkpoint import local_path

    try:
        config = json.loads((local_path(hf_checkpoint) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    dtype = config.get("dtype") or config.get("torch_dtype")
    return dtype if isinstance(dtype, str) else None


def gpu_memory(rc: RlxConfig) -> tuple[int | None, str]:
    """(bytes of one GPU, where that came from): `cluster.gpu_memory_gib`, else nvidia-smi's."""
    if rc.cluster.gpu_memory_gib is not None:
        return round(rc.cluster.gpu_memory_gib * GIB), f"cluster.gpu_memory_gib={rc.cluster.gpu_memory_gib:g}"
    seen = visible_gpu_bytes()
    return seen, "this machine's GPUs, by nvidia-smi; cluster.gpu_memory_gib sets it"


def no_plan(rc: RlxConfig) -> str | None:
    """Why the run has no plan (None: it has one): a CPU run, or a model class of the user's own
    that is no rlx `ModelFamily` (the plan counts parameters with the family's `num_parameters`)."""
    if rc.cluster.gpus_per_node == 0:
        return "a CPU run (cluster.gpus_per_node=0); choose a GPU cluster, e.g. cluster=1gpu"
    from rlx.config.build import locate
    from rlx.models.family import ModelFamily

    family = locate(rc.model._target_)
    if not (isinstance(family, type) and issubclass(family, ModelFamily)):
        return (
            f"model._target_={rc.model._target_} is no rlx ModelFamily, whose parameter count the plan needs"
        )
    return None


def memory_plan(rc: RlxConfig) -> Plan | None:
    """The plan of a GPU run (None: `no_plan` says why)."""
    planned = _planned(rc)
    return None if planned is None else planned[1]


def print_plan(rc: RlxConfig, prompt_limit: int) -> None:
    """`run.plan_only=true`: print the plan (or why a CPU run has none) and what the run would
    decide by it, as the run logs them (`prompt_limit`: the longest prompt its data may keep,
    `rlx.config.validate.run_max_prompt_len`); raise the refusal a run of this config would get,
    after the plan, as a ConfigError."""
    if (reason := no_plan(rc)) is not None:
        print(f"memory plan: none for {reason}")
        if (line := host_plan_line(rc)) is not None:
            print(line, flush=True)
        if errors := host_memory_errors(rc):
            raise ConfigError("this run would be refused:\n" + "\n".join(f"  - {e}" for e in errors))
        return
    (setup, plan), lines = decide_memory(rc, None, prompt_limit)
    print("\n".join([report(plan), *lines]), flush=True)
    if errors := memory_errors(setup, plan):
        raise ConfigError("this run would be refused:\n" + "\n".join(f"  - {e}" for e in errors))


def decide_memory(
    rc: RlxConfig, longest_prompt: int | None, prompt_limit: int
) -> tuple[tuple[Setup, Plan] | None, list[str]]:
    """A run's decisions by its memory plan, made in `rc` before anything starts: the trainer's
    state kept or offloaded, its memory released at each hand-over or not, each engine's KV cache
    capped beside a kept trainer and sized to its running requests. Returns the plan they give
    (None: `no_plan`) and the lines saying what was decided and why, which the run logs after the
    plan and `run.plan_only=true` prints after it (and, where the engines run more requests than
    their largest decode graph holds, a line that says so: `eager_decode_line`). The plan counts
    `longest_prompt` (the longest the run's data holds; None: unknown, `data.max_prompt_len`
    counts) and the cache holds it, or `prompt_limit` (the longest the data may keep) where it is
    None. A CPU run whose processes cannot fit the host is refused here (ConfigError), its prompts
    counted."""
    user_cap = rc.rollout.engine_args.get("max_total_tokens") is not None
    if longest_prompt is not None:  # a copy sharing rc's other sections: the decisions land in rc
        rc = replace(rc, data=replace(rc.data, max_prompt_len=longest_prompt))
    if errors := host_memory_errors(rc):
        raise ConfigError("\n".join(errors))
    roomier = roomier_micro_batch(rc)  # a larger micro-batch the plan fits (reads `auto`)
    offload = resolve_offload(rc)  # cluster.offload_trainer=auto: true or false from here on
    release = resolve_release(rc)  # cluster.release_memory=auto, likewise
    # the cap beside a kept trainer first: sizing by the requests only ever lowers it
    lines = [
        None if offload is None else f"cluster.offload_trainer=auto: {offload}",
        None if release is None else f"cluster.release_memory=auto: {release}",
        cap_engine_cache(rc),
        size_engine_cache(rc, longest_prompt or prompt_limit, user_cap),
        None if roomier is None else roomier_line(rc, roomier),
        eager_decode_line(rc),
    ]
    return _planned(rc), [line for line in lines if line is not None]


def memory_rule(cfg: RlxConfig, classes: Classes) -> list[str]:
    """`rlx.config.validate`'s rule: a GPU run whose plan does not fit its GPUs is refused."""
    planned = _planned(cfg)
    return [] if planned is None else memory_errors(*planned)


def host_memory_errors(cfg: RlxConfig) -> list[str]:
    """A CPU run on one machine whose processes' predicted memory (`rlx.memory.host`) is over what
    Ray's memory monitor allows of the machine: the refusal, naming the largest
    `train.micro_batch_size` that fits; [] otherwise. Checked when a run starts (`rlx.runtime`,
    its prompts counted once the data is read), not when composing: a config composed on a CPU
    for a model's size stays valid to compose."""
    from rlx.memory.host import PROCESS_BYTES, RAY_KILL_FRACTION, gib, host_plan

    if (planned := _host_planned(cfg)) is None:
        return []
    setup, plan, host, source = planned
    limit = RAY_KILL_FRACTION * host
    if plan.total <= limit:
        return []
    t = cfg.train
    fits, size = None, t.micro_batch_size // 2
    while size >= 1 and fits is None:
        trial = replace(setup, train=replace(setup.train, micro_batch_size=size))
        if host_plan(trial).total <= limit:
            fits = size
        size //= 2
    fix = (
        f"set train.micro_batch_size={fits} (the largest halving that fits)"
        if fits is not None
        else "use a smaller model or a GPU cluster (e.g. cluster=1gpu)"
    )
    return [
        f"host memory plan: this CPU run needs about {gib(plan.total)} GiB (a trainer rank "
        f"{gib(plan.trainer_rank)} × {plan.num_trainer_ranks} at train.micro_batch_size={t.micro_batch_size}, "
        f"an engine {gib(plan.engine)} × {plan.num_engines}, the driver {gib(PROCESS_BYTES)}), more than "
        f"{RAY_KILL_FRACTION:.0%} of the host's {gib(host)} GiB ({source}), past which Ray's memory monitor "
        f"kills a process; {fix}, or state a larger machine with cluster.host_memory_gib "
        "(approximate: rlx/memory/host.py)"
    ]


def host_plan_line(cfg: RlxConfig) -> str | None:
    """`run.plan_only`'s line for a CPU run (None: several nodes, or no rlx model family)."""
    from rlx.memory.host import PROCESS_BYTES, gib

    if (planned := _host_planned(cfg)) is None:
        return None
    _, plan, host, source = planned
    prompts = (
        ""
        if cfg.data.max_prompt_len
        else "; prompts not counted: data.max_prompt_len is unset, and the run counts its data's longest"
    )
    return (
        f"host memory plan: about {gib(plan.total)} GiB of the host's {gib(host)} GiB ({source}): a trainer rank "
        f"{gib(plan.trainer_rank)} × {plan.num_trainer_ranks}, an engine {gib(plan.engine)} × {plan.num_engines}, "
        f"the driver {gib(PROCESS_BYTES)} (approximate: rlx/memory/host.py{prompts})"
    )


def _host_planned(cfg: RlxConfig):
    """(setup, host plan, the host's bytes, where that figure comes from) of a CPU run on one
    machine with an rlx model family; None otherwise."""
    from rlx.config.build import locate
    from rlx.memory.host import host_bytes, host_plan
    from rlx.models.family import ModelFamily

    c = cfg.cluster
    family = locate(cfg.model._target_)
    if (
        c.gpus_per_node != 0
        or c.num_nodes > 1
        or not (isinstance(family, type) and issubclass(family, ModelFamily))
    ):
        return None
    setup = _setup(cfg)
    if c.host_memory_gib is None:
        host, source = host_bytes(), "this machine's"
    else:
        host, source = round(c.host_memory_gib * GIB), f"cluster.host_memory_gib={c.host_memory_gib:g}"
    return setup, host_plan(setup), host, source


def _planned(rc: RlxConfig) -> tuple[Setup, Plan] | None:
    """(the plan's inputs, the plan) of a GPU run, the inputs read once; None: `no_plan` says why."""
    if no_plan(rc):
        return None
    setup = memory_setup(rc)
    return setup, plan_memory(setup, *gpu_memory(rc))
