"""Cross-group config rules, checked before Ray starts or any model is built.

Hydra's typed schemas already reject unknown keys and wrong types at compose time; these are
the rules a single field's type cannot express. Every violation is collected, then one
ConfigError lists them all, each naming the keys, their values and the fix.
"""

from __future__ import annotations

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
    for rule in (_field_rules, _batch_sizes, _parallel_sizes, _placement, _group_size, _lengths, _checkpoint):
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
    if c.gpus_per_node > 0 and c.num_trainer_procs > c.num_nodes * c.gpus_per_node:
        errors.append(
            f"cluster.num_trainer_procs={c.num_trainer_procs} is more than the cluster's GPUs "
            f"(cluster.num_nodes={c.num_nodes} × cluster.gpus_per_node={c.gpus_per_node}); "
            f"set cluster.num_trainer_procs <= {c.num_nodes * c.gpus_per_node}"
        )
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


def _placement(cfg: RlxConfig, classes: Classes) -> list[str]:
    if not cfg.cluster.colocate:
        return []
    return [
        "cluster.colocate=true is not supported yet (engines and trainer on the same GPUs, alternating, "
        "comes with the GPU placement work); set cluster.colocate=false"
    ]


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
    if prompt is not None and prompt + response > context:
        return [
            f"data.max_prompt_len={prompt} + rollout.max_response_len={response} = {prompt + response} exceeds "
            f"model.max_position_embeddings={context}; set data.max_prompt_len={context - response} "
            "(or null for that default)"
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
