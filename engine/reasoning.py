"""Reasoning output: the text a model writes between ``<think>`` and ``</think>``, split off.

    markers = reasoning_markers(tokenizer.chat_template)  # ("<think>", "</think>") or None
    parser = ReasoningParser(markers, is_open)            # per choice of a chat reply
    reasoning, content = parser.add(text)                 # as the text streams; then parser.finish()

Parsing is on for chat requests whose template writes the markers (Qwen3, QwQ, SmolLM3, the
DeepSeek-R1 distills: the template's text has the closing tag), as llama.cpp's
``--reasoning-format auto`` decides from the template. A reply opens its reasoning with the
opening tag as its first non-blank text, or the prompt opened it already (``is_open``: the
rendered prompt ends in the opening tag and blanks, as Qwen3-2507 / DeepSeek-R1 templates
write ``<think>\\n`` into the generation prompt). Everything up to the closing tag is then
reasoning (all of it, if the reply ends first: max_tokens), everything after it content. An
opening tag later in the reply is content. Blanks before the opening tag go with the tag.

Byte-exact and incremental: the reply's text equals (blanks) + opening tag (unless the prompt
opened it) + reasoning + closing tag + content, and pieces joined equal the one-shot split.
Only what may still turn out to be a tag is held (a prefix of the opening tag at the start, a
prefix of the closing tag inside the reasoning: at most one tag's length), so each piece is
released once and work is linear in the reply's length. A tag split across tokens is found.

``ReasoningEventFilter`` runs the parser over a request's StreamEvents (one per choice):
``text`` becomes the content and ``reasoning_content`` the reasoning (None when the event has
none); the chat path (engine/chat.py) puts it before the tools' filter, so tool calls are
parsed from the content only.
"""
from __future__ import annotations

from .outputs import StreamEvent

__all__ = ["MARKERS", "ReasoningEventFilter", "ReasoningParser", "prompt_opens_reasoning", "reasoning_filter",
           "reasoning_markers"]

# (opening tag, closing tag) of the reasoning formats, in the order they are looked for.
MARKERS: tuple[tuple[str, str], ...] = (("<think>", "</think>"),)  # a tag's first character occurs once in it
_START, _REASONING, _CONTENT = 0, 1, 2
_PROMPT_TAIL_IDS = 16  # prompt ids decoded to see whether the prompt opened the reasoning


def reasoning_markers(chat_template: str | None) -> tuple[str, str] | None:
    """The markers of the template's reasoning format, or None when it writes none."""
    if not chat_template:
        return None
    for markers in MARKERS:
        if markers[1] in chat_template:
            return markers
    return None


def prompt_opens_reasoning(prompt_text: str, markers: tuple[str, str]) -> bool:
    """True when the prompt ends inside a reasoning block: its opening tag, then only blanks."""
    return prompt_text.rstrip().endswith(markers[0])


class ReasoningParser:
    """``add(text) -> (reasoning, content)``, ``finish() -> (reasoning, content)``: one reply's split."""

    __slots__ = ("open_tag", "close_tag", "state", "blanks", "held")

    def __init__(self, markers: tuple[str, str], is_open: bool = False):
        self.open_tag, self.close_tag = markers
        self.state = _REASONING if is_open else _START
        self.blanks = ""  # _START: the blanks before any other text
        self.held = ""  # _START: a prefix of the opening tag; _REASONING: of the closing tag

    def add(self, text: str) -> tuple[str, str]:
        if self.state == _CONTENT:
            return "", text
        if self.state == _START:
            return self._start(text)
        return self._reasoning(self.held + text)

    def _start(self, text: str) -> tuple[str, str]:
        if not self.held:  # only blanks so far: the new ones join them
            rest = text.lstrip()
            self.blanks += text[: len(text) - len(rest)]
            text = rest
            if not text:
                return "", ""
        text = self.held + text
        if text.startswith(self.open_tag):
            self.state, self.held, self.blanks = _REASONING, "", ""
            return self._reasoning(text[len(self.open_tag):])
        if self.open_tag.startswith(text):
            self.held = text
            return "", ""
        self.state, self.held = _CONTENT, ""
        content, self.blanks = self.blanks + text, ""
        return "", content

    def _reasoning(self, text: str) -> tuple[str, str]:
        end = text.find(self.close_tag)
        if end >= 0:
            self.state, self.held = _CONTENT, ""
            return text[:end], text[end + len(self.close_tag):]
        # A held prefix of the tag starts at the tag's first character, which occurs in the tag only
        # there (MARKERS): the last such character in the text's tail is the one place to look.
        tag = self.close_tag
        start = text.rfind(tag[0], max(0, len(text) - len(tag) + 1))
        if start >= 0 and tag.startswith(text[start:]):
            self.held = text[start:]
            return text[:start], ""
        self.held = ""
        return text, ""

    def finish(self) -> tuple[str, str]:
        """What is still held: reasoning inside the block, content before it opened."""
        held, self.held = self.held, ""
        if self.state == _REASONING:
            return held, ""
        content, self.blanks = self.blanks + held, ""
        return "", content


class ReasoningEventFilter:
    """Callable: StreamEvent (generated text) -> StreamEvent (content as ``text``, ``reasoning_content``)."""

    __slots__ = ("markers", "is_open", "parsers")

    def __init__(self, markers: tuple[str, str], is_open: bool):
        self.markers = markers
        self.is_open = is_open
        self.parsers: dict[int, ReasoningParser] = {}

    def __call__(self, event: StreamEvent) -> StreamEvent:
        parser = self.parsers.get(event.index)
        if parser is None:
            parser = self.parsers[event.index] = ReasoningParser(self.markers, self.is_open)
        if parser.state == _CONTENT:  # past the block (or there is none): the event as it is
            return event
        reasoning, content = parser.add(event.text) if event.text else ("", "")
        if event.finish_reason is not None:
            more_reasoning, more_content = parser.finish()
            reasoning += more_reasoning
            content += more_content
        return StreamEvent(event.request_id, content, event.token_ids, event.logprobs, event.finish_reason,
                           event.index, event.tool_calls, reasoning or None)


def reasoning_filter(tokenizer, prompt_ids: list[int], params) -> ReasoningEventFilter | None:
    """The filter of a chat request, or None: the template writes no reasoning, or the request is
    constrained (a grammar governs the whole reply, so it holds no reasoning block)."""
    markers = reasoning_markers(tokenizer.chat_template)
    if markers is None or (params is not None and params.has_constraint):
        return None
    tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_IDS:], skip_special_tokens=False)
    return ReasoningEventFilter(markers, prompt_opens_reasoning(tail, markers))
