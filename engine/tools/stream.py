"""A chat request with tools: its prompt, its sampling params, and the filter of its events.

    prompt_ids, params, event_filter = prepare_chat(tokenizer, messages, params, tools, tool_choice)

``event_filter`` (None without tools, or with tool_choice "none") turns each StreamEvent of
the request into one whose ``text`` is content and whose ``tool_calls`` holds the call
deltas parsed from the generated text (one parser per choice). The request's streams apply
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

__all__ = ["ToolEventFilter", "prepare_chat", "tools_error"]


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
                           event.index, deltas or None)


def _markers_are_special(tokenizer, parser_class: type[ToolParser]) -> bool:
    """True when a marker of the format is one special token (dropped by skip_special_tokens)."""
    special = tokenizer.special_token_ids
    return any(tokenizer.token_to_id(marker) in special for marker in parser_class.markers)


def prepare_chat(tokenizer, messages, params: SamplingParams | None, tools=None, tool_choice=None,
                 parallel_tool_calls: bool = True):
    """(prompt ids, params, event filter or None) of a chat request. Validates tools and
    tool_choice (InvalidParameterError naming the field) before templating."""
    plan = plan_tools(tokenizer.chat_template, tools, tool_choice, parallel_tool_calls)
    prompt_ids = tokenizer.encode_chat(messages, add_generation_prompt=True, tools=None if plan is None else plan.tools)
    if plan is None:
        return prompt_ids, params, None
    params = plan.sampling_params(params if params is not None else SamplingParams(),
                                  keep_markers=_markers_are_special(tokenizer, plan.parser_class))
    return prompt_ids, params, ToolEventFilter(plan) if plan.is_parsing else None


def tools_error(exc: InvalidParameterError, event_filter: ToolEventFilter | None) -> InvalidParameterError:
    """A json_schema error of a request whose schema was built from its tools (tool_choice
    "required" or named: the tool's parameters did not compile) names ``tools`` instead."""
    if event_filter is not None and exc.param == "json_schema" and event_filter.plan.json_schema() is not None:
        return InvalidParameterError(f"tools (as the schema that enforces tool_choice): {exc}", "tools")
    return exc
