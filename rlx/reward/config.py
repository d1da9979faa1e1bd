"""The `reward` section's schema: which function (or server) scores, how it is called, bounded in
time, and what a failure does (`rlx.reward.load_scorer`).

The task names its reward: a data preset sets `reward.fn` (and `rollout.max_response_len`) beside
its prompts (`data=math`, `data=toy_copy`, `conf/data/`); the schema's default is none, so a run
without one is refused at compose time rather than scored by another task's reward.
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
    """Which reward scores the samples, its time limits, concurrency and failures."""

    # the reward function: the dotted path of a callable in one of the forms rlx.reward lists, e.g.
    # rlx.reward.math.math_answer (slime's --custom-rm-path). null: none; then reward.url must be set,
    # or a rollout.generate_fn sets sample.reward itself (a sample it leaves without one fails, reason
    # no_reward, and is not trained). Task presets set it: data=math, data=toy_copy, data=toy_reverse
    fn: str | None = None
    # sample: reward.fn scores one sample per call; group: one call scores a whole group and
    # returns one reward per sample (functions decorated with @rlx.reward.group_reward need no setting)
    scope: str = "sample"
    timeout_s: float = 60.0  # time limit of one reward call (one HTTP attempt for reward.url)
    num_workers: int = 8  # reward calls running at once (threads for sync functions; requests to url)
    # a failed reward (raised, NaN/inf, not a number, over time, server down): the sample is marked
    # failed and gets reward 0; exclude: it is not trained on (loss mask zeroed); zero: it is trained
    on_failure: str = "exclude"
    reward_key: str | None = None  # a function (or server) returning a dict: the key holding the reward
    # a remote reward model: POST url scores the samples (reward.fn must then be null)
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
