"""Tools as a hook into the chat path (engine/chat.py): what a chat request with tools changes.

    hook = tool_hook(tokenizer, tools, tool_choice)   # None without tools
    hook.tools, hook.sampling_params(params), hook.event_filter(), hook.error(exc)

The event filter (None with tool_choice "none") turns each StreamEvent of the request into
one whose ``text`` is content and whose ``tool_calls`` holds the call deltas parsed from the
generated text (one parser per choice). The request's streams apply
it to every event they hand out, so iterating, ``ready_events`` and the Completion fold all
see the same events: a streamed reply and its one-shot twin are equal. The last event of a
choice that called tools and stopped says finish_reason "tool_calls".
"""
from __future__ import annotations

from ..errors import InvalidParameterError
from ..outputs import StreamEvent
from ..params import SamplingParams
from .parsers import ToolParser
from .spec import ToolPlan, plan_tools

__all__ = ["ToolEventFilter", "ToolHook", "tool_hook"]


class ToolEventFilter:
    """Callable: StreamEvent (generated text) -> StreamEvent (content + tool call deltas)."""

    __slots__ = ("plan", "parsers")

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.parsers: dict[int, ToolParser] = {}

    def __call__(self, event: StreamEvent) -> StreamEvent:
        parser = self.parsers.get(event.index)
        if parser is None:
            parser = self.parsers[event.index] = self.plan.new_parser()
        content, deltas = parser.add(event.text) if event.text else ("", [])
        finish_reason = event.finish_reason
        if finish_reason is not None:
            more_content, more_deltas = parser.finish()
            content += more_content
            deltas = deltas + more_deltas
            if parser.num_calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        return StreamEvent(event.request_id, content, event.token_ids, event.logprobs, finish_reason,
                           event.index, deltas or None, event.reasoning_content)


class ToolHook:
    """The tools of one chat request, as engine/chat.py's path uses them."""

    __slots__ = ("plan", "keep_markers")

    def __init__(self, plan: ToolPlan, keep_markers: bool):
        self.plan = plan
        self.keep_markers = keep_markers

    @property
    def tools(self) -> list[dict]:
        """The checked tools, for the chat template to render."""
        return self.plan.tools

    def sampling_params(self, params: SamplingParams | None) -> SamplingParams:
        """``params`` with what tool_choice asks (a json_schema for "required" or a named tool)."""
        return self.plan.sampling_params(params if params is not None else SamplingParams(),
                                         keep_markers=self.keep_markers)

    def event_filter(self) -> ToolEventFilter | None:
        """The request's event filter; None when calls are not parsed (tool_choice "none")."""
        return ToolEventFilter(self.plan) if self.plan.is_parsing else None

    def error(self, exc: InvalidParameterError) -> InvalidParameterError:
        """A json_schema error of a request whose schema was built from its tools (tool_choice
        "required" or named: the tool's parameters did not compile) names ``tools`` instead."""
        if exc.param == "json_schema" and self.plan.is_parsing and self.plan.json_schema() is not None:
            return InvalidParameterError(f"tools (as the schema that enforces tool_choice): {exc}", "tools")
        return exc


def tool_hook(tokenizer, tools, tool_choice=None, parallel_tool_calls: bool = True) -> ToolHook | None:
    """The hook of a chat request's tools, or None when it has none (and tool_choice allows that).
    Validates tools and tool_choice (InvalidParameterError naming the field)."""
    plan = plan_tools(tokenizer.chat_template, tools, tool_choice, parallel_tool_calls)
    if plan is None:
        return None
    # a format whose markers are special tokens (Mistral's [TOOL_CALLS]) keeps them in the text
    return ToolHook(plan, tokenizer.is_special_text(plan.parser_class.markers))
