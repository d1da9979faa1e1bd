"""A generated arithmetic task with a held-out test split, for pretrained chat models.

    python -m rlx.data.arithmetic                  # <rlx cache>/arithmetic/{train,test}.jsonl
    python -m rlx.data.arithmetic --out DIR --num-test 256 --seed 0

Every problem is one operation on small whole numbers, asked in words as a chat message:
`a + b` and `a - b` (b <= a, so the answer is never negative) with a, b in 0..MAX_ADD, `a * b` with
a, b in 1..MAX_MUL; the label is the answer as a string. Each distinct problem appears once (816 in
all), asked with one of a few phrasings, and a seeded `num_test` of them form the test split; the
rest are the training split, so no test question is ever trained on. Rows are what `data=math`
reads: `{"prompt": [{"role": "user", "content": ...}], "label": "56"}`, scored by
`rlx.reward.math.math_answer` (the response's last number or `\\boxed{}` against the label).

Why this task: SmolLM2-135M-Instruct (`python -m rlx.tools.example_model`) can do most of these
sums when asked to complete "7 * 8 = ", but answered freely it rambles, reasons wrongly or runs out
of tokens, so its greedy accuracy starts far below that (docs/benchmarks.md has the figures).
GRPO closes much of that gap within minutes on one GPU: `+experiment=smollm2_arithmetic`.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from rlx.cache import cache_dir

MAX_ADD = 20  # operands of + and -
MAX_MUL = 12  # operands of *
PHRASINGS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "Calculate {a} {op} {b}.")
NUM_TEST = 128
DEFAULT_DIR = "arithmetic"  # under rlx's cache


def problems() -> list[tuple[int, str, int, int]]:
    """Every (a, op, b, answer) of the task, in a fixed order."""
    adds = [(a, "+", b, a + b) for a in range(MAX_ADD + 1) for b in range(MAX_ADD + 1)]
    subs = [(a, "-", b, a - b) for a in range(MAX_ADD + 1) for b in range(a + 1)]
    muls = [(a, "*", b, a * b) for a in range(1, MAX_MUL + 1) for b in range(1, MAX_MUL + 1)]
    return adds + subs + muls


def rows(seed: int = 0, num_test: int = NUM_TEST) -> dict[str, list[dict]]:
    """{"train": [...], "test": [...]}: every problem once, phrased and split by `seed`."""
    rng = random.Random(seed)
    all_rows = [
        {
            "prompt": [{"role": "user", "content": rng.choice(PHRASINGS).format(a=a, op=op, b=b)}],
            "label": str(answer),
        }
        for a, op, b, answer in problems()
    ]
    rng.shuffle(all_rows)
    if not 0 < num_test < len(all_rows):
        raise ValueError(f"num_test={num_test} must be between 1 and {len(all_rows) - 1}")
    return {"test": all_rows[:num_test], "train": all_rows[num_test:]}


def write(out: Path, seed: int = 0, num_test: int = NUM_TEST) -> Path:
    """Write `out/train.jsonl` and `out/test.jsonl` (each file replaced whole); return `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for split, split_rows in rows(seed, num_test).items():
        staging = out / f".{split}.jsonl.tmp"
        staging.write_text("".join(json.dumps(row) + "\n" for row in split_rows))
        staging.replace(out / f"{split}.jsonl")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="directory (default: <rlx cache>/arithmetic)")
    parser.add_argument("--seed", type=int, default=0, help="phrasings and the test split")
    parser.add_argument("--num-test", type=int, default=NUM_TEST, help="problems held out for the test split")
    args = parser.parse_args(argv)
    out = write(args.out or cache_dir() / DEFAULT_DIR, seed=args.seed, num_test=args.num_test)
    counts = {split: (out / f"{split}.jsonl").read_text().count("\n") for split in ("train", "test")}
    print(f"{counts['train']} training and {counts['test']} test problems in")
    print(out)


if __name__ == "__main__":
    main()
