"""Multi-turn samples built by rlx.agent's helpers and the tool_calc generate_fn, against responses,
loss masks and logprobs written out by hand. A scripted engine stands in for the model (no
engine, no Ray); the context is the real GenerateContext and the calculator really runs in the
sandbox. CPU, about a second."""

from __future__ import annotations

import asyncio

import pytest
from transformers import PreTrainedTokenizerFast

from examples.tool_calc import generate as tool_calc
from examples.tool_calc.reward import answer_reward
from rlx.agent import ROUTING_KEY_HEADER, Sandbox, append_tool_tokens, call_tool, last_model_turn, model_turn
from rlx.agent.sandbox import close_sandboxes
from rlx.models.tiny import write_word_tokenizer
from rlx.rollout.client import Reply
from rlx.rollout.config import RolloutConfig
from rlx.rollout.generate import GenerateContext, read_output, stop_ids
from rlx.sample import Sample, Status

# ids in the tiny vocabulary: <pad> 0, <eos> 1, digit d is d + 2, "=" 12, "+" 13, "-" 14, "?" 15
EOS, EQ, PLUS, CALL = 1, 12, 13, 15


def d(*digits: int) -> list[int]:
    return [x + 2 for x in digits]


class ScriptedEngine:
    """The engine side of `ctx.client`: answers each POST /generate with the next scripted turn
    (token ids, their logprobs, finish reason) and records what it was asked. A turn that fills
    the request's max_new_tokens finishes "length" whatever its last token, as SGLang (and rlx's
    engine) check the length limit first."""

    base_url = "http://scripted"

    def __init__(self, *turns: tuple[list[int], list[float], str]):
        self.turns, self.requests = list(turns), []

    async def generate(self, input_ids, sampling_params, *, headers=None):  # EngineClient.generate
        payload = {"input_ids": input_ids, "sampling_params": sampling_params}
        return (await self._request("POST", "/generate", json=payload, headers=headers)).body

    async def _request(self, method, path, *, json, headers=None):
        assert (method, path) == ("POST", "/generate")
        self.requests.append(
            {"input_ids": json["input_ids"], "params": json["sampling_params"], "headers": headers}
        )
        ids, logprobs, finish, *text = self.turns.pop(0)  # a turn may script its text
        if len(ids) >= json["sampling_params"]["max_new_tokens"] and finish != "abort":
            finish = "length"
        pairs = [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)]
        meta = {"output_token_logprobs": pairs, "finish_reason": {"type": finish}}
        return Reply(200, {"output_ids": ids, "meta_info": meta} | ({"text": text[0]} if text else {}))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    write_word_tokenizer(path)
    return PreTrainedTokenizerFast.from_pretrained(str(path))


def context(tokenizer, engine) -> GenerateContext:
    cfg = RolloutConfig(max_response_len=15)
    return GenerateContext(engine, tokenizer, cfg, version=3, stop_ids=stop_ids(cfg, tokenizer))


def prompt(tokenizer, text="4 2 7 + 9 3 1 =", label="1 3 5 8") -> Sample:
    return Sample(prompt=text, prompt_ids=tokenizer(text)["input_ids"], label=label, metadata={})


PARAMS = {"max_new_tokens": 15, "temperature": 1.0, "stop_token_ids": [], "sampling_seed": 7}


def run_on_a_loop(coro) -> object:
    """`asyncio.run(coro)`, the sandboxes' fork servers closed before the loop closes, as the
    rollout pool closes them (`close_sandboxes`; Python 3.12 reports a leaked one at exit)."""

    async def then_close():
        try:
            return await coro
        finally:
            await close_sandboxes()

    return asyncio.run(then_close())


