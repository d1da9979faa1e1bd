"""Which keys exist: unknown keys (also those added with a leading `+`) and Hydra's override errors,
each rewritten as one message that names the key, suggests the closest real key and the fix.

The schema dataclasses are the only source of keys. A dict-typed field (`rollout.engine_args`,
`rollout.router_args`, `model.megatron_overrides`) is a pass-through map: any key may be added
under it with a leading `+`, and it goes to the engine, router or Megatron unchanged.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlx.config.schema import RlxConfig

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the shipped config groups
LISTS_EVERY_KEY = "`python launch.py --cfg job` prints every key"
# keys that moved: old name -> (new name, why); the old name is answered with the new one, on the
# command line (with or without +), in a YAML file and in launch.py's arguments (`moved_overrides`)
MOVED_KEYS: dict[str, tuple[str, str]] = {
    "run.tensorboard": (
        "run.loggers",
        "every sink is in one list: run.loggers=[jsonl] for metrics.jsonl alone, [jsonl,tensorboard] the default",
    ),
    "rollout.reward_fn": (
        "reward.fn",
        "the task names its reward beside its prompts: data=math, data=toy_copy set it",
    ),
}


# verl's keys (ppo_trainer.yaml), which its users type first: the rlx key, or how to say it here
VERL_KEYS: dict[str, str] = {
    "data.train_files": "data.prompt_path=FILE (.jsonl, .json or .parquet)",
    "data.val_files": "'+data.eval={test: {path: FILE}}' with run.eval_interval=N",
    "data.prompt_key": "data.input_key=KEY",
    "data.max_prompt_length": "data.max_prompt_len=N",
    "data.max_response_length": "rollout.max_response_len=N",
    "data.train_batch_size": "rollout.batch_size=N (prompts a step)",
    "actor_rollout_ref.model.path": "model.hf_checkpoint=DIR (an HF directory or repo id)",
    "actor_rollout_ref.rollout.n": "rollout.n_samples_per_prompt=N",
    "actor_rollout_ref.rollout.temperature": "rollout.temperature=T",
    "actor_rollout_ref.rollout.top_p": "rollout.top_p=P",
    "actor_rollout_ref.actor.optim.lr": "train.lr=LR",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "train.global_batch_size=N (samples an optimizer step)",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "train.micro_batch_size=N",
    "actor_rollout_ref.actor.clip_ratio": "algo.eps_clip=E",
    "actor_rollout_ref.actor.use_kl_loss": "algo.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_coef": "algo.kl_loss_coef=C",
    "actor_rollout_ref.actor.entropy_coeff": "algo.entropy_coef=C",
    "algorithm.adv_estimator": "algo=grpo (or gspo, ppo, reinforce_pp, ...: the algo group)",
    "custom_reward_function.path": "reward.fn=module.function, the module's directory on PYTHONPATH",
    "custom_reward_function.name": "reward.fn=module.function, the module's directory on PYTHONPATH",
    "trainer.total_training_steps": "run.num_rollout=N",
    "trainer.n_gpus_per_node": "cluster.gpus_per_node=N",
    "trainer.nnodes": "cluster.num_nodes=N",
    "trainer.save_freq": "run.save=true run.save_interval=N",
    "trainer.test_freq": "run.eval_interval=N",
    "trainer.logger": "run.loggers=[jsonl,tensorboard,wandb]",
    "trainer.project_name": "run.project=NAME",
    "trainer.experiment_name": "run.name=NAME",
}


def schema_keys(schema: type = RlxConfig, prefix: str = "") -> dict[str, Any]:
    """Every real dotted key of `schema` -> its default (pass-through maps as one key, default {})."""
    keys: dict[str, Any] = {}
    for f in fields(schema):
        key = f"{prefix}{f.name}"
        default = f.default_factory() if f.default_factory is not MISSING else f.default
        if is_dataclass(default):
            keys |= schema_keys(type(default), f"{key}.")
        else:
            keys[key] = default
    return keys


def pass_through_maps(schema: type = RlxConfig) -> list[str]:
    """The dict-typed keys, which take new keys (added with a leading `+`)."""
    return [key for key, default in schema_keys(schema).items() if isinstance(default, dict)]


def unknown_key_errors(cfg: DictConfig) -> list[str]:
    """One message per key of `cfg` that no schema field declares (Hydra adds `+key=value` even
    to typed nodes), pass-through maps excepted."""
    errors = []
    for key in _extra_keys(cfg, ""):
        if message := moved(key):
            errors.append(message)
            continue
        if "." not in key:  # `+name=...` at the top: Hydra adds a key when conf/name/ is no group
            errors.append(
                f"{key} is neither a config group (no {CONF_DIR / key}/) nor a key; remove +{key}=..."
            )
            continue
        errors.append(f"{key} does not exist (it was added with a leading +, which only pass-through maps take: "
                      f"{', '.join(pass_through_maps())}); {suggest(key)}")  # fmt: skip
    return errors


def _extra_keys(node: DictConfig, prefix: str) -> list[str]:
    schema = OmegaConf.get_type(node)
    if not (isinstance(schema, type) and is_dataclass(schema)):
        # a map: any key, but values typed by a schema (data.eval's sets) are checked in turn
        return [k for name in node.keys() for k in _typed_child_keys(node, name, f"{prefix}{name}.")]
    declared = {f.name for f in fields(schema)}
    extra = []
    for name in node.keys():
        key = f"{prefix}{name}"
        if name not in declared:
            extra.append(key)
            continue
        extra += _typed_child_keys(node, name, f"{key}.")
    return extra


def _typed_child_keys(node: DictConfig, name: Any, prefix: str) -> list[str]:
    child = node._get_node(name)
    if isinstance(child, DictConfig) and not child._is_none() and not child._is_missing():
        schema = OmegaConf.get_type(child)
        if isinstance(schema, type) and is_dataclass(schema):
            return _extra_keys(child, prefix)
    return []


def moved(key: str) -> str | None:
    """The message for a key of `MOVED_KEYS` (None for any other key)."""
    if key not in MOVED_KEYS:
        return None
    new, why = MOVED_KEYS[key]
    return f"{key} has moved to {new} ({why}); set {new}=... instead of {key}=..."


def moved_overrides(overrides: list[str]) -> list[str]:
    """The `moved` message of each command-line override that sets a moved key (`+`, `++`, `~` too)."""
    keys = (arg.split("=", 1)[0].lstrip("+~") for arg in overrides if not arg.startswith("-"))
    return [message for key in keys if (message := moved(key))]


def suggest(key: str, schema: type | None = None) -> str:
    """'did you mean KEY2? set KEY2=...' for the closest real key (difflib), or where keys are listed.
    `schema`: the dataclass of `key`'s parent node, when it is not reachable from the root's
    defaults (a value of a typed map such as data.eval.NAME)."""
    if key in VERL_KEYS:
        return f"it is verl's key; here write {VERL_KEYS[key]} ({LISTS_EVERY_KEY})"
    parent = key.rsplit(".", 1)[0]
    keys = [f"{parent}.{f.name}" for f in fields(schema)] if schema else list(schema_keys())
    close = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if not close:  # the nearest key of the same section, if the section exists
        section = key.rsplit(".", 1)[0] + "."
        same = [k for k in keys if k.startswith(section)]
        close = difflib.get_close_matches(key, same, n=1, cutoff=0.0)
    if not close:
        return f"remove it ({LISTS_EVERY_KEY})"
    return f"did you mean {close[0]}? set {close[0]}=... instead ({LISTS_EVERY_KEY})"


_NO_KEY = re.compile(r"Could not (?:override|append to) '([^']+)'")
_MERGE = re.compile(r"Error merging override ([^=\s]+)=(.*)")
_YAML_KEY = re.compile(r"Key '[^']+' not in '\w+'\n\s+full_key: (\S+)")  # a config file's unknown key
_IN_FILE = re.compile(r"^In '([^']+)'")  # the option file Hydra was merging ("algo/mygrpo")
_NO_EQUAL = re.compile(r"Error parsing override '([^'=]+)'\nmissing EQUAL")
_PARSE = re.compile(r"Error parsing override '([^']+)'\n(.*)")
_NOT_OPTIONAL = re.compile(r"Error merging override ([^=\s]+)=null\nfield '[^']+' is not Optional")
GRAMMAR = "https://hydra.cc/docs/advanced/override_grammar/basic/"
_CONVERT = re.compile(r"could not be converted to (\w+)|is not a valid (bool)")
_TYPE_NAMES = {"Float": "a number", "Integer": "an integer", "bool": "true or false", "String": "a string"}


def _home_value(override: str) -> tuple[str, str] | None:
    """(key, value) of an override whose value starts with ~/ (a home-relative path); else None."""
    key, _, value = override.partition("=")
    return (key.lstrip("+~"), value) if value.startswith("~/") else None


def explain_override_error(
    text: str, cause: BaseException | None, search_dirs: list[Path] = ()
) -> str | None:
    """A clear message for Hydra's 'Could not override' (no such key), 'Error merging override'
    (wrong type, null for a key that takes none) and 'Error parsing override' errors, for an
    unknown key in an option file (named: the first of `search_dirs` that holds it), and for a
    moved key (`MOVED_KEYS`) on the command line or in a config file: the key, what is wrong, the
    fix. None for other errors."""
    if match := _NO_EQUAL.search(text):
        key = match.group(1).lstrip("+~")
        default = schema_keys().get(key, MISSING)
        example = f" (e.g. {key}={yaml_value(default)}, the default)" if default is not MISSING else ""
        return f"{key} is given no value on the command line; write {key}=VALUE{example}"
    if (match := _PARSE.search(text)) and (home := _home_value(match.group(1))):
        key, value = home
        return (
            f"{key}={value}: Hydra's grammar takes no bare ~ (and the shell expands none after a dotted "
            f"key's =); write {key}=$HOME{value[1:]}, or quote it: '{key}=\"{value}\"' (rlx expands a "
            "quoted ~ in paths)"
        )
    if match := _PARSE.search(text):
        return (
            f"the override {match.group(1)!r} cannot be read ({match.group(2).strip()}); quote a value that "
            f"holds commas, brackets or spaces (key='a,b'), and see {GRAMMAR}"
        )
    if match := _NOT_OPTIONAL.search(text):
        key = match.group(1).lstrip("+~")
        default = schema_keys().get(key, MISSING)
        example = (
            f", e.g. {key}={yaml_value(default)} (the default)" if default not in (MISSING, None) else ""
        )
        return f"{key}=null: {key} cannot be null; give it a value{example}"
    if (match := _YAML_KEY.search(text)) and (file := _IN_FILE.search(text)) and not moved(match.group(1)):
        key, option = match.group(1), file.group(1)
        path = next((d / f"{option}.yaml" for d in search_dirs if (d / f"{option}.yaml").exists()), None)
        where = f"{path}" if path else f"the option file {option}.yaml"
        parent, name = key.rsplit(".", 1)
        names = [k.removeprefix(f"{parent}.") for k in schema_keys() if k.startswith(f"{parent}.")]
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        fix = (
            f"did you mean {parent}.{close[0]}? rename {name} to {close[0]} there"
            if close
            else f"remove {name} there"
        )
        return f"{key} does not exist (set in {where}); {fix} ({LISTS_EVERY_KEY})"
    if match := _NO_KEY.search(text):
        key = match.group(1)
        if message := moved(key):
            return message
        parent = key.rsplit(".", 1)[0]
        if parent in pass_through_maps():
            return f"{key} is a new key of the pass-through map {parent}; add it with a leading +: +{key}=..."
        return f"{key} does not exist; {suggest(key)}"
    if (match := _YAML_KEY.search(text)) and (message := moved(match.group(1))):
        return message  # the old key in a config file
    if cause is not None and (full_key := getattr(cause, "full_key", None)) and "not in '" in str(cause):
        schema = getattr(cause, "object_type", None)  # e.g. `+data.eval={a:{pth:...}}`
        return f"{full_key} does not exist; {suggest(full_key, schema if is_dataclass(schema) else None)}"
    if (match := _MERGE.search(text)) and cause is not None:
        key, value = match.group(1).lstrip("+~"), match.group(2)
        full_key = getattr(cause, "full_key", None) or key
        wanted = _CONVERT.search(str(cause))
        kind = _TYPE_NAMES.get(wanted.group(wanted.lastindex)) if wanted else None
        default = schema_keys().get(key, MISSING)
        if kind is None or default is MISSING:
            return None
        example = f", e.g. {key}={yaml_value(default)} (the default)" if default is not None else ""
        if full_key != key:  # an item of a list
            return f"{key}={value}: {full_key} is not {kind}; set {key} to a list of {kind[kind.index(' ') + 1 :]}s{example}"
        return f"{key}={value}: {value} is not {kind}; set {key} to {kind}{example}"
    return None


def yaml_value(value: Any) -> str:
    """`value` as a command-line override writes it (true, null, [])."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return "[]" if value == [] else str(value)
