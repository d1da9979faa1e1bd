"""Rows of a prompt file, by extension: `.jsonl` (one JSON object per line), `.json` (a JSON array
of objects, or JSON lines), `.parquet` (one row per record, via pyarrow).

A reader yields `(where, row)` for every row, `where` naming the file and the line (JSON lines)
or the 0-based row index (arrays, Parquet), and `row` either the row's dict or a `BadRow` saying
why it could not be read. A file that cannot be read at all raises DataError.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.utils import to_absolute_path

from rlx.cache import writer_hint
from rlx.errors import DataError

_PARQUET_BATCH_ROWS = 4096  # rows decoded at a time: bounded memory for large files


@dataclass(frozen=True, slots=True)
class BadRow:
    """A row that could not be parsed: `reason` (a short kind, counted in skip mode) and `detail`."""

    reason: str
    detail: str


Rows = Iterator[tuple[str, dict[str, Any] | BadRow]]


def resolve(path: str) -> Path:
    """`path` as the run sees it: `~` expanded, relative to the launch directory under Hydra."""
    return Path(to_absolute_path(str(Path(path).expanduser())))


def path_errors(key: str, path: str | None) -> list[str]:
    """Why `key=path` cannot be read as a prompt file ([] when it can)."""
    if not path:
        return [f"{key} is not set; set {key}=/path/to/prompts.jsonl (or .json, .parquet)"]
    where = resolve(path)
    if where.suffix not in READERS:
        return [
            f"{key}={path!r}: unknown file type {where.suffix!r}; use a file ending in one of "
            f"{sorted(READERS)} (JSON lines, a JSON array, Parquet)"
        ]
    if not where.is_file():
        return [f"{key}={path!r}: no such file ({where}); point {key} at a prompt file{writer_hint(where)}"]
    return []


def read_rows(path: str) -> Rows:
    """Every row of `path` (checked by `path_errors` first), read by the reader for its extension."""
    return READERS[resolve(path).suffix](path)


def read_json_lines(path: str) -> Rows:
    """One JSON object per line; blank lines are ignored."""
    with open(resolve(path), "rb") as f:  # decoded per line, so a bad byte is reported with its line
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                yield f"{path}:{lineno}", _parse_line(raw)


def _parse_line(raw: bytes) -> dict[str, Any] | BadRow:
    try:
        row = json.loads(raw.decode("utf-8").rstrip("\r\n"))
    except UnicodeDecodeError as e:
        return BadRow("not UTF-8", f"not UTF-8 text: {e}")
    except json.JSONDecodeError as e:  # the row's own column: json's "line 2" would be the newline
        return BadRow("malformed JSON", f"malformed JSON: {e.msg} at column {e.pos + 1} of the line")
    return _object(row, "JSON object")


def read_json(path: str) -> Rows:
    """A JSON array of objects; a file that does not start with `[` is read as JSON lines."""
    with open(resolve(path), "rb") as f:
        head = f.read(4096).lstrip()
    if not head.startswith(b"["):
        yield from read_json_lines(path)
        return
    try:
        rows = json.loads(resolve(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text: {e}\nfix: save the file as UTF-8") from e
    except json.JSONDecodeError as e:  # one document: nothing after the error can be read
        raise DataError(
            f"{path}:{e.lineno}: malformed JSON: {e.msg} (column {e.colno})\n"
            "fix: repair the file, or write it as JSON lines (.jsonl) so that bad rows can be skipped"
        ) from e
    for index, row in enumerate(rows):
        yield f"{path}: row index {index}", _object(row, "JSON object")


def read_parquet(path: str) -> Rows:
    """Each record of a Parquet file as a dict of its columns (lists and structs as Python values)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(resolve(path))
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file: {e}\nfix: point at a Parquet file") from e
    index = 0
    for batch in file.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
        for row in batch.to_pylist():
            yield f"{path}: row index {index}", row
            index += 1


def _object(row: Any, what: str) -> dict[str, Any] | BadRow:
    if isinstance(row, dict):
        return row
    return BadRow("not an object", f"expected a {what}, got {type(row).__name__}")


def columns(path: str) -> list[str] | None:
    """The column names of a file whose rows share one schema (Parquet), else None."""
    if resolve(path).suffix != ".parquet":
        return None
    import pyarrow.parquet as pq

    try:
        return list(pq.read_schema(resolve(path)).names)
    except Exception:  # unreadable: read_parquet reports it with the file's name
        return None


READERS: dict[str, Callable[[str], Rows]] = {
    ".jsonl": read_json_lines,
    ".json": read_json,
    ".parquet": read_parquet,
}
