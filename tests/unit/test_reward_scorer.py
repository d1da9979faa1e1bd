"""The reward scorer: every function form, the failure modes with their reasons, limits and counts. CPU."""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from dataclasses import replace

import numpy as np
import pytest

from rlx.config.compose import compose
from rlx.errors import ConfigError
from rlx.reward import BUILTIN_REWARDS, group_reward, load_scorer
from rlx.reward.config import RewardConfig
from rlx.reward.scorer import FunctionScorer
from rlx.rollout.config import RolloutConfig
from rlx.sample import Sample, Status

CFG = RewardConfig(timeout_s=5.0, num_workers=4)


def group_of(*responses: str, label: str = "3") -> list[Sample]:
    return [
        Sample(
            prompt="1+2=",
            prompt_ids=[5, 6],
            label=label,
            index=i,
            response_ids=[1, 2, 3],
            response_text=r,
            loss_mask=[1, 1, 1],
            status=Status.COMPLETED,
        )
        for i, r in enumerate(responses)
    ]


def score(fn, samples, cfg=CFG, rollout=None) -> FunctionScorer:
    scorer = FunctionScorer(fn, "tests.reward_fn", cfg, rollout)

    async def run():
        await scorer.score_group(samples)
        await scorer.aclose()

    asyncio.run(run())
    return scorer


def matches(sample: Sample) -> float:
    return float(sample.response_text == sample.label)


async def matches_async(sample: Sample) -> float:
    await asyncio.sleep(0)
    return float(sample.response_text == sample.label)


# ---- the forms ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [matches, matches_async, lambda s: s.response_text == s.label])
def test_sync_async_and_bool_rewards(fn):
    samples = group_of("3", "4", "3")
    scorer = score(fn, samples)
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0]  # a bool counts as 0/1
    assert all(s.status is Status.COMPLETED for s in samples)
    assert scorer.metrics()["reward/num_scored"] == 3


def test_slime_style_function_gets_args():
    seen = []

    async def reward(args, sample):  # slime's signature, unchanged
        seen.append((args.n_samples_per_prompt, args.rollout_max_response_len, args.rm_url, args.group_rm))
        return float(sample.response_text == sample.label)

    samples = group_of("3", "5")
    score(reward, samples, rollout=RolloutConfig(n_samples_per_prompt=2, max_response_len=16))
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert seen == [(2, 16, None, False)] * 2


def test_slime_args_name_what_they_hold():
    def reward(args, sample):
        return args.rm_type  # a slime argument rlx does not have

    samples = group_of("3")
    score(reward, samples)
    assert samples[0].status is Status.FAILED
    assert samples[0].metadata["reward_failed"] == "raised"
    assert "args.rm_type: rlx passes slime-style reward functions only" in samples[0].status_reason
    assert "custom_rm_path" in samples[0].status_reason


@group_reward
def rank_by_length(samples):  # shortest response 1.0, then 0.5, 0.25, ... (ties share the rank)
    lengths = sorted({len(s.response_text) for s in samples})
    return [0.5 ** lengths.index(len(s.response_text)) for s in samples]


def test_group_reward_by_decorator_sync_and_async():
    samples = group_of("ccc", "a", "bb", "a")
    scorer = score(rank_by_length, samples)
    assert [s.reward for s in samples] == [0.25, 1.0, 0.5, 1.0]
    assert scorer.metrics()["reward/num_scored"] == 4

    calls = []

    async def slime_group(args, samples):  # slime's group_rm form, declared by reward.scope=group
        calls.append((args.group_rm, len(samples)))
        return [float(len(s.response_text)) for s in samples]

    samples = group_of("ccc", "a")
    score(slime_group, samples, cfg=replace(CFG, scope="group"))
    assert [s.reward for s in samples] == [3.0, 1.0]
    assert calls == [(True, 2)]  # one call for the group


