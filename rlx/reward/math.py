"""Rule-based rewards for math and short answers: `math_answer` and `exact_match`.

`math_answer` takes the response's answer (the last `\\boxed{...}`, else the last number),
normalises it and the label the same way, and compares them exactly: numbers as
`fractions.Fraction` (so 0.75 = 3/4 = \\frac{3}{4} = \\dfrac34, 5 = 5.0, 1,000 = 1\\,000 = 1000),
tuples and intervals element by element, anything else as the normalised string. What
normalising removes: `$`, `\\left`/`\\right`, LaTeX spacing (`\\,` `\\!` `\\;` `~`), `\\text{...}` /
`\\mbox{...}` / `\\mathrm{...}` units (when something else remains), degrees, `%` and `\\%`
(50\\% matches 50, not 0.5), thousands separators, a trailing period, all whitespace.
Symbolic equivalence (x^2+2x+1 against (x+1)^2) is `rlx.reward.symbolic.math_verify`'s job.
docs/tasks.md says why the default is this and not a library.
"""

from __future__ import annotations

import re
import string
from fractions import Fraction
from typing import Any

from rlx.sample import Sample

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC_OR_NUMBER = re.compile(
    r"-?\\[dt]?frac\{[^{}]*\}\{[^{}]*\}"  # \frac{3}{4} as a whole, before its digits match alone
    r"|-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+(?:\.\d+)?)?"  # 1,000.5  42  -7  3/4
    r"|-?\.\d+"  # .5
)
_NUMBER = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?"
_FRACTION = re.compile(rf"([+-]?)\(?({_NUMBER})\)?/\(?({_NUMBER})\)?")
_UNIT = re.compile(r"\\(?:text|mbox|mathrm|textbf)\s*\{[^{}]*\}(?:\^\{?\d\}?)?")
_WRAPPER = re.compile(r"^\\(?:text|mbox|mathrm|textbf)\s*\{([^{}]*)\}$")
_FRAC = re.compile(r"\\frac\s*(\{[^{}]*\}|\d)\s*(\{[^{}]*\}|\d)")
_SPACES = re.compile(r"\\[,!;: ]|\\quad|\\qquad|~|\s")
_THOUSANDS = re.compile(r"(?<=\d)(?:,|\{,\})(?=\d{3}(?!\d))")
_BRACKETS = {"(": ")", "[": "]", "{": "}"}
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def math_answer(sample: Sample) -> float:
    """1.0 when the response's answer equals the label (module docstring: how), else 0.0; no
    answer scores 0. The label may be a number, a string (LaTeX or plain; "#### 42" GSM8K
    solutions give what follows ####), or a list of acceptable answers."""
    answer = extract_answer(sample.response_text)
    if answer is None:
        return 0.0
    return float(any(answers_equal(answer, label) for label in _labels(sample)))


def exact_match(sample: Sample) -> float:
    """1.0 when the answer (the last `\\boxed{...}`, else the whole response) equals the label (or one
    of a list of labels) after SQuAD's normalisation: lower case, no punctuation, no articles
    (a, an, the), whitespace collapsed."""
    response = sample.response_text
    answer = extract_boxed(response)
    answer = response if answer is None else answer
    return float(any(_squad(answer) == _squad(label) for label in _labels(sample)))


def extract_boxed(text: str) -> str | None:
    """The content of the last complete outermost `\\boxed{...}` (or `\\fbox{...}`), nested braces
    included; None when there is none."""
    found, scanned_to = None, 0
    for match in _BOXED.finditer(text):
        if match.start() < scanned_to:  # inside the previous box
            continue
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            if depth == 0:
                found, scanned_to = text[start:i], i
                break
        else:
            return found  # unclosed (a truncated response): the boxes before it stand
    return found


def extract_answer(text: str) -> str | None:
    """The last `\\boxed{...}`'s content, else the last number (or `\\frac{a}{b}`), else None."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    text = re.sub(r"(?<=\d)(?:\\,|\{,\})(?=\d{3})", "", text)  # 1\,000 is one number
    matches = list(_FRAC_OR_NUMBER.finditer(text))
    return matches[-1].group() if matches else None


def normalize(answer: str) -> str:
    """`answer` without the formatting that does not change its value (module docstring)."""
    s = answer.strip()
    wrapped = _WRAPPER.match(s)
    s = wrapped.group(1) if wrapped else s
    s = s.replace("\\$", "").replace("$", "").replace("\\left", "").replace("\\right", "")
    s = s.replace("\\displaystyle", "")
    if _UNIT.sub("", s).strip():  # units go, unless they are all there is
        s = _UNIT.sub("", s)
    s = re.sub(r"\^\s*\{?\\circ\}?|°", "", s)
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _SPACES.sub("", s)
    while (match := _FRAC.search(s)) is not None:
        num, den = (part.strip("{}") for part in match.groups())
        s = f"{s[: match.start()]}({num})/({den}){s[match.end() :]}"
    s = _THOUSANDS.sub("", s)
    return s.rstrip(".")


def to_number(s: str) -> Fraction | None:
    """A normalised answer's exact value when it is a number or a fraction of two, else None."""
    while s.startswith("(") and s.endswith(")") and _matching(s, 0) == len(s) - 1:
        s = s[1:-1]
    if re.fullmatch(_NUMBER, s):
        return Fraction(s)
    match = _FRACTION.fullmatch(s)
    if match is None or Fraction(match.group(3)) == 0:
        return None
    value = Fraction(match.group(2)) / Fraction(match.group(3))
    return -value if match.group(1) == "-" else value


def answers_equal(answer: str, label: Any) -> bool:
    """Whether two answers mean the same (module docstring: what counts as the same)."""
    a, b = normalize(str(answer)), normalize(str(label))
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    if x is not None and y is not None:
        return x == y
    a_items, b_items = _items(a), _items(b)
    if a_items is None or b_items is None or len(a_items) != len(b_items) or len(a_items) < 2:
        return False
    return all(answers_equal(p, q) for p, q in zip(a_items, b_items, strict=True))


def _items(s: str) -> list[str] | None:
    """A tuple, interval or list split at its top-level commas, the brackets kept as the first
    and last item (so (1,2) and [1,2] differ); None when `s` has no top-level comma."""
    opening, closing = "", ""
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _matching(s, 0) in (len(s) - 1, None):
        opening, closing, s = s[0], s[-1], s[1:-1]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    if not parts:
        return None
    return [opening, *parts, s[start:], closing]


def _matching(s: str, i: int) -> int | None:
    """Index of the bracket closing the one at `i` (any kind, so "(1,2]" closes), or None."""
    depth = 0
    for j in range(i, len(s)):
        depth += (s[j] in "([{") - (s[j] in ")]}")
        if depth == 0:
            return j
    return None


def _labels(sample: Sample) -> list[str]:
    if sample.label is None:
        raise ValueError("this reward needs a label; set data.label_key to the key that holds it")
    labels = sample.label if isinstance(sample.label, list | tuple) else [sample.label]
    answers = [_gsm8k_answer(str(label)) for label in labels]
    if not any(normalize(answer) for answer in answers):  # a sample that fails, counted, not a 0 silently
        raise ValueError(
            f"the label {sample.label!r} holds no answer to compare with; fix the row's data.label_key value"
        )
    return answers


def _gsm8k_answer(label: str) -> str:
    return label.rsplit("####", 1)[1].strip() if "####" in label else label


def _squad(text: str) -> str:
    text = "".join(ch for ch in str(text).lower() if ch not in string.punctuation)
    return " ".join(_ARTICLES.sub(" ", text).split())
