"""One JSON call object, ``{"name": ..., "arguments" | "parameters": {...}}``, read piece by piece.

``CallScanner.feed(text)`` scans the new text once (JSON strings, escapes and nesting depth),
and the name prefix is matched once, when the first nested value opens, so a call costs
linear time however it is split. As soon as the text so far reads
``{"name": "<name>", "arguments": {`` (the order every template shows the model) the call is
announced (a delta with id and name) and the arguments' raw JSON text streams from then on,
exactly as the model wrote it, up to the brace that closes them. A call written in another
order is read whole when it ends (``finish``) and sent in one delta with its arguments
re-serialized; text that is no call at all (invalid JSON, no name) makes ``finish`` return
None and the caller shows it as content.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable

from .calls import ToolCallDelta

__all__ = ["CallScanner"]

# {"name": "<name>", "arguments": {   (or "parameters", Llama 3.x's key)
_ANNOUNCE = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')
ARGUMENT_KEYS = ("arguments", "parameters")


class CallScanner:
    """Reads one call object. ``feed`` -> (deltas, leftover); leftover is the text after the
    object's closing brace (None while the object is open)."""

    __slots__ = ("_pieces", "_length", "_depth", "_in_string", "_escaped", "_started", "is_done", "_nested_at",
                 "_args_start", "_args_end", "_emitted", "_next_index", "_make_id", "index", "is_invalid")

    def __init__(self, next_index: Callable[[], int], make_id: Callable[[], str]):
        self._pieces: list[str] = []
        self._length = 0          # characters fed so far
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._started = False     # the opening brace was seen
        self.is_done = False      # the closing brace was seen
        self.is_invalid = False   # the text does not start with "{": no call
        self._nested_at = -1      # offset of the first value nested in the object (its "{" or "[")
        self._args_start = -1     # offset of the arguments' "{" once announced
        self._args_end = -1       # offset just past the arguments' closing brace
        self._emitted = 0         # arguments text sent up to this offset
        self._next_index = next_index
        self._make_id = make_id
        self.index: int | None = None  # set when announced

    @property
    def is_announced(self) -> bool:
        return self.index is not None

    def text(self) -> str:
        return "".join(self._pieces)

    def feed(self, text: str) -> tuple[list[ToolCallDelta], str | None]:
        if self.is_done or self.is_invalid:
            return [], text
        start = self._length
        end = self._scan(text)  # characters of text that belong to the object
        own = text[:end]
        self._pieces.append(own)
        self._length += len(own)
        deltas: list[ToolCallDelta] = []
        # The prefix can only newly match when the first nested value opens (its "{" ends the match):
        # checked once, on the text before it.
        if not self.is_announced and start <= self._nested_at < self._length:
            whole = self.text()
            match = _ANNOUNCE.match(whole, 0, self._nested_at + 1)
            if match is not None and match.end() == self._nested_at + 1:
                name = _json_string(match.group(1))
                if name is not None:
                    self.index = self._next_index()
                    self._args_start = self._emitted = match.end() - 1
                    deltas.append(ToolCallDelta(self.index, self._make_id(), name, ""))
                    start = 0
                    own = whole
        if self.is_announced:
            limit = self._length if self._args_end < 0 else self._args_end
            if limit > self._emitted:
                piece = own[self._emitted - start:limit - start]
                if piece:
                    if deltas:
                        deltas[0].arguments = piece
                    else:
                        deltas.append(ToolCallDelta(self.index, arguments=piece))
                self._emitted = limit
        return deltas, (text[end:] if self.is_done or self.is_invalid else None)

    def _scan(self, text: str) -> int:
        """Advance the JSON state over text; returns how many characters belong to the object."""
        depth, in_string, escaped = self._depth, self._in_string, self._escaped
        base = self._length
        for i, ch in enumerate(text):
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                continue
            if ch == '"':
                in_string = True
            elif ch == "{" or ch == "[":
                if not self._started:
                    if ch == "[":
                        self.is_invalid = True
                        self._depth, self._in_string, self._escaped = depth, in_string, escaped
                        return i
                    self._started = True
                elif depth == 1 and self._nested_at < 0:
                    self._nested_at = base + i
                depth += 1
            elif ch == "}" or ch == "]":
                depth -= 1
                if depth == 1 and self._args_end < 0:  # the first value nested in the object closed
                    self._args_end = base + i + 1
                if depth <= 0:
                    self.is_done = True
                    self._depth, self._in_string, self._escaped = depth, in_string, escaped
                    return i + 1
            elif not self._started and not ch.isspace():
                self.is_invalid = True
                self._depth, self._in_string, self._escaped = depth, in_string, escaped
                return i
        self._depth, self._in_string, self._escaped = depth, in_string, escaped
        return len(text)

    def finish(self) -> list[ToolCallDelta] | None:
        """The call's last deltas when it ends; None when the text was no call (show it as content)."""
        if self.is_announced:
            return []
        try:
            value = json.loads(self.text())
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = next((value[k] for k in ARGUMENT_KEYS if k in value), {})
        if isinstance(arguments, str):  # arguments sent as a JSON string: its text is the JSON
            try:
                if isinstance(json.loads(arguments), dict):
                    self.index = self._next_index()
                    return [ToolCallDelta(self.index, self._make_id(), value["name"], arguments)]
            except (ValueError, RecursionError):
                pass
            return None
        if not isinstance(arguments, dict):
            return None
        self.index = self._next_index()
        return [ToolCallDelta(self.index, self._make_id(), value["name"], json.dumps(arguments, ensure_ascii=False))]


def _json_string(body: str) -> str | None:
    try:
        return json.loads('"' + body + '"')
    except ValueError:
        return None
