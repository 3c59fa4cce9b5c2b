"""Streaming tool-call parsers: generated text in, (content, tool call deltas) out.

    parser = HermesParser()                 # one per choice of a request
    content, deltas = parser.add(text)      # for each piece of generated text
    content, deltas = parser.finish()       # when the choice ends

The formats (chosen per model family by ``engine.tools.parser_for``):

    HermesParser     Qwen2.5, Hermes: ``<tool_call>{"name": .., "arguments": {..}}</tool_call>``, any
                     number, text around them is content
    Llama3JsonParser Llama 3.x: the whole reply is ``{"name": .., "parameters": {..}}`` (optional
                     ``<|python_tag|>`` first; several calls separated by ";")
    MistralParser    Mistral: ``[TOOL_CALLS][{"name": .., "arguments": {..}}, ...]``, and the newer
                     (tokenizer v11+) ``[TOOL_CALLS]name[ARGS]{..}`` / ``[TOOL_CALLS]name{..}``
    RequiredParser   tool_choice "required" (constrained output): ``[{"name": .., "parameters": {..}}, ...]``
    NamedParser      a named tool_choice (constrained output): the reply is the arguments object

Text that might begin a call is held back until it is known (a partial ``<tool_call>``, a
reply that opens with "{"), so no text is streamed as content that later turns out to be a
call; text that turns out not to be one (invalid JSON, no name) is released as content.
Whitespace next to calls is dropped (content "" becomes None in a reply with calls); a reply
without calls keeps its text unchanged. Each piece of text is scanned a bounded number of
times: linear in the length of the reply.
"""
from __future__ import annotations

from collections.abc import Callable

from .calls import ToolCallDelta, new_call_id, new_mistral_call_id
from .json_call import CallScanner

__all__ = ["HermesParser", "Llama3JsonParser", "MistralParser", "NamedParser", "RequiredParser", "ToolParser"]

