"""Cross-group config rules, checked before Ray starts or any model is built.

Hydra's typed schemas already reject unknown keys and wrong types at compose time; these are
the rules a single field's type cannot express. Every violation is collected, then one
ConfigError lists them all, each naming the keys, their values and the fix.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import Any

from hydra._internal.utils import _locate  # what hydra.utils.get_class uses, minus its error logging
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlx.config.rules import field_errors
from rlx.config.schema import RlxConfig
from rlx.errors import ConfigError
from rlx.reward import load_reward_fn
from rlx.rollout.servers import LocalServer

TARGET_KEYS = ("model", "algo", "rollout", "data")  # groups whose `_target_` names a class
DEFAULT_MIN_GROUP_SIZE = 2  # group normalisation needs >= 2 samples; an algo class may say otherwise

Classes = dict[str, Any]  # group -> the class its `_target_` names (None if it did not import)


def validate(cfg: DictConfig | RlxConfig) -> None:
    """Raise one ConfigError listing every rule `cfg` breaks; return None if it breaks none."""
    if isinstance(cfg, DictConfig):
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:  # `???` in a config file: the other rules need every value
            raise ConfigError(
                _listing([f"{key} is required (it is ??? in the config); set {key}=..." for key in missing])
            )
        try:
            cfg = OmegaConf.to_object(cfg)
        except OmegaConfBaseException as e:
            raise ConfigError(str(e)) from e
    classes: Classes = {}
    errors = _targets(cfg, classes)
    rules = (_field_rules, _batch_sizes, _parallel_sizes, _model_split, _gpus, _engines, _nodes, _placement)
    for rule in (*rules, _group_size, _lengths, _checkpoint):
        errors += rule(cfg, classes)
    if errors:
        raise ConfigError(_listing(errors))


def _listing(errors: list[str]) -> str:
    items = "\n".join("  - " + e.replace("\n", "\n    ") for e in errors)
    return f"invalid config ({len(errors)} problem{'s' * (len(errors) > 1)}):\n{items}"


def _get(cfg: Any, key: str) -> Any:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _targets(cfg: RlxConfig, classes: Classes) -> list[str]:
    """Every `_target_` imports and is a class; the reward fn imports; components' own checks."""
    errors = []
    for group in TARGET_KEYS:
        target = getattr(cfg, group)._target_
        try:
            cls = _locate(target)
        except Exception as e:  # any failure to import is the same user error
            errors.append(f"{group}._target_={target!r} cannot be imported: {e}")
            continue
        if not isinstance(cls, type):
            errors.append(f"{group}._target_={target!r} is a {type(cls).__name__}, not a class")
            continue
        classes[group] = cls
    try:
        load_reward_fn(cfg.rollout.reward_fn)
    except ConfigError as e:
        errors.append(str(e))
    # A component may own rules about its own section (e.g. JsonlSource needs data.prompt_path,
    # an algorithm that KL is penalised in the loss or in the reward, not both).
    for group, cls in classes.items():
        if check := getattr(cls, "config_errors", None):
            errors += check(getattr(cfg, group))
    return errors


def _field_rules(cfg: RlxConfig, classes: Classes) -> list[str]:
    """Each section's single-field rules, declared by its dataclass (`RULES`, rlx.config.rules)."""
    sections = [(f.name, getattr(cfg, f.name)) for f in fields(cfg)]
    return [e for name, section in sections for e in field_errors(section, type(section), name)]


def _positive(cfg: RlxConfig, *keys: str) -> bool:
    """The arithmetic rules need these >= 1 (`_field_rules` reports them when they are not)."""
    return all(_get(cfg, key) >= 1 for key in keys)


def _batch_sizes(cfg: RlxConfig, classes: Classes) -> list[str]:
    r, t = cfg.rollout, cfg.train
    keys = (
        "rollout.batch_size",
        "rollout.n_samples_per_prompt",
        "train.global_batch_size",
        "train.num_steps_per_rollout",
    )
    if not _positive(cfg, *keys):
        return []
    produced = r.batch_size * r.n_samples_per_prompt
    consumed = t.global_batch_size * t.num_steps_per_rollout
    if produced == consumed:
        return []
    fixes = []
    if produced % t.num_steps_per_rollout == 0:
        fixes.append(f"train.global_batch_size={produced // t.num_steps_per_rollout}")
    if consumed % r.n_samples_per_prompt == 0:
        fixes.append(f"rollout.batch_size={consumed // r.n_samples_per_prompt}")
    fix = " or ".join(fixes) or "sizes that satisfy it"
    return [
        "rollout.batch_size × rollout.n_samples_per_prompt must equal "
        "train.global_batch_size × train.num_steps_per_rollout (each rollout batch is trained on "
        f"exactly once), but rollout.batch_size={r.batch_size} × rollout.n_samples_per_prompt="
        f"{r.n_samples_per_prompt} = {produced} and train.global_batch_size={t.global_batch_size} × "
        f"train.num_steps_per_rollout={t.num_steps_per_rollout} = {consumed}; set {fix}"
    ]


