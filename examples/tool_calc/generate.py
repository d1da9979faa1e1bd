"""The generate_fn (`rollout.generate_fn=examples.tool_calc.generate.generate`): the model may call
the calculator by writing "?", the sandboxed calculator evaluates the question, its result comes
back as tokens (out of the loss), and the model writes the answer.

    prompt      4 2 7 + 9 3 1 =
    model       ?                  one turn of up to n + 2 tokens, ended by "?" (the call) or EOS
    calculator  1 3 5 8 =          the question's value, n + 1 digits, then "=" (loss mask 0)
    model       1 3 5 8 <eos>      the answer: n + 2 tokens at most

A turn that ends without "?" is a direct answer: no tool call (the reward gives 0 for that).
A calculator call that fails in the sandbox (time, memory, network, crash) fails the sample,
with the reason in `sample.status_reason`.
"""

from __future__ import annotations

from pathlib import Path

from examples.tool_calc.data import operand_digits, question, render_result
from rlx.agent import Sandbox, append_tool_text, call_tool, finish, last_model_turn, model_turn

CALL = "?"  # the word (one token) that calls the calculator on the question
CALCULATOR = str(Path(__file__).with_name("calculator.py"))
# One sandbox for the run: a call normally takes ~10 ms; the limits only stop a broken tool.
SANDBOX = Sandbox(time_limit_s=5.0, memory_limit_mb=256)


async def generate(ctx, sample, sampling_params):
    """One sample: call turn, calculator, answer turn (see the module docstring)."""
    expression = question(str(sample.prompt))
    num_digits = operand_digits(expression)
    call_id = ctx.tokenizer.convert_tokens_to_ids(CALL)
    ids = await model_turn(
        ctx, sample, sampling_params, max_new_tokens=num_digits + 2, stop_token_ids=[call_id]
    )
    if not ids or ids[-1] != call_id:
        sample.metadata["answer"] = ctx.tokenizer.decode(ids, skip_special_tokens=True)
        return finish(ctx, sample)
    result = await call_tool(SANDBOX, sample, "calculator", [CALCULATOR], expression)
    if not result.ok:
        return finish(ctx, sample)
    text = result.output.strip()
    shown = render_result(int(text), num_digits) if text.lstrip("-").isdigit() else text
    if append_tool_text(ctx, sample, f"{shown} =", sampling_params):
        await model_turn(ctx, sample, sampling_params, max_new_tokens=num_digits + 2)
    sample.metadata["answer"] = ctx.tokenizer.decode(last_model_turn(sample), skip_special_tokens=True)
    return finish(ctx, sample)
