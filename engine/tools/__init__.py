"""Tools and tool calling: OpenAI ``tools`` / ``tool_choice`` in, ``tool_calls`` out.

    plan = plan_tools(tok.chat_template, tools, tool_choice)  # validated; None when no tools
    params = plan.sampling_params(params)              # json_schema for "required" / a named tool
    parser = plan.new_parser()                         # per choice: text -> content + call deltas

The package, one module per concern:

    spec.py       validation of tools and tool_choice; the JSON Schemas that enforce a call
    calls.py      call ids (ToolCall, ToolCallDelta, fold_tool_calls: engine/outputs.py)
    json_call.py  one JSON call object read piece by piece (arguments streamed as they come)
    call_list.py  calls in a row (arrays, ";"-separated) and Mistral's name[ARGS]{...} calls
    parsers.py    the per-format streaming parsers (Hermes/Qwen2.5, Llama 3.x JSON, Mistral,
                  and the constrained "required" / named replies)
    stream.py     ToolHook, the tools' hook into the chat path (engine/chat.py), and
                  ToolEventFilter: a request's StreamEvents -> content + tool_calls
"""
from __future__ import annotations

from .calls import ToolCall, ToolCallDelta, fold_tool_calls
from .parsers import (
                      HermesParser,
                      Llama3JsonParser,
                      MistralParser,
                      NamedParser,
                      RequiredParser,
                      ToolParser,
                      parser_class_for,
)
from .spec import ToolPlan, plan_tools, validate_tool_choice, validate_tools

__all__ = [
    "HermesParser", "Llama3JsonParser", "MistralParser", "NamedParser", "RequiredParser", "ToolCall",
    "ToolCallDelta", "ToolParser", "ToolPlan", "fold_tool_calls", "parser_class_for", "plan_tools",
    "validate_tool_choice", "validate_tools",
]

