"""Tool and environment messages in a chat model's own template, for a `rollout.generate_fn`.

A chat model ends its turn on an end-of-turn token (ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`);
what a conversation holds next is the template's text: the rest of the assistant message's closing
(ChatML's newline), the next message (a tool's result, or the environment's feedback as a user
message) and the header of the next assistant turn. `chat_message_ids` finds that text by
rendering a probe conversation with the tokenizer's chat template, without the message and with it
and the generation prompt, and keeping what the second adds; so any template works that renders
earlier messages the same whatever follows them. `append_chat_message` appends its ids to a sample
(loss mask 0), as verl's and slime's multi-turn rollouts extend a conversation token by token:
what the model generated is never re-rendered nor re-tokenised.

    ids = await model_turn(ctx, sample, params, stop=["</tool_call>"])
    result = await call_tool(SANDBOX, sample, "search", ["search.py"], query)
    if result.ok and append_chat_message(ctx, sample, result.output, params, role="tool"):
        await model_turn(ctx, sample, params)
"""

from __future__ import annotations

from rlx.agent.turns import append_tool_tokens
from rlx.sample import Sample

MARK = "rlx-assistant-turn"  # the probe assistant message's text, found again in the rendering


def chat_message_ids(tokenizer, role: str, content: str, last_token: int | None = None) -> list[int]:
    """The ids that follow an assistant turn in `tokenizer`'s chat template: the rest of the turn's
    closing, a `role` message holding `content`, and the next assistant turn's header. `last_token`:
    the turn's last token; where it is the token the template's closing starts with (the turn
    ended on its end-of-turn token, as a stop), only what follows it comes first, else (a turn cut
    by its length limit) the whole closing. ValueError where the tokenizer has no chat template or
    the template renders the probe's earlier messages differently once the message follows."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template; append the message's text with append_tool_text instead"
        )
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": MARK}]
    before = tokenizer.apply_chat_template(probe, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*probe, {"role": role, "content": content}], tokenize=False, add_generation_prompt=True
    )
    if not after.startswith(before) or MARK not in before:
        raise ValueError(
            f"the chat template renders a conversation's earlier messages differently once a {role!r} "
            "message follows, so the message cannot be appended to what the model generated; build the "
            "message's text yourself and append it with append_tool_text"
        )
    closing = before[before.rindex(MARK) + len(MARK) :]  # ChatML: "<|im_end|>\n"
    if last_token is not None:  # the turn's own end-of-turn token, where it has one: not again
        ended = tokenizer.decode([last_token], skip_special_tokens=False)
        at = closing.find(ended) if ended else -1
        if at >= 0 and not closing[:at].strip():
            closing = closing[at + len(ended) :]
    return tokenizer(closing + after[len(before) :], add_special_tokens=False)["input_ids"]


def append_chat_message(ctx, sample: Sample, content: str, params: dict, role: str = "tool") -> bool:
    """Append, out of the loss, a `role` message holding `content` as the chat template writes it
    after the sample's last model turn, and the next assistant turn's header (`chat_message_ids`),
    within the response budget: False, with the sample TRUNCATED and what fits appended, where it
    does not fit (as `append_tool_tokens`)."""
    if not sample.response_ids:
        raise ValueError("append_chat_message follows a model turn; the sample has none yet")
    ids = chat_message_ids(ctx.tokenizer, role, content, last_token=sample.response_ids[-1])
    return append_tool_tokens(ctx, sample, ids, params)