def test_call_calculator_answer_builds_the_hand_written_sample(tokenizer):
    engine = ScriptedEngine(
        ([CALL], [-0.5], "stop"),  # the call
        ([*d(1, 3, 5, 8), EOS], [-0.1, -0.2, -0.3, -0.4, -0.05], "stop"),  # the answer
    )
    s = prompt(tokenizer)
    run_on_a_loop(tool_calc.generate(context(tokenizer, engine), s, dict(PARAMS)))

    # the answer's EOS is its turn's 5th and last allowed token: the engine says "length", and
    # the sample is COMPLETED all the same (it ended), so the answer earns the end's share
    assert engine.requests[1]["params"]["max_new_tokens"] == 5
    tool = [*d(1, 3, 5, 8), EQ]  # the calculator's 1358, written "1 3 5 8 ="
    assert s.response_ids == [CALL, *tool, *d(1, 3, 5, 8), EOS]
    assert s.loss_mask == [1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]
    assert s.rollout_logprobs == [-0.5, 0, 0, 0, 0, 0, -0.1, -0.2, -0.3, -0.4, -0.05]
    assert s.token_versions == [3] * 11 and s.version == 3
    assert s.status is Status.COMPLETED and s.status_reason == ""
    assert s.response_text == "? 1 3 5 8 = 1 3 5 8" and s.metadata["answer"] == "1 3 5 8"
    assert [c["output"] for c in s.metadata["tool_calls"]] == ["1358\n"]
    assert answer_reward(s) == 1.0

    first, second = engine.requests
    assert first["input_ids"] == s.prompt_ids
    assert first["params"]["max_new_tokens"] == 5 and first["params"]["stop_token_ids"] == [CALL]
    # the second turn sees the call and the tool output, as token ids, never re-tokenised
    assert second["input_ids"] == s.prompt_ids + [CALL, *tool]
    assert second["params"]["max_new_tokens"] == 5 and second["params"]["stop_token_ids"] == []
    assert second["params"]["sampling_seed"] != 7  # a fresh draw for the later turn
    keys = {r["headers"][ROUTING_KEY_HEADER] for r in engine.requests}
    assert keys == {s.metadata["session"]}  # one routing key for the whole conversation


def test_a_wrong_copy_gets_partial_credit_and_a_direct_answer_none(tokenizer):
    engine = ScriptedEngine(([4, CALL], [-1.0, -0.5], "stop"), ([*d(1, 3, 0, 8), EOS], [-0.1] * 5, "stop"))
    s = prompt(tokenizer)
    run_on_a_loop(tool_calc.generate(context(tokenizer, engine), s, dict(PARAMS)))
    assert s.loss_mask == [1, 1, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1]  # a word before the call is trained too
    assert answer_reward(s) == pytest.approx(4 / 5)  # 3 of 4 digits, and it ended

    # no "?": the first turn is the answer; no tool ran, so no reward whatever it says
    engine = ScriptedEngine(([*d(1, 3, 5, 8), EOS], [-0.2] * 5, "stop"))
    s = prompt(tokenizer)
    run_on_a_loop(tool_calc.generate(context(tokenizer, engine), s, dict(PARAMS)))
    assert s.loss_mask == [1] * 5 and len(engine.requests) == 1 and "tool_calls" not in s.metadata
    assert s.metadata["answer"] == "1 3 5 8" and answer_reward(s) == 0.0


def test_tool_output_and_turns_stay_within_the_response_budget(tokenizer):
    # budget 8: call (1) + tool (5) leaves 2 for the answer, which is cut there
    engine = ScriptedEngine(([CALL], [-0.5], "stop"), (d(1, 3), [-0.1, -0.2], "length"))
    s = prompt(tokenizer)
    run_on_a_loop(tool_calc.generate(context(tokenizer, engine), s, dict(PARAMS, max_new_tokens=8)))
    assert engine.requests[1]["params"]["max_new_tokens"] == 2
    assert s.loss_mask == [1, 0, 0, 0, 0, 0, 1, 1] and s.status is Status.TRUNCATED
    assert answer_reward(s) == pytest.approx(2 / 5)

    # budget 4: the tool output itself does not fit; what fits is kept, no answer turn
    engine = ScriptedEngine(([CALL], [-0.5], "stop"))
    s = prompt(tokenizer)
    run_on_a_loop(tool_calc.generate(context(tokenizer, engine), s, dict(PARAMS, max_new_tokens=4)))
    assert s.response_ids == [CALL, *d(1, 3, 5)] and s.loss_mask == [1, 0, 0, 0]
    assert s.status is Status.TRUNCATED and "overran the response budget (3 left)" in s.status_reason
    assert len(engine.requests) == 1 and last_model_turn(s) == []


