"""Cross-group config rules, checked before Ray starts or any model is built.

Hydra's typed schemas already reject misspelled keys and wrong types at compose time; keys
added with a leading `+` (which Hydra lets into typed nodes) are caught here (`rlx.config.keys`),
with the rules a single field's type cannot express. Every violation is collected, then one
ConfigError lists them all, each naming the keys, their values and the fix.
"""

from __future__ import annotations

from dataclasses import fields

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlx.config.build import build, locate
from rlx.config.keys import CONF_DIR, unknown_key_errors, yaml_value
from rlx.config.layout import (
    Classes,
    engines,
    get,
    gpus,
    model_split,
    nodes,
    parallel_sizes,
    placement,
    positive,
)
from rlx.config.memory_check import memory_rule
from rlx.config.rules import field_errors
from rlx.config.schema import RlxConfig
from rlx.errors import ConfigError
from rlx.reward import config_errors as reward_errors
from rlx.rollout.filters import load_filter
from rlx.rollout.generate import load_generate_fn
from rlx.rollout.mode_rules import mode_errors
from rlx.rollout.replay import rollouts_dir

TARGET_KEYS = ("model", "algo", "rollout", "data")  # groups whose `_target_` names a class
# classes that were renamed: old `_target_` -> new (a saved config.yaml or a user's option file may name the old)
RENAMED_TARGETS = {
    "rlx.rollout.servers.LocalServer": "rlx.rollout.launchers.LocalLauncher",
    "rlx.rollout.servers.SGLangServer": "rlx.rollout.launchers.SGLangLauncher",
}
# the data options that name their task's reward (reward.fn); the message for a run without one
# lists them (tests/config/test_tasks.py checks that it is every such option)
TASK_PRESETS = ("data=math", "data=toy_copy", "data=toy_reverse")
DEFAULT_MIN_GROUP_SIZE = 2  # group normalisation needs >= 2 samples; an algo class may say otherwise

