"""Agents and tools for `rollout.generate_fn`: a sandbox that runs tools in a subprocess with a
time limit, a memory limit and no network (`rlx.agent.sandbox`), and the multi-turn helpers a
generate_fn strings together (`rlx.agent.turns`; tool and user messages in a chat model's template:
`rlx.agent.chat`). examples/tool_calc is a complete task."""

from rlx.agent.chat import append_chat_message, chat_message_ids
from rlx.agent.sandbox import Sandbox, ToolResult
from rlx.agent.turns import (
    ROUTING_KEY_HEADER,
    append_tool_text,
    append_tool_tokens,
    call_tool,
    finish,
    last_model_turn,
    model_turn,
    session_key,
)

__all__ = [
    "ROUTING_KEY_HEADER",
    "Sandbox",
    "ToolResult",
    "append_chat_message",
    "append_tool_text",
    "append_tool_tokens",
    "call_tool",
    "chat_message_ids",
    "finish",
    "last_model_turn",
    "model_turn",
    "session_key",
]
