"""docs/errors.md, the bad-input catalogue, names only tests that exist, and has at least 40 entries."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "errors.md"
SHORT = {  # the doc's abbreviations (explained at its top)
    "compose": "tests/config/test_compose.py",
    "cluster": "tests/config/test_cluster.py",
    "bad_input": "tests/config/test_bad_input.py",
    "cmd": "tests/config/test_command_line.py",
    "lora": "tests/unit/test_lora.py",
}


def _rows() -> list[list[str]]:
    rows = [
        line.split(" | ") for line in DOC.read_text().splitlines() if line.startswith("| ") and " | " in line
    ]
    return [row for row in rows if row[0] not in ("| input",) and not row[0].startswith("|---")]


def _exists(ref: str) -> bool:
    """`FILE::test_fn`, `FILE::TABLE[id]`, `SHORT::id` (a table entry) or a bare test of test_bad_input.py."""
    where, _, name = ref.rpartition("::")
    path = ROOT / SHORT.get(where, where or SHORT["bad_input"])
    if not path.is_file():
        return False
    text = path.read_text()
    if where in SHORT and where != "":
        return f'"{name}"' in text
    if match := re.fullmatch(r"(\w+)\[(.+)\]", name):
        return f"{match.group(1)} = " in text and f'"{match.group(2)}"' in text
    return f"def {name}(" in text


def test_every_test_the_catalogue_names_exists():
    refs = [ref for row in _rows() for ref in re.findall(r"`([^`]*(?:::|test_)[^`]*)`", row[-1])]
    assert len(refs) >= len(_rows())
    missing = [ref for ref in refs if not _exists(ref)]
    assert not missing, f"docs/errors.md names tests that do not exist: {missing}"


def test_the_catalogue_has_at_least_40_entries():
    assert len(_rows()) >= 40
