"""Toy rewards against hand-written values, and loading a reward fn by path. CPU."""

from __future__ import annotations

import pytest

from rlx.errors import ConfigError
from rlx.reward import load_reward_fn
from rlx.reward.toy import exact_match, position_match
from rlx.sample import Sample


def sample(response: str, label: str | None = "1 7 3") -> Sample:
    return Sample(prompt="3 7 1 =", prompt_ids=[], label=label, response_text=response)


@pytest.mark.parametrize(
    "response, position, exact",
    [
        ("1 7 3", 1.0, 1.0),
        (" 1  7\n3 ", 1.0, 1.0),  # words, not characters
        ("1 7", 2 / 3, 0.0),  # the missing third position scores 0
        ("3 7 1", 1 / 3, 0.0),  # only the middle digit is in place
        ("7 3", 0.0, 0.0),  # right digits, wrong positions
        ("1 7 3 5 5", 1.0, 0.0),  # words beyond the label are ignored
        ("1 9 3", 2 / 3, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_toy_rewards(response, position, exact):
    assert position_match(sample(response)) == pytest.approx(position)
    assert exact_match(sample(response)) == exact


def test_empty_label_matches_only_an_empty_response():
    assert position_match(sample("", label="")) == 1.0
    assert position_match(sample("1", label="")) == 0.0
    assert exact_match(sample("", label="")) == 1.0


def test_a_missing_label_is_an_error():
    with pytest.raises(ValueError, match="data.label_key"):
        position_match(sample("1 7 3", label=None))


def test_load_reward_fn():
    assert load_reward_fn("rlx.reward.toy.exact_match") is exact_match
    with pytest.raises(ConfigError, match=r"reward\.fn='rlx\.reward\.toy\.nope' cannot be imported"):
        load_reward_fn("rlx.reward.toy.nope")
    with pytest.raises(ConfigError, match=r"reward\.fn='rlx\.reward\.toy' is a module, not a function"):
        load_reward_fn("rlx.reward.toy")
