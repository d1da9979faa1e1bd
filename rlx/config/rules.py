"""Single-field rules that a config dataclass declares beside its fields.

Each schema dataclass may carry `RULES: ClassVar[dict[str, Rule]]`, field name -> rule, so a
field's allowed values live with the field (and, for choices, come from the registry in the
code that uses them). `rlx.config.validate` checks every section's rules before anything
starts. This module imports nothing heavy: trainer ranks and engines import the schemas too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, get_args


@dataclass(frozen=True)
class Rule:
    """A requirement on one value: `text` completes "KEY=VALUE must be ...", `check` tests it."""

    text: str
    check: Callable[[Any], bool]
    example: Any = None  # a value that satisfies the rule, offered in the fix (choices only)
    fix: str | None = None  # the fix, where "set KEY to a value TEXT" would not read

    def error(self, key: str, value: Any) -> str | None:
        """None when `value` satisfies the rule (None values are allowed where the schema allows
        them), else a message naming the key, the value and the fix."""
        if value is None or self.check(value):
            return None
        if self.example is not None:
            return f"{key}={value!r} is not one of {self.text}; set {key}={self.example}, say"
        return f"{key}={value!r} must be {self.text}; {self.fix or f'set {key} to a value {self.text}'}"


POSITIVE = Rule("> 0", lambda v: v > 0)
AT_LEAST_1 = Rule(">= 1", lambda v: v >= 1)
NON_NEGATIVE = Rule(">= 0", lambda v: v >= 0)
UNIT_OPEN_LOW = Rule("in (0, 1]", lambda v: 0 < v <= 1)
UNIT_OPEN_HIGH = Rule("in [0, 1)", lambda v: 0 <= v < 1)
UNIT = Rule("in [0, 1]", lambda v: 0 <= v <= 1)
TOP_K = Rule("-1 (off) or >= 1", lambda v: v == -1 or v >= 1)


def one_of(choices: Iterable[str] | Any) -> Rule:
    """The value must be one of `choices`: an iterable of names (a registry's keys) or a `Literal` type."""
    names = list(get_args(choices)) if _is_literal(choices) else list(choices)
    return Rule(str(names), lambda v: v in names, example=names[0])


def _is_literal(obj: Any) -> bool:
    return getattr(obj, "__origin__", None) is Literal


def rules_of(schema: type) -> dict[str, Rule]:
    """The `RULES` a schema dataclass declares ({} when none)."""
    return dict(getattr(schema, "RULES", {}))


def field_errors(cfg: Any, schema: type, prefix: str) -> list[str]:
    """Every `schema.RULES` broken by `cfg` (a `schema` instance), keys named `prefix.field`."""
    errors = [rule.error(f"{prefix}.{name}", getattr(cfg, name)) for name, rule in rules_of(schema).items()]
    return [e for e in errors if e]
