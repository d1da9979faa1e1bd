"""Rewards for the built-in toy tasks (and any task whose answer is a sequence of words).

Labels and responses are compared as whitespace-split words, so "1 7 3" matches " 1  7 3".
The rollout engine must decode responses without special tokens (no "<eos>" in the text).
"""

from __future__ import annotations

from rlx.sample import Sample


def _words(sample: Sample) -> tuple[list[str], list[str]]:
    if sample.label is None:
        raise ValueError("this reward needs a label; set data.label_key to the key that holds it")
    return str(sample.label).split(), sample.response_text.split()


def position_match(sample: Sample) -> float:
    """Fraction of label words matched position by position by the response.

    Missing positions score 0 and words beyond the label's length are ignored, so the reward
    is dense (partial answers get partial credit). An empty label scores 1 for an empty response.
    """
    label, response = _words(sample)
    if not label:
        return float(not response)
    # zip stops at the shorter: missing positions add nothing, extra words are ignored.
    return sum(want == got for want, got in zip(label, response, strict=False)) / len(label)


def exact_match(sample: Sample) -> float:
    """1.0 when the response's words are exactly the label's words, else 0.0."""
    label, response = _words(sample)
    return float(label == response)