def test_group_reward_wrong_count_fails_every_sample():
    samples = group_of("3", "3", "3")
    scorer = score(group_reward(lambda samples: [1.0, 1.0]), samples)
    assert all(s.status is Status.FAILED for s in samples)
    assert all(s.metadata["reward_failed"] == "wrong_count" for s in samples)
    assert "returned 2 values for a group of 3 samples" in samples[0].status_reason
    assert scorer.metrics()["reward/failed_wrong_count"] == 3

    samples = group_of("3", "3")
    score(group_reward(lambda samples: 0.5), samples)  # one number for the group
    assert "returned float 0.5 for a group of 2 samples" in samples[0].status_reason


def test_group_reward_may_return_an_array():
    samples = group_of("3", "4")
    score(group_reward(lambda samples: np.array([0.5, np.nan])), samples)
    assert samples[0].reward == 0.5 and samples[0].status is Status.COMPLETED
    assert samples[1].metadata["reward_failed"] == "not_finite"  # only the bad entry fails


def test_load_scorer_finds_the_form_by_path():
    group = load_scorer(replace(CFG, fn="rlx.reward.group.majority_vote"))
    single = load_scorer(replace(CFG, fn="rlx.reward.math.math_answer"))
    assert group.group and not single.group and not single.is_async
    samples = group_of(r"\boxed{3}", "it is 3", r"\boxed{4}")
    asyncio.run(group.score_group(samples))
    assert [s.reward for s in samples] == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("path", BUILTIN_REWARDS)
def test_every_builtin_reward_loads_and_scores(path):
    if path.startswith("rlx.reward.symbolic"):
        pytest.importorskip("math_verify")
    samples = group_of("3", r"\boxed{4}")  # label "3": right, then wrong, for every built-in
    scorer = load_scorer(replace(CFG, fn=path))
    asyncio.run(scorer.score_group(samples))
    assert [s.reward for s in samples] == [1.0, 0.0]
    assert scorer.metrics()["reward/num_failed"] == 0


# ---- what the scorer leaves alone --------------------------------------------------------------


def test_preset_rewards_and_failed_generations_are_not_scored():
    samples = group_of("3", "3", "3", "3")
    samples[0].reward = 0.25  # the generate_fn scored it
    samples[1].status, samples[1].status_reason = Status.ABORTED, "weight update"
    samples[2].status = Status.FAILED
    called = []
    scorer = score(lambda s: called.append(s.index) or 1.0, samples)
    assert called == [3]
    assert [s.reward for s in samples] == [0.25, None, 0.0, 1.0]  # aborted: scored when it finishes
    assert [s.status for s in samples] == [Status.COMPLETED, Status.ABORTED, Status.FAILED, Status.COMPLETED]
    metrics = scorer.metrics()
    assert (metrics["reward/num_scored"], metrics["reward/num_preset"], metrics["reward/num_failed"]) == (
        1,
        1,
        0,
    )


# ---- failures ----------------------------------------------------------------------------------


def _raise(sample):
    raise KeyError("answer")


@pytest.mark.parametrize(
    "returned, reason, text",
    [
        (_raise, "raised", "tests.reward_fn raised KeyError: 'answer'"),
        (lambda s: math.nan, "not_finite", "returned nan"),
        (lambda s: -math.inf, "not_finite", "returned -inf"),
        (lambda s: "1.0", "not_a_number", "returned str '1.0', not a number"),
        (lambda s: None, "not_a_number", "returned NoneType None, not a number"),
        (lambda s: [1.0, 0.0], "not_a_number", "returned list [1.0, 0.0], not a number"),
        (lambda s: np.array([1.0, 2.0]), "not_a_number", "not a number"),
        (lambda s: {"acc": 1.0}, "not_a_number", "returned a dict (keys: acc); set reward.reward_key"),
    ],
)
def test_failures_are_marked_with_the_reason(returned, reason, text):
    samples = group_of("3")
    scorer = score(returned, samples)
    s = samples[0]
    assert s.status is Status.FAILED
    assert s.reward == 0.0
    assert s.metadata["reward_failed"] == reason
    assert s.status_reason.startswith(f"reward {reason}: ")
    assert text in s.status_reason
    assert s.loss_mask == [0, 0, 0]  # on_failure=exclude: not trained on
    metrics = scorer.metrics()
    assert metrics[f"reward/failed_{reason}"] == 1 and metrics["reward/num_failed"] == 1
    assert scorer.metrics()["reward/num_failed"] == 0  # counts are per step: read once, then reset


