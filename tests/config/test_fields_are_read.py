"""No dead keys: every field of every config schema is read somewhere in rlx/ outside the schema
modules themselves (a key that nothing reads would silently do nothing for the user who sets it)."""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import fields
from pathlib import Path

import pytest

from rlx.config.schema import RlxConfig

RLX = Path(__file__).resolve().parents[2] / "rlx"
SCHEMAS = {f.name: type(getattr(RlxConfig(), f.name)) for f in fields(RlxConfig)}
# where the schemas are declared: a field named there (its definition, its RULES entry) is not a read
SCHEMA_FILES = {
    Path(__import__(cls.__module__, fromlist=["_"]).__file__).resolve() for cls in SCHEMAS.values()
}


def _reads() -> set[str]:
    """Names read in rlx/: attributes (`cfg.name`) and string literals that are exactly a name
    (`getattr(cfg, "name")`, tables of fields). A message that names a dotted key
    ("train.lr_warmup_steps=...") is neither, so it does not count."""
    names: set[str] = set()
    for path in sorted(RLX.rglob("*.py")):
        if path.resolve() in SCHEMA_FILES:
            continue
        tokens = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
        for before, token in zip(tokens, tokens[1:], strict=False):
            if token.type == tokenize.NAME and before.type == tokenize.OP and before.string == ".":
                names.add(token.string)
            elif token.type == tokenize.STRING and not token.string.lstrip("rbRB").startswith(("f", "F")):
                value = ast.literal_eval(token.string)
                if isinstance(value, str) and value.isidentifier():
                    names.add(value)
    return names


READS = _reads()


@pytest.mark.parametrize(
    "key", [f"{section}.{f.name}" for section, cls in SCHEMAS.items() for f in fields(cls)]
)
def test_field_is_read(key):
    assert key.split(".", 1)[1] in READS, f"{key} is declared but nothing in rlx/ reads it"
