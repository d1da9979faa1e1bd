"""rlx.reward.symbolic.math_verify (math-verify's symbolic checking) in the scorer's worker threads. CPU."""

from __future__ import annotations

import asyncio
import sys

import pytest

import rlx.reward
from rlx.errors import ConfigError
from rlx.reward import load_reward_fn, load_scorer
from rlx.reward.config import RewardConfig
from rlx.sample import Sample, Status


def test_missing_package_is_a_config_error_naming_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "rlx.reward.symbolic", raising=False)  # not imported yet, either
    monkeypatch.delattr(rlx.reward, "symbolic", raising=False)
    with pytest.raises(
        ConfigError,
        match=r"(?s)reward.fn='rlx.reward.symbolic.math_verify' cannot be imported.*pip install math-verify",
    ):
        load_reward_fn("rlx.reward.symbolic.math_verify")


def test_symbolic_answers_in_worker_threads():
    pytest.importorskip("math_verify")
    cases = [  # (response, label, reward)
        (r"\boxed{x^2+2x+1}", "(x+1)^2", 1.0),  # beyond math_answer: expanded against factored
        (r"\boxed{\frac{\sqrt{2}}{2}}", r"\frac{1}{\sqrt{2}}", 1.0),
        (r"so \boxed{3/4}", "0.75", 1.0),
        (r"\boxed{x^2+1}", "(x+1)^2", 0.0),
        ("no answer", "3", 0.0),
    ]
    samples = [
        Sample(
            prompt="q",
            prompt_ids=[],
            label=label,
            index=i,
            response_ids=[1],
            response_text=r,
            status=Status.COMPLETED,
        )
        for i, (r, label, _) in enumerate(cases)
    ]
    # math-verify's own timeouts use signal.alarm, which raises outside the main thread: they are off
    scorer = load_scorer(RewardConfig(fn="rlx.reward.symbolic.math_verify", timeout_s=30.0, num_workers=2))
    asyncio.run(scorer.score_group(samples))
    assert [s.status_reason for s in samples] == [""] * len(cases)
    assert [s.reward for s in samples] == [expected for *_, expected in cases]
