"""Tool and environment messages in a chat model's own template, for a `rollout.generate_fn`.

A chat model ends its turn on an end-of-turn token (ChatML's `<|im_end|>`, Llama 3's `<|eot_id|>`);
what a conversation holds next is the template's text: the rest of the assistant message's closing
(ChatML's newline), the next message (a tool's result, or the environment's feedback as a user
message) and the header of the next assistant turn. `chat_message_ids` finds that text by
rendering a probe conversation with the tokenizer's chat template (a user message, an assistant
message holding a marker, the message, the generation prompt) and keeping what follows the marker:
the template's own rendering of an assistant turn that is followed by the message, which is what
the conversation becomes (Qwen3's template wraps only the last assistant message in an empty
`<think>` block: one followed by a tool message is plain). `append_chat_message` appends its ids
to a sample (loss mask 0), as verl's and slime's multi-turn rollouts extend a conversation token
by token: what the model generated is never re-rendered nor re-tokenised.

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
    ended on its end-of-turn token, as a stop), what follows it, else (a turn cut by its length
    limit, or ended on a stop string) the whole closing first. ValueError where the tokenizer has no chat template or
    the template does not write an assistant message's text as it is (the marker not found)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template; append the message's text with append_tool_text instead"
        )
    probe = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": MARK},
        {"role": role, "content": content},
    ]
    text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    if text.count(MARK) != 1:
        raise ValueError(
            f"the chat template does not write an assistant message followed by a {role!r} message as "
            "it is, so the message cannot be appended to what the model generated; build the message's "
            "text yourself and append it with append_tool_text"
        )
    follows = text[text.index(MARK) + len(MARK) :]  # ChatML: "<|im_end|>\n<|im_start|>tool\n…"
    ids = tokenizer(follows, add_special_tokens=False)["input_ids"]
    if ids and last_token == ids[0]:  # the turn ended on the template's end-of-turn token: not again
        ids = ids[1:]
    return ids


def append_chat_message(ctx, sample: Sample, content: str, params: dict, role: str = "tool") -> bool:
    """Append, out of the loss, a `role` message holding `content` as the chat template writes it
    after the sample's last model turn, and the next assistant turn's header (`chat_message_ids`),
    within the response budget: False, with the sample TRUNCATED and what fits appended, where it
    does not fit (as `append_tool_tokens`)."""
    if not sample.response_ids:
        raise ValueError("append_chat_message follows a model turn; the sample has none yet")
    ids = chat_message_ids(ctx.tokenizer, role, content, last_token=sample.response_ids[-1])
    return append_tool_tokens(ctx, sample, ids, params)