def _parallel_sizes(cfg: RlxConfig, classes: Classes) -> list[str]:
    c, t = cfg.cluster, cfg.train
    keys = ("cluster.num_trainer_procs", "cluster.tensor_parallel_size", "cluster.pipeline_parallel_size")
    if not _positive(cfg, *keys, "cluster.num_nodes", "train.global_batch_size", "train.micro_batch_size"):
        return []
    errors = []
    model_parallel = c.tensor_parallel_size * c.pipeline_parallel_size
    if c.num_trainer_procs % model_parallel:
        return errors + [
            f"cluster.num_trainer_procs={c.num_trainer_procs} is not divisible by "
            f"cluster.tensor_parallel_size={c.tensor_parallel_size} × cluster.pipeline_parallel_size="
            f"{c.pipeline_parallel_size} = {model_parallel} (the data-parallel size is their quotient); "
            f"set cluster.num_trainer_procs to a multiple of {model_parallel}"
        ]
    expert_parallel = model_parallel * c.expert_parallel_size
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
            f"(cluster.tensor_parallel_size={c.tensor_parallel_size} × cluster.pipeline_parallel_size="
            f"{c.pipeline_parallel_size})) = {t.micro_batch_size * dp}; {fix}"
        )
    return errors


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, max(at_most, 1) + 1) if n % d == 0)


def _model_split(cfg: RlxConfig, classes: Classes) -> list[str]:
    """Megatron gives each tensor-parallel rank whole heads, whole KV groups and an equal share
    of the vocabulary (rlx does not pad it), and each pipeline stage the same number of layers."""
    c, m = cfg.cluster, cfg.model
    keys = ("model.num_attention_heads", "model.num_query_groups", "model.vocab_size", "model.num_layers")
    if not _positive(cfg, *keys, "cluster.tensor_parallel_size", "cluster.pipeline_parallel_size"):
        return []
    tp, pp = c.tensor_parallel_size, c.pipeline_parallel_size
    fit = _largest_divisor(math.gcd(m.num_attention_heads, m.num_query_groups, m.vocab_size), tp)
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
    if m.num_layers % pp:
        errors.append(
            f"model.num_layers={m.num_layers} is not divisible by cluster.pipeline_parallel_size={pp} (each "
            f"pipeline stage holds as many layers); set cluster.pipeline_parallel_size="
            f"{_largest_divisor(m.num_layers, pp)}"
        )
    return errors


def _gpus(cfg: RlxConfig, classes: Classes) -> list[str]:
    """The trainer's GPUs and the engines' (`cluster.num_rollout_gpus`) fit the nodes: beside each
    other (split) or the same GPUs (colocated). On CPU there are no GPUs to give anyone."""
    c, r = cfg.cluster, cfg.rollout
    if (
        not _positive(cfg, "cluster.num_nodes", "cluster.num_trainer_procs")
        or min(c.num_rollout_gpus, c.gpus_per_node) < 0
    ):
        return []
    if c.gpus_per_node == 0:
        return _cpu_counts(cfg)
    total, trainer, rollout = c.num_nodes * c.gpus_per_node, c.num_trainer_procs, c.num_rollout_gpus
    nodes = f"cluster.num_nodes={c.num_nodes} × cluster.gpus_per_node={c.gpus_per_node}"
    errors = []
    if trainer > total:
        errors.append(
            f"cluster.num_trainer_procs={trainer} is more than the cluster's GPUs ({nodes}); "
            f"set cluster.num_trainer_procs <= {total}"
        )
    if rollout == 0:
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


def _cpu_counts(cfg: RlxConfig) -> list[str]:
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


