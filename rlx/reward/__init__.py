"""Reward functions: one sample in, one reward out.

The contract of `rollout.reward_fn` (a `_target_`-style dotted path to any importable function):

    def reward_fn(sample: rlx.sample.Sample) -> float

It is called once per generated sample, after generation, with `sample.prompt`,
`sample.label` (from `data.label_key`), `sample.response_text`, `sample.response_ids` and
`sample.status` filled in. It returns the scalar reward; higher is better. It must not mutate
the sample (put extras in `sample.metadata` only if documented). If it raises, the sample is
marked FAILED with the exception as its `status_reason` and gets no reward.

Built-in: `rlx.reward.toy.position_match`, `rlx.reward.toy.exact_match`.
"""

from __future__ import annotations

from collections.abc import Callable

from hydra._internal.utils import _locate  # what hydra.utils.get_method uses, minus its error logging

from rlx.errors import ConfigError
from rlx.sample import Sample

RewardFn = Callable[[Sample], float]


def load_reward_fn(path: str) -> RewardFn:
    """Import the function named by `path` (e.g. "rlx.reward.toy.position_match")."""
    try:
        fn = _locate(path)
    except Exception as e:  # any import failure is the same user error
        raise ConfigError(f"rollout.reward_fn={path!r} cannot be imported: {e}\n{_FIX}") from e
    if not callable(fn):
        raise ConfigError(f"rollout.reward_fn={path!r} is a {type(fn).__name__}, not a function\n{_FIX}")
    return fn


_FIX = "fix: give the dotted path of a function (sample) -> float, e.g. rollout.reward_fn=rlx.reward.toy.exact_match"
