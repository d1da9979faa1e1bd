"""Group rewards: one call scores a whole group (`@group_reward`), so a sample's reward can
depend on its siblings. `majority_vote` is the example that needs no label."""

from __future__ import annotations

from collections import Counter

from rlx.reward.math import extract_answer, normalize, to_number
from rlx.reward.scorer import group_reward
from rlx.sample import Sample


@group_reward
def majority_vote(samples: list[Sample]) -> list[float]:
    """1.0 for each sample whose answer (as `math_answer` extracts it) is the group's most common
    answer, else 0.0; labels are not read (test-time RL, TTRL: arXiv:2504.16084). Equal values count
    as one answer (0.5 and \\frac{1}{2} vote together); samples without an answer get 0 and do not
    vote; a tie goes to the answer that appeared first."""
    keys = [_vote_key(s.response_text) for s in samples]
    votes = Counter(k for k in keys if k is not None)
    if not votes:
        return [0.0] * len(samples)
    winner = votes.most_common(1)[0][0]  # Counter keeps first-seen order among equal counts
    return [float(k == winner) for k in keys]


def _vote_key(response: str) -> str | None:
    answer = extract_answer(response)
    if answer is None:
        return None
    text = normalize(answer)
    value = to_number(text)
    return text if value is None else str(value)
