"""Batches from one real engine (tiny model, CPU): partial rollouts continue exactly where they
stopped, over-sampled groups are aborted and carried over, the dynamic filter keeps batches full."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.request

import pytest
from transformers import AutoTokenizer

from rlx.reward.config import RewardConfig
from rlx.rollout.buffer import RolloutBuffer
from rlx.rollout.config import RolloutConfig
from rlx.rollout.group import append_answer, expand
from rlx.rollout.loop_watch import RolloutLoopBlocked
from rlx.rollout.pool import RolloutPool
from rlx.rollout.producer import Producer, _mask_old_tokens
from rlx.sample import Sample, Status

TOY_REWARD = "rlx.reward.toy.position_match"  # the prompts are toy digits


def parity_reward(sample: Sample) -> float:
    """1 when the first response token is even: about half of a random model's samples."""
    return float(sample.response_ids[0] % 2 == 0)


class _Prompts:
    """A data source of numbered prompts, in order."""

    def __init__(self, tokenizer):
        self.tokenizer, self.next = tokenizer, 0

    def take(self, n: int) -> list[Sample]:
        rows = []
        for _ in range(n):
            text = f"{self.next % 10} {self.next % 7} ="
            rows.append(
                Sample(prompt=text, prompt_ids=self.tokenizer(text)["input_ids"], label=str(self.next))
            )
            self.next += 1
        return rows


@pytest.fixture(scope="module")
def tokenizer(tiny_qwen3_dir):
    return AutoTokenizer.from_pretrained(str(tiny_qwen3_dir))


def _pool(tiny_qwen3_dir, tokenizer, reward_fn: str = TOY_REWARD, **overrides) -> RolloutPool:
    cfg = RolloutConfig(
        **({"n_samples_per_prompt": 2, "max_response_len": 12, "ignore_eos": True} | overrides)
    )
    return RolloutPool(cfg, str(tiny_qwen3_dir), tokenizer, seed=0, reward=RewardConfig(fn=reward_fn))


def test_a_partial_sample_continues_with_its_tokens_and_logprobs_intact(
    ray_session, tiny_qwen3_dir, tokenizer
):
    pool = _pool(tiny_qwen3_dir, tokenizer, temperature=0.0, n_samples_per_prompt=1)
    try:
        prompt = _Prompts(tokenizer).take(1)[0]
        whole = expand(prompt, 0, 1)
        pool.run(pool.generate_group(whole, step=0, version=0))
        assert whole[0].response_len == 12 and whole[0].status is Status.TRUNCATED

        # the first 5 tokens under version 0, then the sample is aborted (as an abort leaves it)
        part = expand(prompt, 0, 1)
        params = pool.sampling_params | {"max_new_tokens": 5}
        out = pool.run(pool.engines.client.generate_batch([part[0].tokens], params))
        append_answer(part[0], out[0], 0, pool.tokenizer)
        part[0].status = Status.ABORTED
        head_ids, head_logprobs = list(part[0].response_ids), list(part[0].rollout_logprobs)
        assert len(head_ids) == 5

        pool.run(pool.generate_group(part, step=1, version=1))  # continues under version 1
        s = part[0]
        assert s.status is Status.TRUNCATED and s.response_len == 12
        assert s.response_ids[:5] == head_ids and s.rollout_logprobs[:5] == head_logprobs  # intact
        # greedy: the continuation is what one uninterrupted request generates, logprobs too
        assert s.response_ids == whole[0].response_ids
        assert s.rollout_logprobs == pytest.approx(whole[0].rollout_logprobs, abs=1e-5)
        assert s.token_versions == [0] * 5 + [1] * 7 and s.version == 0
        assert s.loss_mask == [1] * 12 and s.reward is not None
        assert _mask_old_tokens(s) == 5 and s.loss_mask == [0] * 5 + [1] * 7
    finally:
        pool.shutdown()


