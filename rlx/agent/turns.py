"""Multi-turn helpers for a `rollout.generate_fn` (contract: `rlx.rollout.generate`).

A tool-using generate_fn alternates model turns and tool turns on one sample:

    ids = await model_turn(ctx, sample, params, max_new_tokens=8, stop_token_ids=[call_id])
    result = await call_tool(sandbox, sample, "calculator", ["calc.py"], stdin=question)
    if result.ok and append_tool_text(ctx, sample, result.output, params):
        await model_turn(ctx, sample, params)
    return finish(ctx, sample)

Model tokens are appended as the engine returned them (trained, with their logprobs); tool
output as token ids with loss mask 0; nothing the model wrote is ever re-tokenised. The whole
response, tool output included, stays within `params["max_new_tokens"]` (the run's
`rollout.max_response_len`, or evaluation's own). Every request of one conversation carries the
same routing key, so that sglang-router's `manual` policy sends all its turns to one engine,
whose prefix cache then holds the conversation (see `ROUTING_KEY_HEADER`).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence

from rlx.agent.sandbox import Sandbox, ToolResult
from rlx.rollout.generate import strings
from rlx.sample import Sample, Status

# sglang-router (0.3.2 here) reads this header under `--policy manual`: a key's first request
# goes to a worker picked by `--assignment-mode`, every later one to the same worker. Other
# policies, and engines addressed directly, ignore it.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"


def session_key(sample: Sample) -> str:
    """The routing key of the sample's conversation: made on first use, kept in
    `sample.metadata["session"]` (so a partial rollout continued later keeps its engine)."""
    key = sample.metadata.get("session")
    if key is None:
        key = sample.metadata["session"] = uuid.uuid4().hex
    return key


def remaining(sample: Sample, params: dict) -> int:
    """Response tokens the sample may still add (model and tool tokens alike)."""
    return int(params["max_new_tokens"]) - sample.response_len


async def model_turn(
    ctx,
    sample: Sample,
    params: dict,
    *,
    max_new_tokens: int | None = None,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
) -> list[int]:
    """Generate one model turn continuing `sample.tokens` and append it (trained); the new ids.

    The turn stops at EOS, at one of `stop_token_ids` or of the strings `stop` (their tokens kept,
    as SGLang keeps them), after `max_new_tokens`, or when the response budget is spent;
    `sample.status` is then the turn's (COMPLETED on a stop, even on the turn's last allowed
    token; TRUNCATED on a length limit). With no budget left it generates nothing, sets
    TRUNCATED and returns []. A `sampling_seed` in `params` is varied by the response length, so
    each turn draws fresh randomness yet a seeded run repeats."""
    budget = remaining(sample, params)
    if budget <= 0:
        sample.status = Status.TRUNCATED
        return []
    turn = dict(params) | {
        "max_new_tokens": budget if max_new_tokens is None else min(max_new_tokens, budget)
    }
    if stop_token_ids:
        turn["stop_token_ids"] = [*params.get("stop_token_ids", []), *stop_token_ids]
    if stop:  # SGLang's `stop` is one string or several
        turn["stop"] = [*strings(params.get("stop")), *strings(stop)]
    if turn.get("sampling_seed") is not None and sample.response_len:
        key = f"{turn['sampling_seed']}/{sample.response_len}".encode()
        turn["sampling_seed"] = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
    out = await generate_in_session(ctx, sample.tokens, turn, session_key(sample))
    before = sample.response_len
    ctx.append_output(sample, out, stop_token_ids, ignore_eos=bool(turn.get("ignore_eos")), stop=stop)
    return sample.response_ids[before:]


async def generate_in_session(ctx, input_ids: list[int], params: dict, key: str) -> dict:
    """`ctx.generate` with the conversation's routing key in `ROUTING_KEY_HEADER`."""
    return await ctx.generate(input_ids, params, headers={ROUTING_KEY_HEADER: key})


async def call_tool(
    sandbox: Sandbox, sample: Sample, name: str, argv: list[str], stdin: str = ""
) -> ToolResult:
    """Run one tool call in `sandbox` and record it in `sample.metadata["tool_calls"]` (tool,
    input, output, ok, reason, seconds). A call that fails (time or memory limit, network refused,
    crash, non-zero exit) fails the sample: status FAILED, `status_reason` "tool NAME: REASON"."""
    result = await sandbox.run(argv, stdin)
    sample.metadata.setdefault("tool_calls", []).append(
        {
            "tool": name,
            "input": stdin,
            "output": result.output,
            "ok": result.ok,
            "reason": result.reason,
            "seconds": round(result.seconds, 4),
        }
    )
    if not result.ok:
        sample.status, sample.status_reason = Status.FAILED, f"tool {name}: {result.reason}"
    return result


def append_tool_tokens(ctx, sample: Sample, token_ids: list[int], params: dict) -> bool:
    """Append tool output ids (loss mask 0) within the response budget. False, with the sample
    TRUNCATED and only what fits appended, when they do not all fit."""
    room = remaining(sample, params)
    ctx.append_tokens(sample, list(token_ids)[: max(room, 0)])
    if len(token_ids) > room:
        sample.status = Status.TRUNCATED
        sample.status_reason = (
            f"tool output of {len(token_ids)} tokens overran the response budget ({room} left)"
        )
        return False
    return True


def append_tool_text(ctx, sample: Sample, text: str, params: dict) -> bool:
    """`append_tool_tokens` of `text` tokenised alone (no special tokens added)."""
    ids = ctx.tokenizer(text, add_special_tokens=False)["input_ids"]
    return append_tool_tokens(ctx, sample, ids, params)


def last_model_turn(sample: Sample) -> list[int]:
    """The ids of the model's last turn: the trained tokens after the last tool token ([] when
    the response ends with tool output)."""
    start = sample.response_len
    while start > 0 and sample.loss_mask[start - 1] == 1:
        start -= 1
    return sample.response_ids[start:]


def finish(ctx, sample: Sample) -> Sample:
    """Set `response_text` (the whole response, tool output included, special tokens skipped) and
    return the sample: the last step of a generate_fn."""
    sample.response_text = ctx.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
    return sample
