"""Rewards: the function a task names in `reward.fn`, and the scorer that calls it.

The reward function (`reward.fn`, the dotted path of any importable callable; the task presets in
`conf/data/` set it beside their prompts) has one of these forms; rlx tells them apart by
`async def` and by the number of required positional parameters:

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

Who scores is checked when the config is composed (`config_errors`): `reward.fn` or `reward.url`,
not both. A `rollout.generate_fn` may run without either when it sets `sample.reward` itself; a
sample it leaves without one is failed (reason `no_reward`, naming `reward.fn`) and never trained,
whatever `reward.on_failure` says, so a forgotten reward cannot train as a silent 0.

slime's `args` holds (where rlx has them): custom_rm_path (`reward.fn`), rm_url, reward_key,
group_rm, rollout_batch_size, n_samples_per_prompt, rollout_max_response_len, rollout_temperature,
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
(`rlx.reward.remote.RemoteReward`); `reward.fn` must then be null.

Built-in: `BUILTIN_REWARDS` (docs/tasks.md describes each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from rlx.config.build import load_function
from rlx.errors import ConfigError
from rlx.reward.config import RewardConfig
from rlx.reward.scorer import BaseScorer, FunctionScorer, RewardFailure, group_reward, slime_args
from rlx.rollout.config import RolloutConfig
from rlx.sample import Sample

__all__ = [
    "BUILTIN_REWARDS",
    "Scorer",
    "config_errors",
    "group_reward",
    "load_reward_fn",
    "load_scorer",
    "slime_args",
]

BUILTIN_REWARDS = (  # every shipped reward function; tests load and run each
    "rlx.reward.math.math_answer",
    "rlx.reward.math.exact_match",
    "rlx.reward.symbolic.math_verify",
    "rlx.reward.group.majority_vote",
    "rlx.reward.toy.position_match",
    "rlx.reward.toy.exact_match",
)

RewardFn = Callable[[Sample], float]


class Scorer(Protocol):
    """Sets rewards on finished groups; the contract is this module's docstring."""

    async def score_group(self, samples: list[Sample]) -> None: ...

    def metrics(self) -> dict[str, float]: ...

    async def aclose(self) -> None: ...


def config_errors(cfg: RewardConfig, generate_fn: str | None, presets: Sequence[str] = ()) -> list[str]:
    """Who scores, as the config says: `reward.fn` or `reward.url`, not both; neither only beside a
    `rollout.generate_fn` (which may set `sample.reward` itself). `presets`: the data options that
    set `reward.fn`, named in the message. Also whether `reward.fn` imports."""
    if cfg.fn and cfg.url:
        return [
            f"reward.url={cfg.url!r} and reward.fn={cfg.fn!r} are both set; the remote reward model scores "
            "every sample, so the function would never run; drop one of them: reward.fn=null to score by the "
            "server (a data preset may have set reward.fn), or a function that calls the server itself"
        ]
    if not cfg.fn and not cfg.url:
        if generate_fn:
            return []  # it may set every sample's reward; one left without is failed (NoRewardFn)
        choose = f"a task preset that names its reward ({', '.join(presets)}), " if presets else ""
        return [
            "reward.fn is not set and neither is reward.url: nothing would score the samples; choose "
            f"{choose}or set reward.fn=package.module.function (e.g. reward.fn=rlx.reward.math.math_answer), "
            "or reward.url=http://HOST:PORT/PATH for a reward server"
        ]
    if cfg.fn:
        try:
            load_reward_fn(cfg.fn)
        except ConfigError as e:
            return [str(e)]
    return []


def load_scorer(cfg: RewardConfig, *, rollout: RolloutConfig | None = None, tokenizer: Any = None) -> Scorer:
    """The scorer for a run: the remote reward model when `reward.url` is set (checked to answer
    now, ConfigError if it does not), `reward.fn` in whatever form it has, or, with neither beside
    a `rollout.generate_fn`, one that only fails the samples the generate_fn left without a reward.

    `rollout` fills slime's `args` and names the generate_fn; `tokenizer` renders prompts as the
    model saw them for the remote reward model (without it a string prompt is sent as is, a chat
    prompt as JSON). Raises ConfigError for what `config_errors` refuses or a signature no form fits.
    """
    generate_fn = rollout.generate_fn if rollout is not None else None
    if errors := config_errors(cfg, generate_fn):
        raise ConfigError("\n".join(errors))
    if cfg.url:
        from rlx.reward.remote import RemoteReward  # aiohttp only when a server is used

        scorer = RemoteReward(cfg, tokenizer=tokenizer)
        scorer.check()
        return scorer
    if not cfg.fn:
        return NoRewardFn(cfg, generate_fn)
    return FunctionScorer(load_reward_fn(cfg.fn), cfg.fn, cfg, rollout)


def load_reward_fn(path: str) -> RewardFn:
    """Import the function named by `path` (e.g. "rlx.reward.toy.position_match")."""
    return load_function("reward.fn", path, _FIX)


_FIX = "give the dotted path of a function (sample) -> float, e.g. reward.fn=rlx.reward.math.math_answer"


class NoRewardFn(BaseScorer):
    """No reward.fn and no reward.url: the generate_fn sets the rewards. A sample it left without
    one fails (reason `no_reward`) and is never trained, whatever `reward.on_failure` says."""

    def __init__(self, cfg: RewardConfig, generate_fn: str | None):
        super().__init__(cfg)
        self.generate_fn = generate_fn

    async def _score(self, samples: list[Sample]) -> None:
        failure = RewardFailure(
            "no_reward",
            f"rollout.generate_fn={self.generate_fn} left sample.reward unset and no reward.fn (or reward.url) "
            "is set to score it; set reward.fn=..., or have the generate_fn set sample.reward",
        )
        for s in samples:
            self._fail(s, failure)