def test_over_sampled_groups_are_aborted_and_carried_over(ray_session, tiny_qwen3_dir, tokenizer):
    # 6 groups launched for a batch of 2, at most 2 requests at a time: once 2 are done the rest
    # are aborted mid-generation or before they were sent, and continue in the next batch
    pool = _pool(
        tiny_qwen3_dir, tokenizer, batch_size=2, over_sampling_batch_size=6, max_concurrency=2,
        max_response_len=24, partial_rollout=True,
    )  # fmt: skip
    buffer = RolloutBuffer()
    producer = Producer(pool.cfg, pool, _Prompts(tokenizer), buffer, version=0, last_step=1)
    try:
        samples, metrics = producer.batch(0, train_version=0)
        assert [(s.group, s.index) for s in samples] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert all(s.status is Status.TRUNCATED and s.response_len == 24 for s in samples)
        assert metrics["rollout/aborted_groups"] == 4 and metrics["rollout/partial_carried"] == 4
        carried = [buffer.next_carried() for _ in range(4)]
        assert buffer.next_carried() is None
        snapshot = {id(s): (list(s.response_ids), list(s.rollout_logprobs)) for g in carried for s in g}
        assert all(s.status is Status.ABORTED and s.response_len < 24 for g in carried for s in g)
        for g in reversed(carried):
            buffer._carried.appendleft(g)

        samples, metrics = producer.batch(1, train_version=1)
        assert metrics["rollout/partial_resumed"] == 4 * 2  # every carried sample was unfinished
        resumed = [s for s in samples if id(s) in snapshot]
        assert len(resumed) == 4  # the batch's two groups are the first two carried ones
        for s in resumed:
            ids, logprobs = snapshot[id(s)]
            assert s.response_len == 24 and s.response_ids[: len(ids)] == ids
            assert s.rollout_logprobs[: len(logprobs)] == logprobs
            assert s.token_versions == [0] * 24  # nothing was published in between
    finally:
        producer.close()
        pool.shutdown()


def test_the_dynamic_filter_keeps_every_batch_full_of_groups_whose_rewards_differ(
    ray_session, tiny_qwen3_dir, tokenizer
):
    pool = _pool(
        tiny_qwen3_dir, tokenizer, batch_size=4, over_sampling_batch_size=6, max_response_len=2,
        reward_fn="test_producer.parity_reward", filter_fn="rlx.rollout.filters.reward_varies",
    )  # fmt: skip
    producer = Producer(pool.cfg, pool, _Prompts(tokenizer), RolloutBuffer(), version=0, last_step=2)
    dropped = 0
    try:
        for step in range(3):
            samples, metrics = producer.batch(step, train_version=step)
            assert len(samples) == 4 * 2
            for g in range(4):
                rewards = {s.reward for s in samples if s.group == g}
                assert rewards == {0.0, 1.0}, (step, g, rewards)
            dropped += metrics.get("rollout/filter_dropped", 0)
        assert dropped > 0  # about half of the groups of two agree; they never reached a batch
    finally:
        producer.close()
        pool.shutdown()


def filter_raises(group: list[Sample]) -> bool:
    raise KeyError("score")


def filter_answers_none(group: list[Sample]):
    return None


@pytest.mark.parametrize(
    "name, message",
    [
        ("filter_raises", r"rollout.filter_fn='test_producer.filter_raises' \(on group 0, prompt '0 0 ='\) raised KeyError: 'score'"),
        ("filter_answers_none", r"rollout.filter_fn='test_producer.filter_answers_none' \(on group 0, prompt '0 0 ='\) returned NoneType None, not True or False \(True keeps"),
    ],
)  # fmt: skip
def test_a_filter_that_raises_or_answers_neither_true_nor_false_is_named(
    ray_session, tiny_qwen3_dir, tokenizer, name, message
):
    pool = _pool(
        tiny_qwen3_dir, tokenizer, batch_size=1, max_response_len=2, filter_fn=f"test_producer.{name}"
    )
    producer = Producer(pool.cfg, pool, _Prompts(tokenizer), RolloutBuffer(), version=0, last_step=0)
    try:
        with pytest.raises(RuntimeError, match=message):
            producer.batch(0, train_version=0)
    finally:
        producer.close()
        pool.shutdown()


async def two_turns(ctx, sample, params):
    """Model turn (3 tokens), a tool answer ("7 ="), model turn (3 tokens); fanned out to two."""
    out = await ctx.generate(sample.tokens, params | {"max_new_tokens": 3})
    ctx.append_output(sample, out)
    tool = ctx.append_text(sample, "7 =")
    out = await ctx.generate(sample.tokens, params | {"max_new_tokens": 3})
    ctx.append_output(sample, out)
    sample.metadata["tool_ids"] = tool
    twin = Sample.from_json(sample.to_json())
    twin.reward = 0.25  # set by the function itself: the scorer leaves it
    return [sample, twin]