def test_an_eval_samples_failure_marks_it_but_not_the_steps_reward_counts():
    """An eval set's samples (metadata eval_set) count in eval/NAME/num_failed, not in the step's
    reward/*: the end-to-end check read reward/failed_raised 2 beside rollout/failed_frac 0."""
    train, evaluated = group_of("3"), group_of("3", "4")
    for s in evaluated:
        s.metadata["eval_set"] = "test"
    scorer = FunctionScorer(_raise, "tests.reward_fn", CFG, None)

    async def run():
        await scorer.score_group(train)
        await scorer.score_group(evaluated)
        await scorer.aclose()

    asyncio.run(run())
    assert all(
        s.status is Status.FAILED and s.metadata["reward_failed"] == "raised" for s in train + evaluated
    )
    metrics = scorer.metrics()
    assert metrics["reward/failed_raised"] == 1 and metrics["reward/num_failed"] == 1  # the training sample


def test_a_label_math_answer_cannot_use_fails_its_sample_counted():
    from rlx.reward.math import math_answer

    samples = group_of("the answer is 3", "3", label="")
    scorer = score(math_answer, samples)
    assert all(s.status is Status.FAILED and s.metadata["reward_failed"] == "raised" for s in samples)
    assert "the label '' holds no answer to compare with" in samples[0].status_reason
    assert scorer.metrics()["reward/failed_raised"] == 2


def test_on_failure_zero_keeps_the_sample_trained():
    samples = group_of("3")
    score(lambda s: math.nan, samples, cfg=replace(CFG, on_failure="zero"))
    assert samples[0].status is Status.FAILED and samples[0].reward == 0.0
    assert samples[0].loss_mask == [1, 1, 1]


def test_numbers_of_other_types_and_dicts_with_reward_key():
    samples = group_of("3", "3", "3")
    values = iter([np.float32(0.5), 2, {"score": 0.75, "acc": 1}])
    score(lambda s: next(values), samples, cfg=replace(CFG, reward_key="score", num_workers=1))
    assert [s.reward for s in samples] == [0.5, 2.0, 0.75]
    assert samples[2].metadata["reward_info"] == {"score": 0.75, "acc": 1}


def test_sync_timeout_writes_off_the_thread_and_the_next_call_runs():
    release = threading.Event()

    def hangs_on_first(sample):
        if sample.index == 0:
            release.wait(30)  # overruns reward.timeout_s; released at the end of the test
        return 1.0

    samples = group_of("3", "3")
    cfg = replace(CFG, timeout_s=0.2, num_workers=1)  # one worker: the second call needs the replacement
    scorer = FunctionScorer(hangs_on_first, "tests.reward_fn", cfg)

    async def run():
        await scorer.score_group(samples[:1])
        await scorer.score_group(samples[1:])

    asyncio.run(run())
    release.set()
    assert samples[0].metadata["reward_failed"] == "timeout"
    assert "took longer than reward.timeout_s=0.2" in samples[0].status_reason
    assert samples[1].reward == 1.0 and samples[1].status is Status.COMPLETED
    assert scorer.metrics()["reward/failed_timeout"] == 1


def test_a_call_waiting_for_a_worker_is_not_timed_out_for_it():
    # one worker, four calls of 0.15 s each, reward.timeout_s=0.3: the last waits 0.45 s in the
    # queue and runs 0.15 s; only the time it runs counts against the limit
    def slow(sample):
        time.sleep(0.15)
        return 1.0

    samples = group_of("3", "3", "3", "3")
    scorer = score(slow, samples, cfg=replace(CFG, timeout_s=0.3, num_workers=1))
    assert [s.reward for s in samples] == [1.0] * 4
    assert scorer.metrics()["reward/failed_timeout"] == 0


