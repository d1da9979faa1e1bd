"""Built-in verifiable toy tasks whose answer depends on the prompt.

Prompts and answers are space-separated digits and "=", e.g. reverse: "3 7 1 =" -> "1 7 3",
tokenised by the model's own tokenizer (the tiny models' word-level vocabulary has each of
these words as one token, so a random tiny model learns a task on CPU in minutes).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from rlx.data.config import DataConfig
from rlx.data.source import PromptSource
from rlx.errors import ConfigError

DIGITS = [str(d) for d in range(10)]
TASKS = ("reverse", "copy", "add")  # the kinds ToyTask knows


@dataclass
class ToyTask:
    """A family of prompts `d1 .. dn =` whose label is a function of the digits.

    `kind` is one of `reverse` (label: the digits reversed), `copy` (label: the digits), or
    `add`: two n-digit numbers and their n+1-digit sum, every number written least significant
    digit first ("4 2 + 9 3 =" is 24 + 39 -> "3 6 0", i.e. 63), the order in which the carries
    run, so each answer digit sits at a fixed distance from its two operand digits.
    """

    kind: str = "reverse"
    num_digits: int = 3

    def make(self, rng: random.Random) -> tuple[str, str]:
        digits = [rng.choice(DIGITS) for _ in range(self.num_digits)]
        if self.kind == "add":
            other = [rng.choice(DIGITS) for _ in range(self.num_digits)]
            total = int("".join(digits[::-1])) + int("".join(other[::-1]))
            answer = list(str(total).zfill(self.num_digits + 1)[::-1])
            return " ".join([*digits, "+", *other, "="]), " ".join(answer)
        answer = digits[::-1] if self.kind == "reverse" else digits
        return " ".join([*digits, "="]), " ".join(answer)

    def rows(self, num_rows: int, seed: int) -> list[dict[str, str]]:
        """`num_rows` prompt/label rows, deterministic in `seed`."""
        rng = random.Random(seed)
        return [dict(zip(("prompt", "label"), self.make(rng), strict=True)) for _ in range(num_rows)]


class ToySource(PromptSource):
    """The DataSource contract (see `rlx.data.source.DataSource`) over generated `ToyTask` rows.

    `data.toy_num_rows` rows of `data.toy_task` with `data.toy_num_digits` digits, generated
    from the run's seed; epochs, shuffling and resume behave exactly as for JSONL files.
    """

    def __init__(self, cfg: DataConfig, tokenizer: Any, *, seed: int, max_prompt_len: int):
        super().__init__(cfg, tokenizer, seed=seed, max_prompt_len=max_prompt_len)
        errors = self.config_errors(cfg)
        if errors:
            raise ConfigError("\n".join(errors))
        for i, row in enumerate(ToyTask(cfg.toy_task, cfg.toy_num_digits).rows(cfg.toy_num_rows, seed)):
            self._add(f"toy {cfg.toy_task} row {i}", row["prompt"], row["label"])
        self._finish(f"toy {cfg.toy_task}")

    @classmethod
    def config_errors(cls, cfg: DataConfig) -> list[str]:
        errors = super().config_errors(cfg) + _unread_keys(cfg)
        if cfg.toy_task not in TASKS:
            errors.append(f"data.toy_task={cfg.toy_task!r} is not one of {list(TASKS)}")
        if cfg.toy_num_digits < 1:
            errors.append(f"data.toy_num_digits={cfg.toy_num_digits} must be >= 1")
        if cfg.toy_num_rows < 1:
            errors.append(f"data.toy_num_rows={cfg.toy_num_rows} must be >= 1")
        return errors


def _unread_keys(cfg: DataConfig) -> list[str]:
    """Keys of a file source that the toy source would silently ignore (it generates its rows)."""
    toy = f"data._target_={cfg._target_} generates its prompts (the default toy task)"
    errors = []
    if cfg.prompt_path:
        errors.append(
            f"data.prompt_path={cfg.prompt_path!r} is set, but {toy} and reads no file; to train on the "
            f"file choose a file source and its task's reward: data=math data.prompt_path={cfg.prompt_path}, "
            f"or data=jsonl data.prompt_path={cfg.prompt_path} reward.fn=... (both read .jsonl, .json and "
            ".parquet), or drop data.prompt_path"
        )
    for name, what in (("filter", "row filter"), ("metadata_key", "metadata key")):
        if getattr(cfg, name):
            errors.append(
                f"data.{name}={getattr(cfg, name)!r} is set, but {toy}, to which a {what} does not apply; "
                f"use data=jsonl with a prompt file, or drop data.{name}"
            )
    return errors