def test_a_generate_fn_builds_multi_turn_samples_with_tool_tokens_out_of_the_loss(
    ray_session, tiny_qwen3_dir, tokenizer
):
    pool = _pool(
        tiny_qwen3_dir, tokenizer, generate_fn="test_producer.two_turns", max_response_len=16, ignore_eos=True
    )
    try:
        group = expand(_Prompts(tokenizer).take(1)[0], 0, 2)
        pool.run(pool.generate_group(group, step=0, version=0))
        assert [s.index for s in group] == [0, 1, 2, 3]  # two samples, each fanned out to two
        for s in group:
            k = len(s.metadata["tool_ids"])
            assert s.response_len == 3 + k + 3
            assert s.loss_mask == [1] * 3 + [0] * k + [1] * 3
            assert s.response_ids[3 : 3 + k] == s.metadata["tool_ids"]
            assert s.rollout_logprobs[3 : 3 + k] == [0.0] * k
            assert all(lp < 0 for lp in s.rollout_logprobs[:3] + s.rollout_logprobs[3 + k :])
            assert s.status is Status.TRUNCATED and s.version == 0
        assert [s.reward for s in group[1::2]] == [0.25, 0.25]  # the function's own reward kept
        assert all(s.reward in (0.0, 1 / 3, 2 / 3, 1.0) for s in group[::2])  # scored by the toy reward
    finally:
        pool.shutdown()


def broken_reward(sample: Sample) -> float:
    raise ValueError("no label parser for this task")


def test_a_step_whose_samples_all_fail_stops_the_run_with_the_reason(ray_session, tiny_qwen3_dir, tokenizer):
    pool = _pool(
        tiny_qwen3_dir, tokenizer, batch_size=2, max_response_len=2, reward_fn="test_producer.broken_reward"
    )
    producer = Producer(pool.cfg, pool, _Prompts(tokenizer), RolloutBuffer(), version=0, last_step=0)
    try:
        with pytest.raises(
            RuntimeError, match=r"4 of 4 samples failed \(run.max_failed_frac=1.0\).*no label parser"
        ):
            producer.batch(0, train_version=0)
    finally:
        producer.close()
        pool.shutdown()


def odd_label_breaks(sample: Sample) -> float:
    if int(sample.label) % 2:
        raise ValueError(f"cannot parse label {sample.label}")
    return 1.0


def test_a_reward_that_raises_on_some_prompts_is_said_and_counted(
    ray_session, tiny_qwen3_dir, tokenizer, caplog
):
    """Odd labels raise: their groups are left out, new prompts fill the batch, each round that
    failed says so (a warning with the first reason), and rollout/failed_frac counts the failed
    samples of all that was generated, not of the batch (where none is left)."""
    pool = _pool(
        tiny_qwen3_dir,
        tokenizer,
        batch_size=4,
        max_response_len=2,
        reward_fn="test_producer.odd_label_breaks",
    )
    producer = Producer(pool.cfg, pool, _Prompts(tokenizer), RolloutBuffer(), version=0, last_step=0)
    try:
        with caplog.at_level("WARNING", logger="rlx.rollout.producer"):
            samples, metrics = producer.batch(0, train_version=0)
    finally:
        producer.close()
        pool.shutdown()
    assert len(samples) == 8 and all(int(s.label) % 2 == 0 and s.reward == 1.0 for s in samples)
    generated, failed = metrics["rollout/generated_samples"], metrics["rollout/failed_samples"]
    assert 4 <= failed < generated and failed % 2 == 0  # at least prompts 1 and 3, whole groups
    assert metrics["rollout/failed_frac"] == failed / generated
    assert metrics["rollout/failed_groups"] >= 2
    warnings = [r.getMessage() for r in caplog.records]
    assert re.match(
        r"step 0: \d+ of \d+ samples failed; groups whose every sample failed are left out", warnings[0]
    )
    assert "run.max_failed_frac=1.0" in warnings[0] and "cannot parse label 1" in warnings[0]


