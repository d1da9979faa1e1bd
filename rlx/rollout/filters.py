"""Group filters for dynamic sampling (`rollout.filter_fn`).

The contract: `(group: list[Sample]) -> bool`, called once per finished group (rewards set), True
to keep it for training. A dropped group is counted under `rollout/filter_dropped`; the producer
generates more groups until the batch is full (`rollout.over_sampling_batch_size` launches extra
ones up front). It must not mutate the samples.
"""

from __future__ import annotations

from collections.abc import Callable

from rlx.config.build import load_function
from rlx.sample import Sample

GroupFilter = Callable[[list[Sample]], bool]


def reward_varies(group: list[Sample]) -> bool:
    """DAPO's dynamic sampling: keep a group only if its rewards are not all equal (a group whose
    samples all score the same has zero advantage everywhere and teaches nothing)."""
    return len({s.reward for s in group}) > 1


def load_filter(path: str) -> GroupFilter:
    """The function named by `rollout.filter_fn`; ConfigError naming the key when it is not one."""
    fix = "give the dotted path of a function (group) -> bool, e.g. rollout.filter_fn=rlx.rollout.filters.reward_varies"
    return load_function("rollout.filter_fn", path, fix)
