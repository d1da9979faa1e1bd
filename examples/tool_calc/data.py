"""The task's prompts: `A OP B =` with two n-digit numbers, labelled with the result's digits.

"4 2 7 + 9 3 1 =" -> label "1 3 5 8"; "4 2 7 - 0 3 1 =" -> "0 3 9 6". Results are written with
n + 1 digits (zero-padded), so every answer has the same length; subtraction takes A >= B.
Every word is one token of the tiny models' vocabulary (digits, + - = ?).
"""

from __future__ import annotations

import random
from typing import Any

from rlx.data.config import DataConfig
from rlx.data.source import PromptSource
from rlx.errors import ConfigError

OPERATORS = {"add": "+", "sub": "-", "add_sub": "+-"}  # data.toy_task -> the operators drawn
MAX_DIGITS = 9


def spaced(digits: str) -> str:
    """ "1358" -> "1 3 5 8": one word (one token) per character."""
    return " ".join(digits)


def render_result(value: int, num_digits: int) -> str:
    """The result as the model sees and writes it: n + 1 digits, spaced (a minus sign in front
    of a negative one, which this task's prompts never produce)."""
    sign = "- " if value < 0 else ""
    return sign + spaced(str(abs(value)).zfill(num_digits + 1))


def make_row(rng: random.Random, operators: str, num_digits: int) -> dict[str, str]:
    """One prompt/label row."""
    op = rng.choice(operators)
    a, b = (rng.randrange(10**num_digits) for _ in range(2))
    if op == "-":
        a, b = max(a, b), min(a, b)
    value = a + b if op == "+" else a - b
    prompt = f"{spaced(str(a).zfill(num_digits))} {op} {spaced(str(b).zfill(num_digits))} ="
    return {"prompt": prompt, "label": render_result(value, num_digits)}


def question(prompt: str) -> str:
    """The expression a prompt asks for: the prompt without its final "="."""
    return prompt.rstrip().removesuffix("=").strip()


def operand_digits(expression: str) -> int:
    """n, the operands' (zero-padded) width: the words before the operator ("4 2 7 + 9 3 1": 3)."""
    words = expression.split()
    return next((i for i, w in enumerate(words) if w in "+-*"), len(words))


class CalcSource(PromptSource):
    """The DataSource contract (`rlx.data.source.DataSource`) over generated rows:
    `data.toy_num_rows` rows of `data.toy_num_digits`-digit operands, operators by
    `data.toy_task` (a key of `OPERATORS`), drawn from the run's seed."""

    def __init__(self, cfg: DataConfig, tokenizer: Any, *, seed: int, max_prompt_len: int):
        super().__init__(cfg, tokenizer, seed=seed, max_prompt_len=max_prompt_len)
        errors = self.config_errors(cfg)
        if errors:
            raise ConfigError("\n".join(errors))
        rng = random.Random(seed)
        for i in range(cfg.toy_num_rows):
            row = make_row(rng, OPERATORS[cfg.toy_task], cfg.toy_num_digits)
            self._add(f"tool_calc row {i}", row["prompt"], row["label"])
        self._finish("tool_calc")

    @classmethod
    def config_errors(cls, cfg: DataConfig) -> list[str]:
        errors = super().config_errors(cfg)
        where = f"data._target_={cfg._target_} generates its prompts"
        if cfg.toy_task not in OPERATORS:
            errors.append(
                f"data.toy_task={cfg.toy_task!r} is not one of {list(OPERATORS)} ({where}: "
                "toy_task picks the operators); set data.toy_task=add_sub, say"
            )
        if not 1 <= cfg.toy_num_digits <= MAX_DIGITS:
            errors.append(f"data.toy_num_digits={cfg.toy_num_digits} must be in [1, {MAX_DIGITS}]")
        if cfg.toy_num_rows < 1:
            errors.append(f"data.toy_num_rows={cfg.toy_num_rows} must be >= 1")
        if cfg.prompt_path:
            errors.append(
                f"data.prompt_path={cfg.prompt_path!r} is set, but {where} and reads no file; drop it"
            )
        return errors