def test_shutdown_stops_the_tools_fork_servers_before_closing_its_loop(
    ray_session, tiny_qwen3_dir, tokenizer, tmp_path
):
    """A generate_fn's tool calls run on the pool's loop; shutdown closes their fork servers on
    it (`rlx.agent.close_sandboxes`), or Python 3.12 reports each at exit ("Event loop is closed")."""
    from rlx.agent import Sandbox

    tool = tmp_path / "echo.py"
    tool.write_text("import sys\nprint(sys.stdin.read())\n")
    sandbox = Sandbox(max_concurrency=1)
    pool = _pool(tiny_qwen3_dir, tokenizer)
    try:
        assert pool.run(sandbox.run([str(tool)], "hi")).output == "hi\n"
        servers = list(sandbox._pools[pool._loop].servers)
        assert len(servers) == 1 and servers[0].returncode is None
    finally:
        pool.shutdown()
    assert servers[0].returncode == 0 and servers[0].stdin.is_closing()


def test_a_response_ending_on_a_stop_token_at_its_length_limit_is_completed(
    ray_session, tiny_qwen3_dir, tokenizer
):
    """Every word a stop token and one token allowed: the engine, checking the length limit first
    as SGLang does, answers "length" for each; each response ended all the same, so COMPLETED.
    Two tokens allowed and no stop token: cut short, TRUNCATED."""
    every_word = list(range(len(tokenizer)))
    pool = _pool(tiny_qwen3_dir, tokenizer, max_response_len=1, ignore_eos=False, stop_token_ids=every_word)
    try:
        samples, metrics = pool.generate(_Prompts(tokenizer).take(4), version=0)
        assert [s.response_len for s in samples] == [1] * 8
        assert {s.status for s in samples} == {Status.COMPLETED} and metrics["rollout/truncated_frac"] == 0
        raw = pool.run(pool.engines.client.generate(samples[0].prompt_ids, pool.sampling_params))
        assert raw["meta_info"]["finish_reason"]["type"] == "length"  # what the engine itself says
    finally:
        pool.shutdown()
    pool = _pool(tiny_qwen3_dir, tokenizer, max_response_len=2)  # ignore_eos: nothing stops
    try:
        samples, metrics = pool.generate(_Prompts(tokenizer).take(2), version=0)
        assert {s.status for s in samples} == {Status.TRUNCATED} and metrics["rollout/truncated_frac"] == 1
    finally:
        pool.shutdown()