def test_calls_of_a_cancelled_group_that_had_not_started_never_run():
    release = threading.Event()
    ran = []

    def blocks_first(sample):
        ran.append(sample.index)
        if sample.index == 0:
            release.wait(30)
        return 1.0

    samples = group_of("3", "3", "3")
    scorer = FunctionScorer(blocks_first, "tests.reward_fn", replace(CFG, num_workers=1))

    async def run():
        first = asyncio.ensure_future(scorer.score_group(samples))
        await asyncio.sleep(0.05)
        first.cancel()  # the pool dropped the group: call 0 runs, calls 1 and 2 wait in the queue
        await asyncio.sleep(0.05)

    asyncio.run(run())
    release.set()
    time.sleep(0.1)  # the written-off thread returns; a skipped call would have run by now
    assert ran == [0]
    assert [s.reward for s in samples] == [None, None, None]


def test_a_cancelled_call_gives_its_worker_back():
    release = threading.Event()

    def blocks_first(sample):
        if sample.index == 0:
            release.wait(30)
        return 1.0

    samples = group_of("3", "3")
    scorer = FunctionScorer(blocks_first, "tests.reward_fn", replace(CFG, num_workers=1))

    async def run():
        first = asyncio.ensure_future(scorer.score_group(samples[:1]))
        await asyncio.sleep(0.05)
        first.cancel()  # the pool dropped the group; its call still blocks its thread
        # one worker: without a replacement thread this call would queue and time out (5 s)
        await scorer.score_group(samples[1:])

    asyncio.run(run())
    release.set()
    assert samples[0].reward is None
    assert samples[1].reward == 1.0 and samples[1].status is Status.COMPLETED


def test_async_timeout_and_an_own_timeout_error_differ():
    async def slow(sample):
        if sample.index == 0:
            await asyncio.sleep(30)
        raise TimeoutError("my own HTTP call timed out")

    samples = group_of("3", "3")
    score(slow, samples, cfg=replace(CFG, timeout_s=0.2))
    assert samples[0].metadata["reward_failed"] == "timeout"
    assert samples[1].metadata["reward_failed"] == "raised"
    assert "TimeoutError: my own HTTP call timed out" in samples[1].status_reason


# ---- concurrency -------------------------------------------------------------------------------


def test_sync_functions_do_not_block_the_event_loop():
    loop_ran = threading.Event()

    def waits_for_the_loop(sample):  # on the event loop's thread this would wait out its 5 s
        return float(loop_ran.wait(5))

    samples = group_of("3")
    scorer = FunctionScorer(waits_for_the_loop, "tests.reward_fn", CFG)

    async def run():
        async def tick():
            await asyncio.sleep(0.01)
            loop_ran.set()

        await asyncio.gather(scorer.score_group(samples), tick())

    asyncio.run(run())
    assert samples[0].reward == 1.0


