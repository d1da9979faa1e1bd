"""The `add` toy task: two numbers and their sum, least significant digit first, scored per digit."""

from __future__ import annotations

import random

from rlx.data.toy import ToyTask
from rlx.reward.toy import position_match
from rlx.sample import Sample


def test_add_rows_by_hand():
    class Fixed(random.Random):  # draws 4, 2 then 9, 3: the numbers 24 and 39
        digits = iter("4293")

        def choice(self, seq):
            return next(self.digits)

    prompt, label = ToyTask("add", 2).make(Fixed())
    assert prompt == "4 2 + 9 3 ="
    assert label == "3 6 0"  # 24 + 39 = 63, three digits, least significant first


def test_add_labels_are_the_sums():
    for row in ToyTask("add", 4).rows(50, seed=7):
        words = row["prompt"].split()
        assert words[4] == "+" and words[-1] == "=" and len(words) == 10
        a, b = int("".join(words[3::-1])), int("".join(words[8:4:-1]))
        assert len(row["label"].split()) == 5
        assert int("".join(row["label"].split()[::-1])) == a + b


def test_add_scored_per_digit():
    # first digit right, second wrong, third missing
    sample = Sample(prompt="4 2 + 9 3 =", prompt_ids=[], label="3 6 0", response_text="3 5")
    assert position_match(sample) == 1 / 3
