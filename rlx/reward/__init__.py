"""Rewards: the function a task names in `rollout.reward_fn`, and the scorer that calls it.

The reward function (`rollout.reward_fn`, the dotted path of any importable callable) has one
of these forms; rlx tells them apart by `async def` and by the number of required positional
parameters:

    def reward(sample) -> float                   # sync: runs in a worker thread
    async def reward(sample) -> float             # async: runs on the event loop; must not block
    async def reward(args, sample) -> float       # slime's form, sync or async (`args`: SlimeArgs)
    @rlx.reward.group_reward                      # or reward.scope=group
    def reward(samples) -> list[float]            # one call per group, one reward per sample
                                                  # (also async, also slime's (args, samples))

A sample arrives with `prompt`, `prompt_ids`, `label` (from `data.label_key`), `metadata`,
`response_text`, `response_ids`, `loss_mask` and `status` filled in; a group function gets the
group's samples that need a reward, in index order. The function returns the reward, higher is
better: a real number (a bool counts as 0/1), or a dict whose `reward.reward_key` entry is the
reward (the dict is kept in `sample.metadata["reward_info"]`). It must not change the sample
other than its `metadata`. A generate_fn may set `sample.reward` itself: that sample is not
scored. Samples whose generation failed are not scored either (reward 0), nor are aborted ones
(left as they are: a partial rollout continues them, and they are scored when they finish).

slime's `args` holds (where rlx has them): custom_rm_path, rm_url, reward_key, group_rm,
rollout_batch_size, n_samples_per_prompt, rollout_max_response_len, rollout_temperature,
rollout_top_p, rollout_top_k.

The scorer (`load_scorer`) is what the rollout pool calls, once per group as soon as the group's
generation ends, so rewards are computed while other groups still generate:

    await scorer.score_group(samples)   # sets sample.reward on every sample that needs one
    scorer.metrics()                    # failure counts since the last call, once per step
    await scorer.aclose()               # at shutdown

Each call is limited to `reward.timeout_s`; at most `reward.num_workers` run at once. A call
that raises, overruns, or returns a non-number, NaN or inf fails its sample (every sample, for
a group call): reward 0, `status` FAILED, `status_reason` saying which and why, and
`metadata["reward_failed"]` the reason (`rlx.reward.scorer.FAILURE_REASONS`). With
`reward.on_failure=exclude` (default) its loss mask is also zeroed, so it is not trained on;
with `zero` it is trained with reward 0.

With `reward.url` set, a remote reward model scores every sample instead of a function
(`rlx.reward.remote.RemoteReward`); `rollout.reward_fn` must then be left at its default.

Built-in: `BUILTIN_REWARDS` (docs/tasks.md describes each).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from rlx.config.build import load_function
from rlx.errors import ConfigError
from rlx.reward.config import RewardConfig
from rlx.reward.scorer import FunctionScorer, group_reward, slime_args
from rlx.rollout.config import RolloutConfig
from rlx.sample import Sample

__all__ = ["BUILTIN_REWARDS", "Scorer", "group_reward", "load_reward_fn", "load_scorer", "slime_args"]

BUILTIN_REWARDS = (  # every shipped reward function; tests load and run each
    "rlx.reward.math.math_answer",
    "rlx.reward.math.exact_match",
    "rlx.reward.symbolic.math_verify",
    "rlx.reward.group.majority_vote",
    "rlx.reward.toy.position_match",
    "rlx.reward.toy.exact_match",
)

RewardFn = Callable[[Sample], float]
DEFAULT_REWARD_FN = RolloutConfig.reward_fn  # the schema's default, which reward.url replaces


class Scorer(Protocol):
    """Sets rewards on finished groups; the contract is this module's docstring."""

    async def score_group(self, samples: list[Sample]) -> None: ...

    def metrics(self) -> dict[str, float]: ...

    async def aclose(self) -> None: ...


def load_scorer(
    rollout_reward_fn_path: str,
    reward_cfg: RewardConfig,
    *,
    rollout: RolloutConfig | None = None,
    tokenizer: Any = None,
) -> Scorer:
    """The scorer for a run: the remote reward model when `reward.url` is set (checked to answer
    now, ConfigError if it does not), else `rollout.reward_fn` in whatever form it has.

    `rollout` fills slime's `args`; `tokenizer` renders prompts as the model saw them for the
    remote reward model (without it a string prompt is sent as is, a chat prompt as JSON).
    Raises ConfigError for a path that does not import, a signature no form fits, or both
    `reward.url` and a non-default `rollout.reward_fn`.
    """
    if reward_cfg.url:
        if rollout_reward_fn_path != DEFAULT_REWARD_FN:
            raise ConfigError(
                f"reward.url={reward_cfg.url!r} and rollout.reward_fn={rollout_reward_fn_path!r} are both "
                "set; the remote reward model scores every sample, so the function would never run\n"
                "fix: drop one of them (a function can call the server itself if you need both)"
            )
        from rlx.reward.remote import RemoteReward  # aiohttp only when a server is used

        scorer = RemoteReward(reward_cfg, tokenizer=tokenizer)
        scorer.check()
        return scorer
    fn = load_reward_fn(rollout_reward_fn_path)
    return FunctionScorer(fn, rollout_reward_fn_path, reward_cfg, rollout)


def load_reward_fn(path: str) -> RewardFn:
    """Import the function named by `path` (e.g. "rlx.reward.toy.position_match")."""
    return load_function("rollout.reward_fn", path, _FIX)


_FIX = (
    "give the dotted path of a function (sample) -> float, e.g. rollout.reward_fn=rlx.reward.math.math_answer"
)