def test_helpers_alternate_model_and_tool_turns(tokenizer, tmp_path):
    # three turns, two tools: the mask is 1 exactly on what the engine generated
    tool = tmp_path / "echo.py"
    tool.write_text("import sys\nprint(sys.stdin.read()[::-1])\n")
    engine = ScriptedEngine(
        ([5, 6], [-1.0, -2.0], "stop"), ([7], [-3.0], "stop"), ([8, EOS], [-4.0, -0.5], "stop")
    )
    ctx, s, sandbox = context(tokenizer, engine), prompt(tokenizer), Sandbox(time_limit_s=10)

    async def conversation():
        for _ in range(2):
            await model_turn(ctx, s, PARAMS, max_new_tokens=2)
            result = await call_tool(sandbox, s, "echo", [str(tool)], stdin="1 2")
            assert result.ok and result.output == "2 1\n"
            append_tool_tokens(ctx, s, tokenizer(result.output)["input_ids"], PARAMS)
        return await model_turn(ctx, s, PARAMS)

    assert run_on_a_loop(conversation()) == [8, EOS]
    assert s.response_ids == [5, 6, *d(2, 1), 7, *d(2, 1), 8, EOS]
    assert s.loss_mask == [1, 1, 0, 0, 1, 0, 0, 1, 1]
    assert s.rollout_logprobs == [-1.0, -2.0, 0, 0, -3.0, 0, 0, -4.0, -0.5]
    assert [r["params"]["max_new_tokens"] for r in engine.requests] == [2, 2, 15 - 7]
    assert last_model_turn(s) == [8, EOS] and s.status is Status.COMPLETED


def answer(ids: list[int], finish: str) -> dict:
    pairs = [[-0.5, t, None] for t in ids]
    return {
        "output_ids": ids,
        "meta_info": {"output_token_logprobs": pairs, "finish_reason": {"type": finish}},
    }


def test_an_answer_ending_on_a_stop_token_at_its_length_limit_is_completed():
    stops = {EOS, CALL}
    assert read_output(answer([5, EOS], "length"), 0, stops).status is Status.COMPLETED
    assert read_output(answer([5, CALL], "length"), 0, stops).status is Status.COMPLETED
    assert read_output(answer([5, 6], "length"), 0, stops).status is Status.TRUNCATED  # cut short
    assert read_output(answer([5, EOS], "length"), 0).status is Status.TRUNCATED  # no stop ids known
    assert read_output(answer([5, 6], "stop"), 0, stops).status is Status.COMPLETED  # a stop string
    assert read_output(answer([], "length"), 0, stops).status is Status.TRUNCATED
    assert read_output(answer([EOS], "abort"), 0, stops).status is Status.ABORTED


def test_an_answer_whose_text_holds_a_stop_string_at_its_length_limit_is_completed():
    """SGLang matches stop strings after the length limit too: text holding one, with "length",
    ended on its last allowed token (an earlier match would have stopped it earlier)."""
    cut = answer([5, 6], "length") | {"text": "4 </call>"}
    assert read_output(cut, 0, stop_strings=["</call>"]).status is Status.COMPLETED
    assert read_output(cut, 0, stop_strings=["</answer>", "call>"]).status is Status.COMPLETED
    assert read_output(cut, 0, stop_strings=["</answer>"]).status is Status.TRUNCATED
    assert read_output(cut, 0).status is Status.TRUNCATED  # no stop strings known
    assert (
        read_output(answer([5, 6], "length"), 0, stop_strings=["</call>"]).status is Status.TRUNCATED
    )  # no text


