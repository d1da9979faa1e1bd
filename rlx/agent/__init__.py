"""Agents and tools for `rollout.generate_fn`: a sandbox that runs tools in a subprocess with a
time limit, a memory limit and no network (`rlx.agent.sandbox`), and the multi-turn helpers a
generate_fn strings together (`rlx.agent.turns`). examples/tool_calc is a complete task."""

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
    "append_tool_text",
    "append_tool_tokens",
    "call_tool",
    "finish",
    "last_model_turn",
    "model_turn",
    "session_key",
]
