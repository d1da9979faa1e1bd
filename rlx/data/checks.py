"""Checks of data config and rows, shared by the built-in sources: the row filter and system prompt
keys, the `data.eval` sets, a prompt's shape (text or chat messages) and a label's type."""

from __future__ import annotations

import math
from typing import Any

from rlx.config.build import locate
from rlx.config.rules import field_errors
from rlx.data.config import DataConfig, EvalSetConfig, eval_set_config, key_name
from rlx.data.readers import path_errors

ROLES = ("system", "user", "assistant", "tool")  # chat roles a prompt's messages may have


def eval_set_errors(cfg: DataConfig) -> list[str]:
    """Mistakes in the `data.eval` sets (whatever source `data._target_` names), each naming the
    set's key: rules, the file, the row filter, a system prompt without a chat template."""
    errors = []
    for name, eval_set in cfg.eval.items():
        errors += field_errors(eval_set, EvalSetConfig, f"data.eval.{name}")
        errors += path_errors(key_name("prompt_path", name), eval_set.path)
        # a system prompt both inherit is reported once, as data.system_prompt
        inherited = eval_set.system_prompt is None and eval_set.apply_chat_template is None
        errors += format_errors(eval_set_config(cfg, name), name, system_prompt=not inherited)
    return errors


def format_errors(cfg: DataConfig, eval_set: str | None = None, system_prompt: bool = True) -> list[str]:
    """The row filter imports and is callable; a system prompt has a chat template to go into."""
    errors = []
    if cfg.filter:
        setting = key_name("filter", eval_set)
        try:
            keep = locate(cfg.filter)
        except ImportError as e:
            errors.append(f"{setting}={cfg.filter!r} cannot be imported: {e}; set it to module.function")
        else:
            if not callable(keep):
                errors.append(
                    f"{setting}={cfg.filter!r} is a {type(keep).__name__}, not a function (row: dict) -> bool"
                )
    if system_prompt and cfg.system_prompt and not cfg.apply_chat_template:
        errors.append(
            f"{key_name('system_prompt', eval_set)} is set but {key_name('apply_chat_template', eval_set)}"
            f"=false, so there is no chat to put it in; set {key_name('apply_chat_template', eval_set)}=true"
        )
    return errors


def prompt_problem(prompt: Any, setting: str, key: str) -> tuple[str, str] | None:
    """(reason, detail) when `prompt` is neither non-blank text nor well-formed chat messages."""
    if isinstance(prompt, str):
        return None if prompt.strip() else ("empty prompt", f"empty prompt ({setting}={key!r})")
    if not isinstance(prompt, list):
        kind = type(prompt).__name__
        return "bad prompt type", f"the prompt must be a string or a list of chat messages, got {kind}"
    if not prompt:
        return "empty prompt", f"empty prompt ({setting}={key!r}): no messages"
    for i, m in enumerate(prompt):
        if not isinstance(m, dict):
            return (
                "bad message",
                f"message {i} must be an object {{'role': ..., 'content': ...}}, got {type(m).__name__} "
                f"(a list prompt is read as chat messages; a prompt of text is a string in {setting}={key!r})",
            )
        if m.get("role") not in ROLES:
            got = f"role {m['role']!r}" if "role" in m else "no 'role'"
            return "bad message", f"message {i} has {got}; a role is one of {list(ROLES)}"
        if not isinstance(m.get("content"), str):
            got = type(m["content"]).__name__ if "content" in m else "no 'content'"
            return "bad message", f"message {i} ({m['role']}) has {got}; its 'content' must be a string"
    if not any(m["content"].strip() for m in prompt):
        return "empty prompt", f"empty prompt ({setting}={key!r}): every message is blank"
    return None


def json_problem(value: Any) -> str | None:
    """What makes `value` something other than a JSON value (None when it is one). Labels are
    dumped with each rollout and hashed for resume, so they must survive JSON."""
    if value is None or isinstance(value, (str, bool, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"is {value}, not a finite number"
    if isinstance(value, (list, tuple)):
        return next((p for p in map(json_problem, value) if p), None)
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return "is an object with keys that are not strings"
        return next((p for p in map(json_problem, value.values()) if p), None)
    return f"is of type {type(value).__name__}, not a string, number, bool, list or object"