def test_a_turn_with_stop_strings_sends_them_and_judges_its_end_by_them(tokenizer):
    """model_turn's `stop` joins the run's `stop` in the request; a turn cut at its limit whose
    text holds one of either (the run's from `rollout.stop`) is COMPLETED, else TRUNCATED."""
    for text, status in (("1 ?", Status.COMPLETED), ("1 =", Status.COMPLETED), ("1 2", Status.TRUNCATED)):
        engine = ScriptedEngine(([5, 6], [-0.1, -0.2], "stop", text))
        cfg = RolloutConfig(max_response_len=15, stop=["="])
        ctx = GenerateContext(engine, tokenizer, cfg, version=3, stop_ids=stop_ids(cfg, tokenizer))
        s = prompt(tokenizer)
        params = dict(PARAMS, stop=["="])  # the run's sampling parameters carry rollout.stop
        ids = run_on_a_loop(model_turn(ctx, s, params, max_new_tokens=2, stop=["?"]))
        assert ids == [5, 6] and s.status is status, (text, s.status)
        assert engine.requests[0]["params"]["stop"] == ["=", "?"]
    for text, status in (("1 </a>", Status.COMPLETED), ("1 </", Status.TRUNCATED)):  # one string each
        engine = ScriptedEngine(([5, 6], [-0.1, -0.2], "stop", text))
        ctx = GenerateContext(engine, tokenizer, RolloutConfig(max_response_len=15), version=3)
        s = prompt(tokenizer)
        run_on_a_loop(model_turn(ctx, s, dict(PARAMS, stop="</b>"), max_new_tokens=2, stop="</a>"))
        assert s.status is status and engine.requests[0]["params"]["stop"] == ["</b>", "</a>"]
    assert RolloutConfig(stop=["</a>"]).sampling_params()["stop"] == ["</a>"]
    assert "stop" not in RolloutConfig().sampling_params()  # none: requests as before


def test_a_turn_that_ignores_eos_ends_truncated_on_any_token(tokenizer):
    """With ignore_eos the engine stops on neither EOS nor stop tokens: one as the last allowed
    token is chance, and the turn was cut by its limit."""
    for ignore in (False, True):
        engine = ScriptedEngine(([5, 6, CALL], [-0.1] * 3, "length"))
        s = prompt(tokenizer)
        params = dict(PARAMS, ignore_eos=ignore)
        run_on_a_loop(
            model_turn(context(tokenizer, engine), s, params, max_new_tokens=3, stop_token_ids=[CALL])
        )
        assert s.status is (Status.TRUNCATED if ignore else Status.COMPLETED)


def test_stop_ids_gather_the_checkpoints_eos_as_the_engine_does(tokenizer, tmp_path):
    import json

    cfg = RolloutConfig(stop_token_ids=[CALL])
    assert stop_ids(cfg, tokenizer) == {EOS, CALL}  # the tokenizer's EOS and the run's stop ids
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [8, 9]}))
    assert stop_ids(cfg, tokenizer, str(tmp_path)) == {EOS, CALL, 7, 8, 9}
    (tmp_path / "generation_config.json").write_text("{not json")
    assert stop_ids(cfg, tokenizer, str(tmp_path)) == {EOS, CALL, 7}  # the engine names a broken file
    assert stop_ids(RolloutConfig(ignore_eos=True, stop_token_ids=[CALL]), tokenizer, str(tmp_path)) == set()


def test_a_batchs_tool_calls_are_counted_in_its_rollout_metrics(tokenizer):
    """`call_tool`'s records become rollout/tool_calls_mean, tool_failed_frac and tool_seconds_mean;
    a batch without tool calls has none of them."""
    from rlx.rollout.group import rollout_metrics

    calls = [
        [{"ok": True, "seconds": 0.01}],
        [{"ok": True, "seconds": 0.03}, {"ok": False, "seconds": 5.0}],
        [],
    ]
    samples = [Sample(prompt="1", prompt_ids=[2], metadata={"tool_calls": c}) for c in calls]
    metrics = rollout_metrics(samples, elapsed=1.0)
    assert metrics["rollout/tool_calls_mean"] == 3 / 3
    assert metrics["rollout/tool_failed_frac"] == 1 / 3
    assert metrics["rollout/tool_seconds_mean"] == pytest.approx(5.04 / 3)
    assert not any("tool" in k for k in rollout_metrics([Sample(prompt="1", prompt_ids=[2])], 1.0))