def test_a_response_ending_on_a_stop_string_at_its_length_limit_is_completed(
    ray_session, tiny_qwen3_dir, tokenizer
):
    """`rollout.stop` reaches the engine as SGLang's `stop`; every word a stop string and one token
    allowed: the engine answers "length", and a response whose word is one ended all the same
    (COMPLETED); one whose token has no text (a special token) matched none (TRUNCATED)."""
    words = [w for w in tokenizer.get_vocab() if w not in tokenizer.all_special_tokens]
    pool = _pool(tiny_qwen3_dir, tokenizer, max_response_len=1, stop=words, n_samples_per_prompt=4)
    try:
        samples, _ = pool.generate(_Prompts(tokenizer).take(4), version=0)
        texts = [tokenizer.decode(s.response_ids, skip_special_tokens=True) for s in samples]
        expected = [Status.COMPLETED if t in words else Status.TRUNCATED for t in texts]
        assert [s.status for s in samples] == expected and Status.COMPLETED in expected, texts
        assert pool.sampling_params["stop"] == words
        raw = pool.run(pool.engines.client.generate(samples[0].prompt_ids, pool.sampling_params))
        assert raw["meta_info"]["finish_reason"]["type"] == "length"  # what the engine itself says
        # two tokens allowed: a first token that is a stop word ends the request with "stop"
        params = pool.sampling_params | {"max_new_tokens": 2}
        two = pool.run(pool.engines.client.generate(samples[0].prompt_ids, params))
        first = tokenizer.decode(two["output_ids"][:1], skip_special_tokens=True)
        if first in words:
            assert two["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
            assert len(two["output_ids"]) == 1
    finally:
        pool.shutdown()


async def one_hangs(ctx, sample, params):
    """Sample 0 waits for what never comes, sample 1 raises its own TimeoutError, the rest answer."""
    if sample.index == 0:
        await asyncio.Event().wait()
    if sample.index == 1:
        raise TimeoutError("the search service did not answer")
    ctx.append_output(sample, await ctx.generate(sample.tokens, params))
    return sample


def test_a_generate_fn_past_its_time_limit_fails_its_sample_and_the_rest_go_on(
    ray_session, tiny_qwen3_dir, tokenizer
):
    pool = _pool(
        tiny_qwen3_dir, tokenizer, generate_fn="test_producer.one_hangs", generate_timeout_s=1.5,
        n_samples_per_prompt=3, max_response_len=2,
    )  # fmt: skip
    try:
        group = expand(_Prompts(tokenizer).take(1)[0], 0, 3)
        start = time.monotonic()
        pool.run(pool.generate_group(group, step=0, version=0))
        assert time.monotonic() - start < 10
        assert [s.status for s in group] == [Status.FAILED, Status.FAILED, Status.TRUNCATED]
        assert group[0].status_reason == (
            "generate_fn did not finish within rollout.generate_timeout_s=1.5 s (cancelled)"
        )
        assert group[1].status_reason == "generate_fn raised TimeoutError: the search service did not answer"
        assert group[2].response_len == 2
    finally:
        pool.shutdown()


async def returns_garbage(ctx, sample, params):
    """Sample 0 returns nothing, sample 1 an empty list, sample 2 a list holding a string, sample 3
    tokens set by hand beside a loss mask of another length."""
    if sample.index == 3:
        sample.response_ids, sample.loss_mask = [5, 6, 7], [1, 1]
        return sample
    return [None, [], ["not a sample"]][sample.index]


def test_a_generate_fn_that_returns_no_sample_fails_it_naming_what_came_back(
    ray_session, tiny_qwen3_dir, tokenizer
):
    pool = _pool(
        tiny_qwen3_dir, tokenizer, generate_fn="test_producer.returns_garbage", n_samples_per_prompt=4
    )
    try:
        group = expand(_Prompts(tokenizer).take(1)[0], 0, 4)
        pool.run(pool.generate_group(group, step=0, version=0))
        assert [s.status for s in group] == [Status.FAILED] * 4
        assert [s.status_reason for s in group] == [
            "generate_fn returned NoneType None, not the sample or a list of samples",
            "generate_fn returned an empty list, not the sample or a list of samples",
            "generate_fn returned list ['not a sample'], not the sample or a list of samples",
            "generate_fn left sample.loss_mask with 2 entries for 3 response tokens; append tokens with "
            "ctx.append_output / ctx.append_tokens, which keep them aligned",
        ]
    finally:
        pool.shutdown()


async def blocks_the_loop(ctx, sample, params):
    time.sleep(6)  # the mistake: blocking instead of awaiting (every sample and timeout waits)
    return sample


def test_a_generate_fn_that_blocks_the_loop_ends_the_wait_naming_its_line(
    ray_session, tiny_qwen3_dir, tokenizer
):
    pool = _pool(tiny_qwen3_dir, tokenizer, generate_fn="test_producer.blocks_the_loop")
    pool.watch.blocked_s = 1.0  # BLOCKED_S (60 s) in a run
    start = time.monotonic()
    try:
        group = expand(_Prompts(tokenizer).take(1)[0], 0, 2)
        with pytest.raises(RolloutLoopBlocked, match=r"test_producer.py:\d+ in blocks_the_loop"):
            pool.run(pool.generate_group(group, step=0, version=0))
        assert time.monotonic() - start < 4
    finally:
        pool.shutdown()  # what needs no loop: the engines stop, their actors end
    assert time.monotonic() - start < 6  # without waiting for the blocked call
    for url in pool.engines.urls:  # nothing serves there any more
        with pytest.raises(OSError):
            urllib.request.urlopen(f"{url}/health", timeout=5)


def test_an_async_producer_whose_loop_is_blocked_ends_the_batch_naming_the_line(
    ray_session, tiny_qwen3_dir, tokenizer
):
    pool = _pool(
        tiny_qwen3_dir, tokenizer, generate_fn="test_producer.blocks_the_loop", mode="async", batch_size=1
    )
    pool.watch.blocked_s = 1.0
    producer = Producer(pool.cfg, pool, _Prompts(tokenizer), RolloutBuffer(), version=0, last_step=3)
    start = time.monotonic()
    try:
        with pytest.raises(RolloutLoopBlocked, match=r"in blocks_the_loop"):
            producer.batch(0, train_version=0)  # the run-ahead loop's batch never fills
        assert time.monotonic() - start < 4
    finally:
        producer.close()  # no wait for the run-ahead loop, which cannot end
        pool.shutdown()
    assert time.monotonic() - start < 6
