"""Call lists: JSON call objects in a row (Mistral's and the constrained "required" arrays, Llama's
";"-separated calls), and Mistral's newer ``name[ARGS]{...}`` calls, read piece by piece.

A ``CallList`` belongs to one parser (engine.tools.parsers) and appends the deltas it finds to
the parser's output; each piece of text is scanned once.
"""
from __future__ import annotations

from .calls import ToolCallDelta
from .json_call import CallScanner

__all__ = ["CallList", "ObjectEnd", "partial_suffix"]


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper beginning of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ObjectEnd:
    """Finds where a JSON object that arrives in pieces closes (strings and escapes respected)."""

    __slots__ = ("depth", "in_string", "escaped", "is_invalid")

    def __init__(self):
        self.depth, self.in_string, self.escaped, self.is_invalid = 0, False, False, False

    def feed(self, text: str) -> int:
        """Characters of text up to and including the closing brace, or -1 (open, or invalid)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch == "{" or ch == "[":
                if self.depth == 0 and ch == "[":
                    self.is_invalid = True
                    return -1
                self.depth += 1
            elif ch == "}" or ch == "]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
            elif self.depth == 0 and not ch.isspace():
                self.is_invalid = True
                return -1
        return -1


_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_MAX_NAME = 64


class CallList:
    """JSON call objects between ``open`` and ``close`` (None: none), separated by ``separator``;
    with ``allow_named``, also Mistral's newer ``name[ARGS]{...}`` / ``name{...}`` (one call).

    ``feed`` -> the text after the list (None while it is open); ``failed`` holds the text
    of a list that turned out not to be calls (None: it was calls, or some calls were sent)."""

    WAIT_OPEN, IN_CALL, AFTER_CALL, DONE, NAME, ARGS = range(6)
    ARGS_TAG = "[ARGS]"

    def __init__(self, parser, open_: str | None, separator: str, close: str | None,
                 allow_named: bool = False):
        self.parser = parser
        self.allow_named = allow_named
        self.name = ""  # NAME: the function name so far
        self.object_end: ObjectEnd | None = None  # ARGS: where the arguments close
        self.call_index = -1
        self.open, self.separator, self.close = open_, separator, close
        self.state = self.WAIT_OPEN if open_ else self.IN_CALL
        self.scanner: CallScanner | None = parser.new_scanner() if open_ is None else None
        self.seen: list[str] = []  # raw text, for the content of a failed list
        self.failed: str | None = None

    def feed(self, text: str) -> str | None:
        self.seen.append(text)
        while text or self.state == self.DONE:
            if self.state == self.DONE:
                return text
            if self.state == self.WAIT_OPEN:
                stripped = text.lstrip()
                if not stripped:
                    return None
                if not stripped.startswith(self.open):
                    if self.allow_named and stripped[0] in _NAME_CHARS:
                        text, self.state = stripped, self.NAME
                        continue
                    return self._fail(stripped)
                text, self.state = stripped[len(self.open):], self.IN_CALL
                self.scanner = self.parser.new_scanner()
            elif self.state == self.NAME:
                text = self._feed_name(text)
                if text is None:
                    return None
                if self.state == self.DONE:
                    return text
            elif self.state == self.ARGS:
                end = self.object_end.feed(text)
                if self.object_end.is_invalid:
                    return self._fail(text)
                piece = text if end < 0 else text[:end]
                if piece:
                    self.parser.add_deltas([ToolCallDelta(self.call_index, arguments=piece)])
                if end < 0:
                    return None
                self.parser.mark_call()
                self.state = self.DONE
                return text[end:]
            elif self.state == self.IN_CALL:
                deltas, rest = self.scanner.feed(text)
                self.parser.add_deltas(deltas)
                if rest is None:
                    return None
                ended = self.scanner.finish()
                if ended is None:
                    return self._fail(rest)
                self.parser.mark_call()
                self.parser.add_deltas(ended)
                text, self.state = rest, self.AFTER_CALL
            else:  # AFTER_CALL
                stripped = text.lstrip()
                if not stripped:
                    return None
                if stripped.startswith(self.separator):
                    text, self.state = stripped[len(self.separator):], self.IN_CALL
                    self.scanner = self.parser.new_scanner()
                elif self.close is not None and stripped.startswith(self.close):
                    self.state = self.DONE
                    return stripped[len(self.close):]
                else:
                    self.state = self.DONE
                    return stripped
        return None

    def _feed_name(self, text: str) -> str | None:
        """NAME: letters up to "[ARGS]" or "{"; then the call is announced and ARGS begins.
        Returns the text after the name (None: wait for more; DONE state: not a name)."""
        name = self.name + text
        tag = name.find(self.ARGS_TAG)
        brace = name.find("{")
        ends = [k for k in (tag, brace) if k >= 0]
        cut = min(ends) if ends else len(name) - partial_suffix(name, self.ARGS_TAG)
        candidate = name[:cut]
        if len(candidate) > _MAX_NAME or not all(ch in _NAME_CHARS for ch in candidate) or (ends and not candidate):
            return self._fail(text)  # not a name: all of it is content
        if not ends:
            self.name = name
            return None
        after = name[cut + len(self.ARGS_TAG):] if cut == tag else name[cut:]
        self.call_index = self.parser.next_index()
        self.parser.add_deltas([ToolCallDelta(self.call_index, self.parser.make_id(), candidate, "")])
        self.object_end = ObjectEnd()
        self.state = self.ARGS
        return after

    def _fail(self, rest: str) -> str:
        """Not calls after all: everything seen becomes content (calls already sent stay sent)."""
        self.state = self.DONE
        seen = "".join(self.seen)
        self.failed = seen[:len(seen) - len(rest)] if self.parser.num_calls == 0 else None
        return rest

    def finish(self) -> None:
        if self.state == self.NAME and self.parser.num_calls == 0:
            self.failed = "".join(self.seen)
        elif self.state == self.IN_CALL and self.scanner is not None:
            ended = self.scanner.finish()
            if ended is None:
                if self.parser.num_calls == 0:
                    self.failed = "".join(self.seen)
            else:
                self.parser.add_deltas(ended)
        self.state = self.DONE
