"""Tool call ids, and the call types the engine returns (defined with the other outputs in
engine/outputs.py, re-exported here): whole calls (ToolCall) and streamed pieces (ToolCallDelta).
"""
from __future__ import annotations

import secrets
import string

from ..outputs import ToolCall, ToolCallDelta, fold_tool_calls

__all__ = ["ToolCall", "ToolCallDelta", "fold_tool_calls", "new_call_id", "new_mistral_call_id"]

_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style tool call id: "call_" + 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def new_mistral_call_id() -> str:
    """Mistral's templates require ids of exactly 9 letters and digits (as vLLM makes them)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))
