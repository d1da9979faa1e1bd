"""Math and short-answer rewards against hand-written verdicts; the majority-vote group reward. CPU."""

from __future__ import annotations

from fractions import Fraction

import pytest

from rlx.reward.group import majority_vote
from rlx.reward.math import exact_match, extract_answer, extract_boxed, math_answer, normalize, to_number
from rlx.sample import Sample


def sample(response: str, label=None) -> Sample:
    return Sample(prompt="q", prompt_ids=[], label=label, response_text=response)


EQUIVALENT = [  # (response, label): the same answer written differently
    (r"so \boxed{\frac{3}{4}}", "3/4"),
    (r"The answer is $\boxed{0.75}$.", r"\frac{3}{4}"),
    (r"\boxed{\dfrac{1}{2}}", "0.5"),
    (r"\boxed{\tfrac34}", "0.75"),  # \tfrac with single-digit arguments
    (r"\boxed{\frac{-3}{4}}", "-3/4"),
    (r"$-\frac{3}{4}$", "-0.75"),  # no box: the last number, a negative \frac
    (r"\boxed{-5}", "-5"),
    (r"\boxed{5.0}", "5"),  # trailing .0
    (r"\boxed{.5}", "1/2"),
    (r"\boxed{1,000}", "1000"),  # thousands separators
    (r"\boxed{1\,000}", "1,000"),  # LaTeX thin space
    (r"\boxed{1{,}000{,}000}", "1000000"),
    (r"so she has 1\,000 apples", "1000"),  # unboxed thin-space thousands: one number
    (r"\boxed{50\%}", "50"),  # percent sign ignored on either side
    (r"\boxed{50}", r"50\%"),
    (r"\boxed{10 \text{ cm}}", "10"),  # \text units stripped
    (r"\boxed{12\mbox{ cm}^2}", "12"),
    (r"\boxed{90^\circ}", "90"),
    (r"\boxed{\left( 1, \frac{1}{2} \right)}", "(1,0.5)"),  # \left( \right), tuple element by element
    (r"\boxed{\text{(B)}}", "(B)"),  # a \text that is all there is stays
    (r"\boxed{ x + 1 }", "x+1"),  # not a number: the normalised strings
    ("Adding up, 7 + 5 = 12.", "12"),  # last number, sentence period
    ("he pays $3/4 of it: 3/4", "0.75"),
    (r"\boxed{2^{10}} and \boxed{\sqrt{x}}", r"\sqrt{x}"),  # the last box, nested braces kept
    ("It is 42", 42),  # a numeric label
    ("It is 42", "Natalia sold 48/2 = 24 clips... #### 42"),  # a GSM8K solution: what follows ####
    ("It is 7", ["6", "7"]),  # any of several labels
]

DIFFERENT = [  # (response, label): a wrong answer or none
    (r"\boxed{7}", "8"),
    (r"\boxed{0.7}", "3/4"),
    (r"\boxed{-5}", "5"),
    (r"\boxed{(1,2]}", "(1,2)"),  # a half-open interval is not the open one
    (r"\boxed{(1,2)}", "(2,1)"),  # tuples are ordered
    (r"\boxed{1\,000}", "0"),  # math-verify reads 1\,000 as 1*0 and would say 1.0 here
    (r"\boxed{3/0}", "0"),
    (r"\boxed{x+2}", "x+1"),
    ("no answer here", "3"),  # no box, no number
    (r"truncated \boxed{4", "5"),  # unclosed box: falls back to the last number, 4
    ("", "0"),
]


@pytest.mark.parametrize("response, label", EQUIVALENT)
def test_equivalent_answers_score_1(response, label):
    assert math_answer(sample(response, label)) == 1.0


@pytest.mark.parametrize("response, label", DIFFERENT)
def test_different_or_missing_answers_score_0(response, label):
    assert math_answer(sample(response, label)) == 0.0


@pytest.mark.parametrize(
    "text, answer",
    [
        (r"a \boxed{1} b \boxed{2}", "2"),  # the last box
        (r"\boxed{\frac{1}{\sqrt{2}}}", r"\frac{1}{\sqrt{2}}"),  # nested braces
        (r"a \boxed{1} b \boxed{2", "1"),  # the last complete box
        ("x = 3, y = -4.5 and z", "-4.5"),
        (r"total 1,234,567.5", "1,234,567.5"),
        (r"x = \frac{1}{3} so", r"\frac{1}{3}"),
        ("nothing", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


def test_normalize_and_value():
    assert normalize(r" \$\left( \dfrac{3}{4} \right)\,\text{ m}. ") == "((3)/(4))"
    assert to_number("((3)/(4))") == Fraction(3, 4)
    assert to_number("-(3)/(4)") == Fraction(-3, 4)
    assert to_number("1.5e3") == 1500
    assert to_number("x") is None and to_number("3/0") is None
    assert extract_boxed("none") is None


def test_a_missing_label_is_an_error():
    with pytest.raises(ValueError, match="data.label_key"):
        math_answer(sample(r"\boxed{1}", None))


@pytest.mark.parametrize("label", ["", "  ", "#### ", "$$", []])
def test_a_label_with_no_answer_in_it_is_an_error(label):
    with pytest.raises(ValueError, match=r"holds no answer to compare with; fix the row's data.label_key"):
        math_answer(sample(r"\boxed{1}", label))


@pytest.mark.parametrize(
    "response, label, expected",
    [
        ("Paris", "paris", 1.0),
        ("The Eiffel Tower!", "eiffel tower", 1.0),  # case, article, punctuation
        (r"I think \boxed{ Blue whale }", "blue whale", 1.0),  # a box is the answer
        ("Paris, France", "Paris", 0.0),
        ("Lyon", ["Paris", "Lyon"], 1.0),
        ("", "Paris", 0.0),
    ],
)
def test_exact_match(response, label, expected):
    assert exact_match(sample(response, label)) == expected


def test_majority_vote():
    group = [
        sample(r"\boxed{0.5}"),
        sample(r"\boxed{\frac{1}{2}}"),  # votes with 0.5
        sample(r"\boxed{3}"),
        sample("no idea"),  # no answer: 0, no vote
        sample(r"\boxed{3}"),
        sample("it is 1/2"),  # the third vote for 1/2: 1/2 has 3 votes, 3 has 2
    ]
    assert majority_vote(group) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    # a tie goes to the answer seen first; nobody answering scores all 0
    assert majority_vote([sample(r"\boxed{2}"), sample(r"\boxed{1}")]) == [1.0, 0.0]
    assert majority_vote([sample("?"), sample("")]) == [0.0, 0.0]
