"""The reward (`reward.fn=examples.tool_calc.reward.answer_reward`)."""

from __future__ import annotations

from rlx.sample import Sample, Status


def answer_reward(sample: Sample) -> float:
    """0 unless the calculator was called and answered; then the share of the label's digits the
    final answer has in place, plus one share for ending right after them:
    (matching digits + [answer has exactly the label's length and ended on EOS]) / (digits + 1).

    The answer is the model's last turn (`sample.metadata["answer"]`, set by the generate_fn)."""
    calls = sample.metadata.get("tool_calls", [])
    if not any(call["ok"] for call in calls):
        return 0.0
    label, answer = str(sample.label).split(), str(sample.metadata.get("answer", "")).split()
    digits = sum(want == got for want, got in zip(label, answer, strict=False))
    ended = len(answer) == len(label) and sample.status is Status.COMPLETED
    return (digits + ended) / (len(label) + 1)