Output = tuple[str, list[ToolCallDelta]]


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of text that is a proper beginning of marker."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Shared state: content with whitespace held next to calls, and call numbering."""

    markers: tuple[str, ...] = ()  # texts that must survive decoding (kept when they are special tokens)
    default_make_id = staticmethod(new_call_id)

    def __init__(self, make_id: Callable[[], str] | None = None):
        self.make_id = make_id or self.default_make_id
        self.num_calls = 0
        self._content: list[str] = []
        self._deltas: list[ToolCallDelta] = []
        self._held_space = ""  # trailing whitespace: dropped next to a call, kept otherwise
        self._after_call = False  # the next content starts right after a call: its leading space goes

    def _next_index(self) -> int:
        self.num_calls += 1
        return self.num_calls - 1

    def _new_scanner(self) -> CallScanner:
        return CallScanner(self._next_index, self.make_id)

    def _emit(self, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
        if not text:
            return
        self._after_call = False
        body = text.rstrip()
        if body:
            self._content.append(self._held_space + body)
            self._held_space = text[len(body):]
        else:
            self._held_space += text

    def _call_starts(self) -> None:
        self._held_space = ""
        self._after_call = True

    def _take(self) -> Output:
        content, deltas = "".join(self._content), self._deltas
        self._content, self._deltas = [], []
        return content, deltas

    def add(self, text: str) -> Output:
        raise NotImplementedError

    def finish(self) -> Output:
        raise NotImplementedError

    def _finish_content(self) -> Output:
        if self.num_calls == 0:
            self._content.append(self._held_space)
        self._held_space = ""
        return self._take()


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    markers = (START, END)

    def __init__(self, make_id: Callable[[], str] | None = None):
        super().__init__(make_id)
        self._buffer = ""
        self._scanner: CallScanner | None = None  # set inside <tool_call> ... </tool_call>
        self._body: list[str] = []  # the raw text inside the tags, for a call that is no call

    def add(self, text: str) -> Output:
        buffer = self._buffer + text
        while True:
            marker = self.START if self._scanner is None else self.END
            k = buffer.find(marker)
            if k < 0:
                held = _partial_suffix(buffer, marker)
                self._consume(buffer[:len(buffer) - held])
                self._buffer = buffer[len(buffer) - held:]
                return self._take()
            self._consume(buffer[:k])
            buffer = buffer[k + len(marker):]
            if self._scanner is None:
                self._scanner = self._new_scanner()
            else:
                self._end_call()

    def _consume(self, text: str) -> None:
        if self._scanner is None:
            self._emit(text)
        elif text:
            self._body.append(text)
            deltas, _ = self._scanner.feed(text)  # text after the object (before </tool_call>) is dropped
            self._deltas.extend(deltas)

    def _end_call(self, is_closed: bool = True) -> None:
        scanner, self._scanner = self._scanner, None
        body, self._body = "".join(self._body), []
        deltas = scanner.finish()
        if deltas is None:  # not a call: its text is content
            self._emit(self.START + body + (self.END if is_closed else ""))
        else:
            self._call_starts()
            self._deltas.extend(deltas)

    def finish(self) -> Output:
        buffer, self._buffer = self._buffer, ""
        self._consume(buffer)
        if self._scanner is not None:  # the reply ended inside a call
            self._end_call(is_closed=False)
        return self._finish_content()


class _ObjectEnd:
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


class _CallList:
    """JSON call objects between ``open`` and ``close`` (None: none), separated by ``separator``;
    with ``allow_named``, also Mistral's newer ``name[ARGS]{...}`` / ``name{...}`` (one call).

    ``feed`` -> the text after the list (None while it is open); ``failed`` holds the text
    of a list that turned out not to be calls (None: it was calls, or some calls were sent)."""

    WAIT_OPEN, IN_CALL, AFTER_CALL, DONE, NAME, ARGS = range(6)
    ARGS_TAG = "[ARGS]"

    def __init__(self, parser: ToolParser, open_: str | None, separator: str, close: str | None,
                 allow_named: bool = False):
        self.parser = parser
        self.allow_named = allow_named
        self.name = ""  # NAME: the function name so far
        self.object_end: _ObjectEnd | None = None  # ARGS: where the arguments close
        self.call_index = -1
        self.open, self.separator, self.close = open_, separator, close
        self.state = self.WAIT_OPEN if open_ else self.IN_CALL
        self.scanner: CallScanner | None = parser._new_scanner() if open_ is None else None
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
                self.scanner = self.parser._new_scanner()
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
                    self.parser._deltas.append(ToolCallDelta(self.call_index, arguments=piece))
                if end < 0:
                    return None
                self.parser._call_starts()
                self.state = self.DONE
                return text[end:]
            elif self.state == self.IN_CALL:
                deltas, rest = self.scanner.feed(text)
                self.parser._deltas.extend(deltas)
                if rest is None:
                    return None
                ended = self.scanner.finish()
                if ended is None:
                    return self._fail(rest)
                self.parser._call_starts()
                self.parser._deltas.extend(ended)
                text, self.state = rest, self.AFTER_CALL
            else:  # AFTER_CALL
                stripped = text.lstrip()
                if not stripped:
                    return None
                if stripped.startswith(self.separator):
                    text, self.state = stripped[len(self.separator):], self.IN_CALL
                    self.scanner = self.parser._new_scanner()
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
        cut = min(ends) if ends else len(name) - _partial_suffix(name, self.ARGS_TAG)
        candidate = name[:cut]
        if len(candidate) > _MAX_NAME or not all(ch in _NAME_CHARS for ch in candidate) or (ends and not candidate):
            return self._fail(text)  # not a name: all of it is content
        if not ends:
            self.name = name
            return None
        after = name[cut + len(self.ARGS_TAG):] if cut == tag else name[cut:]
        self.call_index = self.parser._next_index()
        self.parser._deltas.append(ToolCallDelta(self.call_index, self.parser.make_id(), candidate, ""))
        self.object_end = _ObjectEnd()
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
                self.parser._deltas.extend(ended)
        self.state = self.DONE


class _ListAfterMarker(ToolParser):
    """Content, then ``START`` followed by a call list (Mistral); or a list from the first character."""

    START: str | None = None

    def __init__(self, make_id: Callable[[], str] | None = None):
        super().__init__(make_id)
        self._buffer = ""
        self._list: _CallList | None = None

    def _new_list(self) -> _CallList:
        raise NotImplementedError

    def add(self, text: str) -> Output:
        buffer = self._buffer + text
        self._buffer = ""
        while buffer:
            if self._list is not None:
                rest = self._list.feed(buffer)
                if rest is None:
                    break
                self._end_list()
                buffer = rest
                continue
            if self.START is None:  # after the list: plain text
                self._emit(buffer)
                break
            k = buffer.find(self.START)
            if k < 0:
                held = _partial_suffix(buffer, self.START)
                self._emit(buffer[:len(buffer) - held])
                self._buffer = buffer[len(buffer) - held:]
                break
            self._emit(buffer[:k])
            buffer = buffer[k + len(self.START):]
            self._list = self._new_list()
        return self._take()

    def _end_list(self) -> None:
        call_list, self._list = self._list, None
        if call_list.failed is not None:
            self._emit((self.START or "") + call_list.failed)

    def finish(self) -> Output:
        buffer, self._buffer = self._buffer, ""
        if self._list is None:
            self._emit(buffer)
        else:
            self._list.finish()
            self._end_list()
        return self._finish_content()


class MistralParser(_ListAfterMarker):
    START = "[TOOL_CALLS]"
    markers = (START,)
    default_make_id = staticmethod(new_mistral_call_id)

    def _new_list(self) -> _CallList:
        return _CallList(self, "[", ",", "]", allow_named=True)


class RequiredParser(_ListAfterMarker):
    """tool_choice "required": the constrained reply is a JSON array of calls."""

    def __init__(self, make_id: Callable[[], str] | None = None):
        super().__init__(make_id)
        self._list = _CallList(self, "[", ",", "]")


class Llama3JsonParser(ToolParser):
    """The reply is calls when it opens with "{" (after whitespace and an optional <|python_tag|>)."""

    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG,)

    def __init__(self, make_id: Callable[[], str] | None = None):
        super().__init__(make_id)
        self._head = ""          # the reply's beginning, until its kind is known
        self._prefix = ""        # what came before the first "{"
        self._list: _CallList | None = None
        self._is_text = False    # decided: plain text

    def add(self, text: str) -> Output:
        if self._is_text:
            self._emit(text)
            return self._take()
        if self._list is None:
            head = self._head + text
            stripped = head.lstrip()
            if stripped.startswith(self.PYTHON_TAG):
                stripped = stripped[len(self.PYTHON_TAG):].lstrip()
            elif self.PYTHON_TAG.startswith(stripped):  # empty, or a partial tag: wait
                self._head = head
                return self._take()
            if not stripped:
                self._head = head
                return self._take()
            if not stripped.startswith("{"):
                self._is_text = True
                self._head = ""
                self._emit(head)
                return self._take()
            self._prefix = head[:len(head) - len(stripped)]  # space and tag before the "{"
            self._head = ""
            self._list = _CallList(self, None, ";", None)
            text = stripped
        rest = self._list.feed(text)
        if rest is not None:
            self._end_list(rest)
        return self._take()

    def _end_list(self, rest: str) -> None:
        failed = self._list.failed
        self._is_text = True
        if failed is not None:  # no call after all: the reply's text, as it came
            self._emit(self._prefix + failed)
        self._emit(rest)

    def finish(self) -> Output:
        if self._list is not None and not self._is_text:
            self._list.finish()
            self._end_list("")
        elif not self._is_text:
            self._emit(self._head)
        return self._finish_content()


class NamedParser(ToolParser):
    """A named tool_choice: the constrained reply is the arguments object of that one function."""

    def __init__(self, name: str, make_id: Callable[[], str] | None = None):
        super().__init__(make_id)
        self.name = name

    def add(self, text: str) -> Output:
        if self.num_calls == 0:
            text = text.lstrip()
            if not text:
                return self._take()
            self._deltas.append(ToolCallDelta(self._next_index(), self.make_id(), self.name, text))
        elif text:
            self._deltas.append(ToolCallDelta(0, arguments=text))
        return self._take()

    def finish(self) -> Output:
        if self.num_calls == 0:
            self._deltas.append(ToolCallDelta(self._next_index(), self.make_id(), self.name, "{}"))
        return self._take()
