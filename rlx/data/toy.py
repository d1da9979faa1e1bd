"""Built-in verifiable toy tasks whose answer depends on the prompt.

Every toy task shares one small word-level vocabulary (`VOCAB`), which is also the
vocabulary of the tiny models' tokenizer, so a random tiny model can learn the task on CPU
in minutes. Prompts and answers are space-separated tokens, e.g. reverse: "3 7 1 =" -> "1 7 3".
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PAD = "<pad>"
EOS = "<eos>"
DIGITS = [str(d) for d in range(10)]
VOCAB: list[str] = [PAD, EOS, *DIGITS, "=", "+", "-", "?"]


@dataclass
class ToyTask:
    """A family of prompts `d1 .. dn =` whose label is a function of the digits.

    `kind` is one of `reverse` (label: the digits reversed) or `copy` (label: the digits).
    """

    kind: str = "reverse"
    num_digits: int = 3

    def make(self, rng: random.Random) -> tuple[str, str]:
        digits = [rng.choice(DIGITS) for _ in range(self.num_digits)]
        answer = digits[::-1] if self.kind == "reverse" else digits
        return " ".join([*digits, "="]), " ".join(answer)

    def rows(self, num_rows: int, seed: int) -> list[dict[str, str]]:
        """`num_rows` prompt/label rows, deterministic in `seed`."""
        rng = random.Random(seed)
        return [dict(zip(("prompt", "label"), self.make(rng))) for _ in range(num_rows)]