def test_a_large_batch_from_many_loops_and_workers_gets_every_reward_right():
    """Workers finish calls at once and hand them back in bursts (one wake-up of the loop per
    burst): no result may be lost or reach another sample or another event loop's waiter."""

    def own_index(sample):
        return float(sample.group * 1000 + sample.index)

    scorer = FunctionScorer(own_index, "tests.reward_fn", replace(CFG, num_workers=8))
    batches = []

    def one_loop():  # two event loops (threads) share the scorer's workers
        groups = [group_of(*["3"] * 16) for _ in range(64)]
        for g, group in enumerate(groups):
            for s in group:
                s.group = g
        batches.append(groups)

        async def run():
            await asyncio.gather(*(scorer.score_group(group) for group in groups))

        asyncio.run(run())

    threads = [threading.Thread(target=one_loop) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    asyncio.run(scorer.aclose())
    assert len(batches) == 2
    for groups in batches:
        assert [s.reward for group in groups for s in group] == [
            float(g * 1000 + i) for g in range(64) for i in range(16)
        ]


@pytest.mark.parametrize("num_workers, rewards", [(2, [1.0, 1.0]), (1, None)])
def test_num_workers_calls_run_at_once(num_workers, rewards):
    barrier = threading.Barrier(2, timeout=1.0)  # passes only if both calls run at the same time

    def meet(sample):
        barrier.wait()
        return 1.0

    samples = group_of("3", "3")
    score(meet, samples, cfg=replace(CFG, num_workers=num_workers))
    if rewards:
        assert [s.reward for s in samples] == rewards
    else:  # one worker: the first call waits at the barrier alone and it breaks
        assert samples[0].metadata["reward_failed"] == "raised"
        assert "BrokenBarrierError" in samples[0].status_reason


# ---- loading errors ----------------------------------------------------------------------------


def test_signatures_no_form_fits_are_config_errors():
    def three(args, sample, extra):
        return 1.0

    with pytest.raises(
        ConfigError, match=r"reward.fn='tests.reward_fn' has the signature \(args, sample, extra\)"
    ):
        FunctionScorer(three, "tests.reward_fn", CFG)
    with pytest.raises(ConfigError, match="has the signature"):
        FunctionScorer(lambda: 1.0, "tests.reward_fn", CFG)
    FunctionScorer(lambda sample, weight=2.0: 1.0, "tests.reward_fn", CFG)  # defaults are fine


def test_url_and_a_reward_fn_together_are_a_config_error():
    cfg = replace(CFG, fn="rlx.reward.math.math_answer", url="http://127.0.0.1:9/score")
    with pytest.raises(
        ConfigError, match="reward.url=.* and reward.fn='rlx.reward.math.math_answer' are both set"
    ):
        load_scorer(cfg)
    with pytest.raises(ConfigError, match="reward.fn='rlx.reward.mathx.f' cannot be imported"):
        load_scorer(replace(CFG, fn="rlx.reward.mathx.f"))


def test_no_reward_fn_and_no_url_is_a_config_error_without_a_generate_fn():
    with pytest.raises(ConfigError, match="reward.fn is not set and neither is reward.url"):
        load_scorer(CFG)
    with pytest.raises(ConfigError, match="reward.fn is not set"):
        load_scorer(CFG, rollout=RolloutConfig())


@pytest.mark.parametrize("on_failure", ["exclude", "zero"])
def test_a_generate_fn_without_reward_fn_fails_the_samples_it_left_unscored(on_failure):
    """The generate_fn set a reward on sample 0 only: sample 1 fails naming reward.fn, and is not
    trained even with reward.on_failure=zero (a forgotten reward is no penalty for the model)."""
    scorer = load_scorer(
        replace(CFG, on_failure=on_failure), rollout=RolloutConfig(generate_fn="my_env.play")
    )
    samples = group_of("3", "4")
    samples[0].reward = 0.75
    asyncio.run(scorer.score_group(samples))
    assert (samples[0].reward, samples[0].status, samples[0].loss_mask) == (0.75, Status.COMPLETED, [1, 1, 1])
    assert (samples[1].reward, samples[1].status, samples[1].loss_mask) == (0.0, Status.FAILED, [0, 0, 0])
    assert samples[1].metadata["reward_failed"] == "no_reward"
    assert samples[1].status_reason == (
        "reward no_reward: rollout.generate_fn=my_env.play left sample.reward unset and no reward.fn "
        "(or reward.url) is set to score it; set reward.fn=..., or have the generate_fn set sample.reward"
    )
    metrics = scorer.metrics()
    assert (
        metrics["reward/num_preset"],
        metrics["reward/failed_no_reward"],
        metrics["reward/num_failed"],
    ) == (1, 1, 1)


@pytest.mark.parametrize(
    "override, message",
    [
        ("reward.on_failure=drop", "reward.on_failure='drop' is not one of ['exclude', 'zero']"),
        ("reward.scope=batch", "reward.scope='batch' is not one of ['sample', 'group']"),
        ("reward.url=localhost:5000", "reward.url='localhost:5000' must be http://... or https://..."),
        ("reward.timeout_s=0", "reward.timeout_s=0.0 must be > 0"),
    ],
)
def test_bad_reward_settings_fail_at_compose(override, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        compose([override])
