"""Validation of ``tools`` and ``tool_choice`` (OpenAI's shapes) and the plan of a request with tools.

    tools        [{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}]
                 1 to MAX_TOOLS entries, names ^[A-Za-z0-9_-]{1,64}$ and distinct,
                 parameters a JSON Schema object (default: an object with any properties)
    tool_choice  "none" | "auto" | "required" | {"type": "function", "function": {"name": <a tool>}}
                 default "auto" with tools, "none" without; "required" and a named tool need tools

Semantics (as OpenAI and vLLM): "none" renders the tools into the prompt but never parses calls;
"auto" lets the model choose and parses calls in the model family's format; "required" and a
named tool are enforced by constrained decoding (SamplingParams.json_schema): "required" decodes
a JSON array of ``{"name": <one of the tools>, "parameters": <its schema>}`` (at least one; at
most one with ``parallel_tool_calls=False``), a named tool decodes its arguments object.
Every check is one pass over the definitions (linear time). Errors are InvalidParameterError
naming the field ("tools[2].function.name", "tool_choice").
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from ..errors import InvalidParameterError
from .parsers import NamedParser, RequiredParser, ToolParser, parser_class_for

__all__ = ["MAX_TOOLS", "ToolPlan", "plan_tools", "validate_tool_choice", "validate_tools"]

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("none", "auto", "required")
_ANY_OBJECT = {"type": "object"}


def _fail(message: str, param: str):
    raise InvalidParameterError(message, param)


def validate_tools(tools) -> list[dict] | None:
    """The tools, checked; None for None or []. Returns the caller's dicts unchanged."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        _fail(f"tools must be a list of tool objects, got {type(tools).__name__}", "tools")
    if not tools:
        return None
    if len(tools) > MAX_TOOLS:
        _fail(f"tools has {len(tools)} entries; at most {MAX_TOOLS} are allowed", "tools")
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            _fail(f"{where} must be an object, got {type(tool).__name__}", where)
        if tool.get("type") != "function":
            _fail(f"{where}.type must be 'function', got {tool.get('type')!r}", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict):
            _fail(f"{where}.function must be an object with a name", f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            _fail(f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r:.80}",
                  f"{where}.function.name")
        if name in names:
            _fail(f"{where}.function.name {name!r} is defined twice", f"{where}.function.name")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            _fail(f"{where}.function.description must be a string", f"{where}.function.description")
        parameters = function.get("parameters")
        if parameters is not None:
            if not isinstance(parameters, dict):
                _fail(f"{where}.function.parameters must be a JSON Schema object, got {type(parameters).__name__}",
                      f"{where}.function.parameters")
            kind = parameters.get("type", "object")
            if kind != "object":
                _fail(f"{where}.function.parameters must describe an object (type 'object'), got type {kind!r}",
                      f"{where}.function.parameters")
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            _fail(f"{where}.function.strict must be a boolean", f"{where}.function.strict")
    return list(tools)


def validate_tool_choice(tool_choice, tools: list[dict] | None) -> str:
    """"none", "auto", "required", or the name of the function a named choice forces."""
    if tool_choice is None:
        return "auto" if tools else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            _fail(f"tool_choice must be one of {', '.join(_CHOICES)} or a function object, got {tool_choice!r:.80}",
                  "tool_choice")
        if tool_choice == "required" and not tools:
            _fail("tool_choice 'required' needs tools", "tool_choice")
        return tool_choice
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict) \
            or not isinstance(function.get("name"), str):
        _fail('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
              f"got {tool_choice!r:.80}", "tool_choice")
    name = function["name"]
    if not tools:
        _fail(f"tool_choice names the function {name!r:.80} but no tools were given", "tool_choice")
    if name not in _names(tools):
        _fail(f"tool_choice names the function {name!r:.80}, which is not among the tools "
              f"({', '.join(_names(tools))})", "tool_choice")
    return name


def _names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or _ANY_OBJECT


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A request's validated tools and choice, and what follows from them."""

    tools: list[dict]
    choice: str  # "none" | "auto" | "required" | the forced function's name
    parser_class: type[ToolParser]
    is_parallel: bool = True  # parallel_tool_calls

    @property
    def is_parsing(self) -> bool:
        return self.choice != "none"

    @property
    def forced_name(self) -> str | None:
        return None if self.choice in _CHOICES else self.choice

    def json_schema(self) -> dict | None:
        """The schema that enforces a call ("required", a named tool), else None."""
        if self.forced_name is not None:
            tool = next(t for t in self.tools if t["function"]["name"] == self.forced_name)
            return _parameters(tool)
        if self.choice != "required":
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                 "parameters": _parameters(t)},
                  "required": ["name", "parameters"]} for t in self.tools]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.is_parallel:
            schema["maxItems"] = 1
        return schema

    def sampling_params(self, params, keep_markers: bool = False):
        """params with the call enforced (json_schema), and with special tokens kept in the text when
        ``keep_markers`` (the format's markers are special tokens, as Mistral's [TOOL_CALLS])."""
        changes = {}
        schema = self.json_schema()
        if schema is not None:
            if not any(f.name == "json_schema" for f in dataclasses.fields(params)):
                _fail("tool_choice 'required' or a named function needs constrained decoding (json_schema), "
                      "which this build lacks", "tool_choice")
            if getattr(params, "json_schema", None) is not None:
                _fail("tool_choice 'required' or a named function cannot be combined with another json_schema "
                      "or response_format", "tool_choice")
            changes["json_schema"] = schema
        elif self.is_parsing and keep_markers and params.skip_special_tokens:
            changes["skip_special_tokens"] = False
        if not changes:
            return params
        try:
            return dataclasses.replace(params, **changes)
        except InvalidParameterError as e:  # the enforcing schema is built from the tools: name them
            raise InvalidParameterError(f"tools (as the schema that enforces tool_choice): {e}", "tools") from None

    def new_parser(self) -> ToolParser | None:
        """A parser for one choice of the reply (None: tool_choice "none", the text stays text)."""
        if not self.is_parsing:
            return None
        make_id = self.parser_class.default_make_id
        if self.forced_name is not None:
            return NamedParser(self.forced_name, make_id)
        if self.choice == "required":
            return RequiredParser(make_id)
        return self.parser_class()


def plan_tools(chat_template: str | None, tools, tool_choice=None, parallel_tool_calls: bool = True) -> ToolPlan | None:
    """The plan of a request, or None when it has no tools (and tool_choice allows that)."""
    checked = validate_tools(tools)
    choice = validate_tool_choice(tool_choice, checked)
    if checked is None:
        return None
    return ToolPlan(checked, choice, parser_class_for(chat_template), bool(parallel_tool_calls))
