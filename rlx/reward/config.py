"""The `reward` section's schema: how rewards are computed, bounded in time, and what a failure does.

Which function scores is `rollout.reward_fn`; this section says how it is called
(`rlx.reward.load_scorer`) and, with `url`, replaces it by a remote reward model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from rlx.config.rules import AT_LEAST_1, NON_NEGATIVE, POSITIVE, Rule, one_of

ON_FAILURE = ("exclude", "zero")  # reward.on_failure
SCOPES = ("sample", "group")  # reward.scope
URL_RULE = Rule("http://... or https://...", lambda v: v.startswith(("http://", "https://")))


@dataclass
class RewardConfig:
    """How rewards are computed: time limits, concurrency, failures, an optional remote reward model."""

    # sample: rollout.reward_fn scores one sample per call; group: one call scores a whole group and
    # returns one reward per sample (functions decorated with @rlx.reward.group_reward need no setting)
    scope: str = "sample"
    timeout_s: float = 60.0  # time limit of one reward call (one HTTP attempt for reward.url)
    num_workers: int = 8  # reward calls running at once (threads for sync functions; requests to url)
    # a failed reward (raised, NaN/inf, not a number, over time, server down): the sample is marked
    # failed and gets reward 0; exclude: it is not trained on (loss mask zeroed); zero: it is trained
    on_failure: str = "exclude"
    reward_key: str | None = None  # a function (or server) returning a dict: the key holding the reward
    # a remote reward model: POST url scores the samples (rollout.reward_fn must then be left at its default)
    url: str | None = None
    batch_size: int = 32  # url: samples per request (from one or several groups)
    batch_wait_s: float = 0.05  # url: how long a partial batch waits for more finished groups
    max_retries: int = 3  # url: retries of a failed request (connection error, timeout, 429, 5xx)
    retry_backoff_s: float = 0.5  # url: the first retry waits this, each next one twice as long

    RULES: ClassVar[dict[str, Rule]] = {
        "scope": one_of(SCOPES),
        "timeout_s": POSITIVE,
        "num_workers": AT_LEAST_1,
        "on_failure": one_of(ON_FAILURE),
        "url": URL_RULE,
        "batch_size": AT_LEAST_1,
        "batch_wait_s": NON_NEGATIVE,
        "max_retries": NON_NEGATIVE,
        "retry_backoff_s": NON_NEGATIVE,
    }
