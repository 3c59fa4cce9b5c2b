"""Tool calls as the engine returns them: whole calls (ToolCall) and streamed pieces (ToolCallDelta).

A streamed call arrives as deltas of one ``index``: the first carries ``id`` and ``name`` (and
``arguments`` ""), later ones append to ``arguments``, the JSON text of the call's arguments.
``fold_tool_calls`` joins deltas back into calls, so a streamed request and its one-shot twin
give equal calls.
"""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass

__all__ = ["ToolCall", "ToolCallDelta", "fold_tool_calls", "new_call_id", "new_mistral_call_id"]

_ALNUM = string.ascii_letters + string.digits


def new_call_id() -> str:
    """An OpenAI-style tool call id: "call_" + 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


def new_mistral_call_id() -> str:
    """Mistral's templates require ids of exactly 9 letters and digits (as vLLM makes them)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(slots=True)
class ToolCall:
    """One call of a function tool; ``arguments`` is JSON text (OpenAI's format)."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolCallDelta:
    """A piece of the call number ``index`` of a reply: id and name in its first delta only."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_dict(self) -> dict:
        """OpenAI's ``delta.tool_calls`` entry."""
        out: dict = {"index": self.index}
        function: dict = {}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        function["arguments"] = self.arguments
        out["function"] = function
        return out


def fold_tool_calls(deltas) -> list[ToolCall]:
    """Join deltas (in stream order) into whole calls, ordered by index."""
    calls: dict[int, ToolCall] = {}
    pieces: dict[int, list[str]] = {}
    for delta in deltas:
        call = calls.get(delta.index)
        if call is None:
            call = calls[delta.index] = ToolCall(delta.id or "", delta.name or "", "")
            pieces[delta.index] = []
        pieces[delta.index].append(delta.arguments)
    for index, call in calls.items():
        call.arguments = "".join(pieces[index])
    return [calls[i] for i in sorted(calls)]
