"""Streaming tool-call parsers: generated text in, (content, tool call deltas) out.

    parser = HermesParser()                 # one per choice of a request
    content, deltas = parser.add(text)      # for each piece of generated text
    content, deltas = parser.finish()       # when the choice ends

The formats (chosen per model family by ``parser_class_for`` below):

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

from .call_list import CallList, partial_suffix
from .calls import ToolCallDelta, new_call_id, new_mistral_call_id
from .json_call import CallScanner

__all__ = [
    "HermesParser", "Llama3JsonParser", "MistralParser", "NamedParser", "RequiredParser", "ToolParser",
    "parser_class_for",
]

Output = tuple[str, list[ToolCallDelta]]


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

    def next_index(self) -> int:
        self.num_calls += 1
        return self.num_calls - 1

    def new_scanner(self) -> CallScanner:
        return CallScanner(self.next_index, self.make_id)

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

    def add_deltas(self, deltas: list[ToolCallDelta]) -> None:
        self._deltas.extend(deltas)

    def mark_call(self) -> None:
        """A call ends here: whitespace held before it goes, and so does the space after it."""
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
                held = partial_suffix(buffer, marker)
                self._consume(buffer[:len(buffer) - held])
                self._buffer = buffer[len(buffer) - held:]
                return self._take()
            self._consume(buffer[:k])
            buffer = buffer[k + len(marker):]
            if self._scanner is None:
                self._scanner = self.new_scanner()
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
            self.mark_call()
            self._deltas.extend(deltas)

    def finish(self) -> Output:
        buffer, self._buffer = self._buffer, ""
        self._consume(buffer)
        if self._scanner is not None:  # the reply ended inside a call
            self._end_call(is_closed=False)
        return self._finish_content()


class _ListAfterMarker(ToolParser):
    """Content, then ``START`` followed by a call list (Mistral); or a list from the first character."""

    START: str | None = None

    def __init__(self, make_id: Callable[[], str] | None = None):
        super().__init__(make_id)
        self._buffer = ""
        self._list: CallList | None = None

    def _new_list(self) -> CallList:
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
                held = partial_suffix(buffer, self.START)
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

    def _new_list(self) -> CallList:
        return CallList(self, "[", ",", "]", allow_named=True)


class RequiredParser(_ListAfterMarker):
    """tool_choice "required": the constrained reply is a JSON array of calls."""

    def __init__(self, make_id: Callable[[], str] | None = None):
        super().__init__(make_id)
        self._list = CallList(self, "[", ",", "]")


class Llama3JsonParser(ToolParser):
    """The reply is calls when it opens with "{" (after whitespace and an optional <|python_tag|>)."""

    PYTHON_TAG = "<|python_tag|>"
    markers = (PYTHON_TAG,)

    def __init__(self, make_id: Callable[[], str] | None = None):
        super().__init__(make_id)
        self._head = ""          # the reply's beginning, until its kind is known
        self._prefix = ""        # what came before the first "{"
        self._list: CallList | None = None
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
            self._list = CallList(self, None, ";", None)
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
            self._deltas.append(ToolCallDelta(self.next_index(), self.make_id(), self.name, text))
        elif text:
            self._deltas.append(ToolCallDelta(0, arguments=text))
        return self._take()

    def finish(self) -> Output:
        if self.num_calls == 0:
            self._deltas.append(ToolCallDelta(self.next_index(), self.make_id(), self.name, "{}"))
        return self._take()


def parser_class_for(chat_template: str | None) -> type[ToolParser]:
    """The tool-call format of a model family, read off its chat template: ``<tool_call>`` (Qwen2.5,
    Hermes), ``[TOOL_CALLS]`` (Mistral), ``<|python_tag|>`` / ``<|start_header_id|>`` (Llama 3.x).
    Anything else (SmolLM2's template has no tool support) gets the Hermes format, the most
    common one among small open models."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return MistralParser
    if "<tool_call>" in template:
        return HermesParser
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return Llama3JsonParser
    return HermesParser
