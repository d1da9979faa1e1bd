"""`math_verify`: symbolic answer checking with Hugging Face's math-verify, for answers that are
expressions, sets, intervals or matrices (x^2+2x+1 against (x+1)^2), where `rlx.reward.math`
compares only numbers and strings. Needs `pip install math-verify` (the `math` extra).

math-verify bounds its own parsing and checking with `signal.alarm`, which works only in the
main thread; rlx runs sync rewards in worker threads, so its timeouts are off here and
`reward.timeout_s` bounds the call instead. docs/tasks.md has the comparison with `math_answer`.
"""

from __future__ import annotations

try:
    from math_verify import parse, verify
except ImportError as e:  # load_reward_fn turns this into a ConfigError naming reward.fn
    raise ImportError(
        "rlx.reward.symbolic needs the math-verify package: pip install math-verify (or rlx[math])"
    ) from e

from rlx.reward.math import _labels
from rlx.sample import Sample


def math_verify(sample: Sample) -> float:
    """1.0 when math-verify finds the response's answer (the last \\boxed{...}, else the last
    expression) equivalent to the label (or one of a list of labels), else 0.0."""
    answer = parse(sample.response_text, parsing_timeout=None)
    if not answer:
        return 0.0
    for label in _labels(sample):
        gold = parse(label if "$" in label or "\\boxed" in label else f"${label}$", parsing_timeout=None)
        if gold and verify(gold, answer, timeout_seconds=None):
            return 1.0
    return 0.0
