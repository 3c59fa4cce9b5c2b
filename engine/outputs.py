"""What the engine gives back: StreamEvent per step, Completion per request, and the tool calls
they carry (ToolCall whole, ToolCallDelta streamed).

The engine's base types: they import nothing of the engine but engine/display.py (a leaf that
renders them, imported lazily for a repr). A streamed call arrives as deltas of one ``index``: the first
carries ``id`` and ``name`` (and ``arguments`` ""), later ones append to ``arguments``, the JSON
text of the call's arguments. ``fold_tool_calls`` joins deltas back into calls, so a streamed
request and its one-shot twin give equal calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ToolCall:
    """One call of a function tool; ``arguments`` is JSON text (OpenAI's format)."""

    id: str
    name: str
    arguments: str

    def to_dict(self) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}


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


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one token.

    ``token`` is the token's text; a piece that is not valid UTF-8 on its own (part of
    a multi-byte character) renders with U+FFFD for the invalid bytes, exactly as
    ``bytes.decode("utf-8", errors="replace")`` would. ``bytes`` always holds the raw bytes.
    ``top`` is a list of (token_id, token, bytes, logprob), best first. ``rank`` is vLLM's:
    the number of vocabulary ids whose logprob is at least this token's (1 = the most likely),
    so a sampled token outside ``top`` still says where it stood.
    """

    token_id: int
    token: str
    bytes: list[int]
    logprob: float
    top: list[tuple[int, str, list[int], float]] = field(default_factory=list)
    rank: int | None = None


@dataclass(slots=True)
class StreamEvent:
    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # None | "stop" | "length" | "abort" | "tool_calls"
    index: int = 0  # which choice (n > 1, batched prompts) the event belongs to
    tool_calls: list[ToolCallDelta] | None = None  # pieces of tool calls (chat with tools); text is then content
    reasoning_content: str | None = None  # new text of the reply's <think> block (engine/reasoning.py), never in text


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True, repr=False)
class Completion:
    """One request's result. Its repr shows text, finish reason and usage; ``to_html(show_ids=True)``
    and ``describe(show_ids=True)`` add the token ids (notebooks render ``_repr_html_``)."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprob | None] | None
    usage: Usage
    index: int = 0  # the choice's index (n > 1: prompt i's choices are i*n .. i*n+n-1)
    tool_calls: list[ToolCall] | None = None  # the calls of a chat with tools (text: the content around them)
    reasoning_content: str | None = None  # the text of the reply's <think> block; None: the reply had none

    def describe(self, show_ids: bool = False) -> str:
        from .display import describe_completion

        return describe_completion(self, show_ids)

    def to_html(self, show_ids: bool = False) -> str:
        from .display import completion_html

        return completion_html(self, show_ids)

    def __repr__(self) -> str:
        from .display import short_text

        calls = f"tool_calls={[c.name for c in self.tool_calls]!r}, " if self.tool_calls else ""
        if self.reasoning_content is not None:
            calls = f"reasoning_content={short_text(self.reasoning_content)!r}, " + calls
        return (f"Completion(text={short_text(self.text)!r}, {calls}finish_reason={self.finish_reason!r}, "
                f"usage=Usage(prompt_tokens={self.usage.prompt_tokens}, "
                f"completion_tokens={self.usage.completion_tokens}), request_id={self.request_id!r})")

    def _repr_html_(self) -> str:
        return self.to_html()

    def _repr_pretty_(self, printer, cycle: bool) -> None:
        printer.text("Completion(...)" if cycle else self.describe())


class CompletionFold:
    """Folds one request's StreamEvents into its Completion: the one fold, fed by the sync
    stream (RequestStream.collect) and the async one (AsyncRequestStream.collect) alike."""

    __slots__ = ("request_id", "texts", "token_ids", "logprobs", "finish_reason", "tool_deltas", "reasonings")

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None
        self.finish_reason: str | None = None
        self.tool_deltas: list[ToolCallDelta] | None = None
        self.reasonings: list[str] | None = None

    def add(self, event: StreamEvent) -> None:
        self.texts.append(event.text)
        self.token_ids.extend(event.token_ids)
        if event.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(event.logprobs)
        self.finish_reason = event.finish_reason or self.finish_reason
        if event.tool_calls:
            if self.tool_deltas is None:
                self.tool_deltas = []
            self.tool_deltas.extend(event.tool_calls)
        if event.reasoning_content is not None:
            if self.reasonings is None:
                self.reasonings = []
            self.reasonings.append(event.reasoning_content)

    def result(self, prompt_token_ids: list[int], prompt_logprobs, index: int = 0) -> Completion:
        return Completion(
            request_id=self.request_id,
            text="".join(self.texts),
            token_ids=self.token_ids,
            finish_reason=self.finish_reason,
            logprobs=self.logprobs,
            prompt_token_ids=prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            usage=Usage(len(prompt_token_ids), len(self.token_ids)),
            index=index,
            tool_calls=None if self.tool_deltas is None else fold_tool_calls(self.tool_deltas),
            reasoning_content=None if self.reasonings is None else "".join(self.reasonings),
        )