# Keys that take effect only when a switch key is on (set, not false/None/0): one set with its
# switch off does nothing, which is always a mistake (the switch forgotten, or the wrong model).
# (Not algo.use_kl_loss & co.: turning a shipped option's term off keeps its coefficient.)
SWITCHED_KEYS: dict[str, tuple[str, ...]] = {
    "model.rope_scaling_factor": tuple(
        f"model.rope_scaling_{k}"
        for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    ),
    "model.yarn_rotary_scaling_factor": tuple(
        f"model.yarn_{k}"
        for k in ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    ),
    "model.num_moe_experts": tuple(
        f"model.moe_{k}"
        for k in (
            "router_topk",
            "ffn_hidden_size",
            "shared_expert_intermediate_size",
            "router_score_function",
            "router_norm_topk_prob",
            "router_topk_scaling_factor",
            "router_num_groups",
            "router_group_topk",
            "router_enable_expert_bias",
            "router_bias_update_rate",
            "first_dense_layers",
            "aux_loss_coeff",
            "token_dispatcher_type",
        )
    ),  # fmt: skip
    "train.lora.rank": tuple(f"train.lora.{k}" for k in ("alpha", "dropout", "target_modules", "experts")),
    "model.kv_lora_rank": tuple(
        f"model.{k}" for k in ("q_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
    ),
}

# TransformerConfig's parallel sizes come from megatron's parallel state, which the cluster keys
# set up; one given in model.megatron_overrides would disagree with it
PARALLEL_OVERRIDES = {
    "tensor_model_parallel_size": "cluster.tensor_parallel_size",
    "pipeline_model_parallel_size": "cluster.pipeline_parallel_size",
    "context_parallel_size": "cluster.context_parallel_size",
    "expert_model_parallel_size": "cluster.expert_parallel_size",
}


# id(config) -> its YAML when `validate` last passed it: `validate_once` skips a config passed unchanged
_PASSED: dict[int, str] = {}


def validate_once(cfg: DictConfig) -> None:
    """`validate`, unless this very config passed it and has not changed since: a launch checks its
    config once, where it is composed (`compose`, or `launch.py` through `rlx.launcher.job`), and the
    loop (`rlx.runtime.run`) checks again only a config changed after that, or never checked."""
    if _PASSED.get(id(cfg)) != OmegaConf.to_yaml(cfg):
        validate(cfg)


def validate(cfg: DictConfig | RlxConfig) -> None:
    """Raise one ConfigError listing every rule `cfg` breaks; return None if it breaks none."""
    errors = []
    composed = cfg
    if isinstance(cfg, DictConfig):
        missing = sorted(OmegaConf.missing_keys(cfg))
        if missing:  # `???` in a config file: the other rules need every value
            raise ConfigError(
                _listing([f"{key} is required (it is ??? in the config); set {key}=..." for key in missing])
            )
        errors += unknown_key_errors(cfg)  # `+key=value`: gone from the dataclasses, so checked here
        try:
            cfg = OmegaConf.to_object(cfg)
        except OmegaConfBaseException as e:
            raise ConfigError(str(e)) from e
    if not isinstance(cfg, RlxConfig):
        raise ConfigError(
            f"the config was not composed on rlx's schema (got {type(cfg).__name__}); a config file of "
            "its own must start with `defaults: [rlx_config, _self_]`"
        )
    classes: Classes = {}
    errors += _targets(cfg, classes)
    rules = (
        _field_rules,
        _switched,
        _parallel_overrides,
        _batch_sizes,
        parallel_sizes,
        model_split,
        gpus,
        engines,
        nodes,
        placement,
    )
    for rule in (*rules, _model_shape, _lora, _loggers, _reward, _rollout_mode, _debug, _evaluation, _group_size, _lengths,
                 _checkpoint):  # fmt: skip
        errors += rule(cfg, classes)
    if not errors:  # Megatron's own checks last: they import megatron-core (seconds, once a process)
        errors += _megatron(cfg, classes)
    if not errors and not cfg.run.plan_only:  # the plan needs a model and layout the rules accept;
        errors += memory_rule(cfg, classes)  # run.plan_only prints it, refusal included (rlx.launcher.job)
    if errors:
        raise ConfigError(_listing(errors))
    if isinstance(composed, DictConfig):
        if len(_PASSED) > 64:  # a long-lived process (a sweep, a notebook): the newest only
            _PASSED.clear()
        _PASSED[id(composed)] = OmegaConf.to_yaml(composed)


def _loggers(cfg: RlxConfig, classes: Classes) -> list[str]:
    """run.loggers: known sinks, their packages installed (rlx.tracking.sinks)."""
    from rlx.tracking.sinks import logger_errors

    return logger_errors(cfg.run.loggers)


def _model_shape(cfg: RlxConfig, classes: Classes) -> list[str]:
    """The model's shape keys between themselves (rlx.models.config.shape_errors)."""
    from rlx.models.config import shape_errors

    return shape_errors(cfg.model)


def _megatron(cfg: RlxConfig, classes: Classes) -> list[str]:
    """Megatron's TransformerConfig built for the model and layout, its refusal in rlx's keys
    (rlx.trainer.megatron_check); only for rlx's Megatron families (a model class of the user's
    own that is no `ModelFamily` is left to itself)."""
    from rlx.models.family import ModelFamily

    if not (isinstance(classes.get("model"), type) and issubclass(classes["model"], ModelFamily)):
        return []
    from rlx.trainer.megatron_check import megatron_errors

    return megatron_errors(cfg)


def _lora(cfg: RlxConfig, classes: Classes) -> list[str]:
    """train.lora: its fields, its layer names against the model's, the algorithm (rlx.lora.rules)."""
    from rlx.lora.rules import lora_errors
    from rlx.models.family import ModelFamily

    model, algo = classes.get("model"), classes.get("algo")
    if not cfg.train.lora.enabled:
        return lora_errors(cfg, None, False)
    family = build(cfg.model) if isinstance(model, type) and issubclass(model, ModelFamily) else None
    return lora_errors(cfg, family, bool(algo and build(cfg.algo).needs_critic))


def _reward(cfg: RlxConfig, classes: Classes) -> list[str]:
    """reward.fn or reward.url scores the samples (rlx.reward.config_errors)."""
    return reward_errors(cfg.reward, cfg.rollout.generate_fn, TASK_PRESETS)


def _rollout_mode(cfg: RlxConfig, classes: Classes) -> list[str]:
    """rollout.mode, staleness and over-sampling against each other, the placement and the algorithm."""
    errors = mode_errors(cfg.rollout, cfg.cluster.colocate, cfg.algo.use_tis)
    for path, load in ((cfg.rollout.filter_fn, load_filter), (cfg.rollout.generate_fn, load_generate_fn)):
        try:
            if path:
                load(path)
        except ConfigError as e:
            errors.append(str(e))
    return errors


def _debug(cfg: RlxConfig, classes: Classes) -> list[str]:
    """debug.rollout_only / debug.train_only: one half of the loop alone."""
    d, errors = cfg.debug, []
    if d.rollout_only and d.train_only:
        errors.append(
            "debug.rollout_only=true and debug.train_only=true leave nothing to run; set one of them"
        )
    if d.train_only and not d.load_rollouts:
        errors.append(
            "debug.train_only=true trains on dumped batches; set debug.load_rollouts=RUN_DIR (a run's directory)"
        )
    if d.load_rollouts and not d.train_only:
        errors.append(
            f"debug.load_rollouts={d.load_rollouts!r} is read only with debug.train_only=true; set it, or drop the key"
        )
    if d.train_only and d.load_rollouts and not list(rollouts_dir(d.load_rollouts).glob("step_*.jsonl")):
        errors.append(
            f"debug.load_rollouts={d.load_rollouts!r}: no rollouts/step_NNNNNN.jsonl there; give the directory of a "
            "run that had run.dump_rollouts=true"
        )
    if d.profile_train_steps and d.rollout_only:
        errors.append(
            f"debug.profile_train_steps={list(d.profile_train_steps)} profiles the trainer, which "
            "debug.rollout_only=true leaves out; drop one of them"
        )
    if outside := [s for s in d.profile_train_steps if not 0 <= s < cfg.run.num_rollout]:
        errors.append(
            f"debug.profile_train_steps: step{'s' * (len(outside) > 1)} {', '.join(map(str, outside))} "
            f"never run{'s' * (len(outside) == 1)} (steps are 0 to run.num_rollout - 1 = {cfg.run.num_rollout - 1})"
        )
    if d.rollout_only and cfg.rollout.mode == "async":
        errors.append(
            "debug.rollout_only=true with rollout.mode=async: no trainer makes new versions to pace on; set rollout.mode=sync"
        )
    return errors


def _evaluation(cfg: RlxConfig, classes: Classes) -> list[str]:
    """run.eval_interval and data.eval go together."""
    if cfg.run.eval_interval and not cfg.data.eval:
        return [
            f"run.eval_interval={cfg.run.eval_interval} but data.eval names no set; add one, e.g. "
            "'+data.eval={test: {path: test.jsonl}}', or set run.eval_interval=0"
        ]
    if cfg.data.eval and not cfg.run.eval_interval:
        return [
            f"data.eval names sets ({', '.join(cfg.data.eval)}) but run.eval_interval=0 never evaluates them; set run.eval_interval=N, or data.eval=null to drop them"
        ]
    return []


def _listing(errors: list[str]) -> str:
    items = "\n".join("  - " + e.replace("\n", "\n    ") for e in errors)
    return f"invalid config ({len(errors)} problem{'s' * (len(errors) > 1)}):\n{items}"


def _targets(cfg: RlxConfig, classes: Classes) -> list[str]:
    """Every `_target_` imports and is a class; components' own checks."""
    errors = []
    for group in TARGET_KEYS:
        target = getattr(cfg, group)._target_
        fix = f"set {group}._target_ to an importable class (package.module.Class), or {group}={_options(group)}"
        if target in RENAMED_TARGETS:
            errors.append(
                f"{group}._target_={target!r} was renamed; set {group}._target_={RENAMED_TARGETS[target]}"
            )
            continue
        try:
            cls = locate(target)
        except ImportError as e:
            errors.append(f"{group}._target_={target!r} cannot be imported: {e}; {fix}")
            continue
        if not isinstance(cls, type):
            errors.append(f"{group}._target_={target!r} is a {type(cls).__name__}, not a class; {fix}")
            continue
        classes[group] = cls
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


def _options(group: str) -> str:
    """A shipped option of `group` (conf/GROUP/*.yaml), as "a|b|c"."""
    return "|".join(sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml")))


def _switched(cfg: RlxConfig, classes: Classes) -> list[str]:
    """A key of `SWITCHED_KEYS` changed from its default while its switch is off."""
    defaults, errors = RlxConfig(), []
    for switch, keys in SWITCHED_KEYS.items():
        if get(cfg, switch):
            continue
        for key in keys:
            value, default = get(cfg, key), get(defaults, key)
            if value != default:
                errors.append(
                    f"{key}={yaml_value(value)} takes effect only when {switch} is set, but "
                    f"{switch}={yaml_value(get(cfg, switch))}: it would be ignored; set {switch} too, or leave "
                    f"{key} at its default ({yaml_value(default)})"
                )
    return errors


def _parallel_overrides(cfg: RlxConfig, classes: Classes) -> list[str]:
    """A parallel size in model.megatron_overrides instead of its cluster key."""
    return [
        f"model.megatron_overrides.{key}={yaml_value(cfg.model.megatron_overrides[key])}: the trainer's parallel "
        f"sizes are set by the cluster keys (megatron's parallel state is built from them); remove it and set "
        f"{cluster_key}={yaml_value(cfg.model.megatron_overrides[key])}"
        for key, cluster_key in PARALLEL_OVERRIDES.items()
        if key in cfg.model.megatron_overrides
    ]


def _batch_sizes(cfg: RlxConfig, classes: Classes) -> list[str]:
    r, t = cfg.rollout, cfg.train
    keys = (
        "rollout.batch_size",
        "rollout.n_samples_per_prompt",
        "train.global_batch_size",
        "train.num_steps_per_rollout",
    )
    if not positive(cfg, *keys):
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
    from rlx.models.hf_checkpoint import local_errors, local_path  # repo ids: resolved by compose

    return local_errors(path, local_path(path))


def max_prompt_len(context: int, response: int) -> int:
    """The longest prompt an engine accepts with `response` new tokens: SGLang requires
    input + max_new_tokens < context length."""
    return context - response - 1


def run_max_prompt_len(rc) -> int:
    """The longest prompt a run's data keeps (`rc`: an RlxConfig): `data.max_prompt_len`, or
    all the context the longest response leaves."""
    return rc.data.max_prompt_len or max_prompt_len(
        rc.model.max_position_embeddings, rc.rollout.max_response_len
    )