def _engines(cfg: RlxConfig, classes: Classes) -> list[str]:
    """On GPU clusters the engines fill the rollout GPUs exactly, each on one node."""
    c, r = cfg.cluster, cfg.rollout
    if c.gpus_per_node < 1 or c.num_rollout_gpus < 1 or not _positive(cfg, "rollout.gpus_per_engine"):
        return []
    gpus, per = c.num_rollout_gpus, r.gpus_per_engine
    errors = []
    if per > c.gpus_per_node:
        errors.append(
            f"rollout.gpus_per_engine={per} is more than cluster.gpus_per_node={c.gpus_per_node} (an engine's "
            f"GPUs are on one node); set rollout.gpus_per_engine={_largest_divisor(c.gpus_per_node, per)}"
        )
    engine = classes.get("rollout")
    if per > 1 and isinstance(engine, type) and issubclass(engine, LocalServer):
        errors.append(
            f"rollout.gpus_per_engine={per} with rollout._target_={r._target_!r}: rlx's own engine runs on one "
            f"GPU; set rollout.gpus_per_engine=1 (rollout.num_engines={gpus}), or rollout=sglang for engines "
            "over several GPUs"
        )
    if gpus % per:
        errors.append(
            f"cluster.num_rollout_gpus={gpus} is not divisible by rollout.gpus_per_engine={per} (each engine "
            f"takes {per} GPUs); set cluster.num_rollout_gpus={max(per, gpus - gpus % per)} or "
            f"rollout.gpus_per_engine={_largest_divisor(gpus, per)}"
        )
    elif r.num_engines != gpus // per:
        errors.append(
            f"rollout.num_engines={r.num_engines} must equal cluster.num_rollout_gpus={gpus} / "
            f"rollout.gpus_per_engine={per} = {gpus // per} (the engines fill the rollout GPUs); "
            f"set rollout.num_engines={gpus // per}"
        )
    return errors


def _nodes(cfg: RlxConfig, classes: Classes) -> list[str]:
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
            f"{_largest_divisor(c.gpus_per_node, tp)}"
        )
    return errors


def _placement(cfg: RlxConfig, classes: Classes) -> list[str]:
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
    if cfg.rollout.gpus_per_engine != 1:
        return [
            f"cluster.colocate=true puts one engine on each trainer GPU, but rollout.gpus_per_engine="
            f"{cfg.rollout.gpus_per_engine}; set rollout.gpus_per_engine=1 or cluster.colocate=false"
        ]
    return []


def _group_size(cfg: RlxConfig, classes: Classes) -> list[str]:
    # The algorithm class says how many samples per prompt it needs (GRPO-style group
    # normalisation: 2), so no rule here names an algorithm.
    need = getattr(classes.get("algo"), "min_group_size", DEFAULT_MIN_GROUP_SIZE)
    n = cfg.rollout.n_samples_per_prompt
    if n >= need:
        return []
    return [
        f"rollout.n_samples_per_prompt={n} is too small for algo._target_={cfg.algo._target_!r}, "
        f"which normalises rewards within each prompt's group and needs >= {need} samples per prompt; "
        f"set rollout.n_samples_per_prompt={max(need, 8)}, say"
    ]


def _lengths(cfg: RlxConfig, classes: Classes) -> list[str]:
    context, response = cfg.model.max_position_embeddings, cfg.rollout.max_response_len
    prompt = cfg.data.max_prompt_len
    if response >= context:
        return [
            f"rollout.max_response_len={response} must be < model.max_position_embeddings={context} "
            f"(the prompt needs room too); lower rollout.max_response_len"
        ]
    if prompt is not None and prompt + response >= context:
        # SGLang refuses a request whose input and max_new_tokens reach the context length
        return [
            f"data.max_prompt_len={prompt} + rollout.max_response_len={response} = {prompt + response} reaches "
            f"model.max_position_embeddings={context} (SGLang refuses such requests); set "
            f"data.max_prompt_len={max_prompt_len(context, response)} (or null for that default)"
        ]
    return []


def _checkpoint(cfg: RlxConfig, classes: Classes) -> list[str]:
    path = cfg.model.hf_checkpoint
    if path is None:
        if cfg.model.tiny:
            return []
        return [
            "model.hf_checkpoint is not set and model.tiny=false; set model.hf_checkpoint=/path/to/hf_model_dir"
        ]
    where = Path(to_absolute_path(str(Path(path).expanduser())))
    if not where.is_dir():
        return [
            f"model.hf_checkpoint={path!r} is not a directory ({where}); point it at an HF model directory"
        ]
    if not (where / "config.json").is_file():
        return [
            f"model.hf_checkpoint={path!r} has no config.json ({where}); point it at an HF model "
            "directory (config.json, *.safetensors, tokenizer files)"
        ]
    return []


def max_prompt_len(context: int, response: int) -> int:
    """The longest prompt an engine accepts with `response` new tokens: SGLang requires
    input + max_new_tokens < context length."""
    return context - response - 1
