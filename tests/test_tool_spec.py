"""engine.tools.spec: tools and tool_choice validation (errors name the field), the schemas that
enforce "required" and a named tool, and the params a plan gives a request."""
from __future__ import annotations

import jsonschema
import pytest

from engine.errors import InvalidParameterError
from engine.params import SamplingParams
from engine.tools import (
    HermesParser,
    MistralParser,
    NamedParser,
    RequiredParser,
    plan_tools,
    validate_tool_choice,
    validate_tools,
)
from engine.tools.spec import MAX_TOOLS


def tool(name="f", **function):
    return {"type": "function", "function": {"name": name, **function}}


ADD = tool("add", parameters={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.mark.parametrize("tools, param", [
    ("f", "tools"),
    ([3], "tools[0]"),
    ([{"function": {"name": "f"}}], "tools[0].type"),
    ([{"type": "function"}], "tools[0].function"),
    ([tool("")], "tools[0].function.name"),
    ([tool("a.b")], "tools[0].function.name"),
    ([tool("x" * 65)], "tools[0].function.name"),
    ([tool(), tool("g"), tool()], "tools[2].function.name"),
    ([tool(description=3)], "tools[0].function.description"),
    ([tool(parameters=[])], "tools[0].function.parameters"),
    ([tool(parameters={"type": "string"})], "tools[0].function.parameters"),
    ([tool(strict="yes")], "tools[0].function.strict"),
    ([tool(f"t{i}") for i in range(MAX_TOOLS + 1)], "tools"),
])
def test_bad_tools_name_the_field(tools, param):
    with pytest.raises(InvalidParameterError) as info:
        validate_tools(tools)
    assert info.value.param == param


@pytest.mark.parametrize("tool_choice, tools", [
    ("any", [ADD]), ("required", None), ({"type": "function", "function": {"name": "add"}}, None),
    ({"type": "function", "function": {"name": "sub"}}, [ADD]), ({"function": {"name": "add"}}, [ADD]),
    ({"type": "function", "function": "add"}, [ADD]), (3, [ADD]),
])
def test_bad_tool_choice(tool_choice, tools):
    with pytest.raises(InvalidParameterError) as info:
        validate_tool_choice(tool_choice, validate_tools(tools))
    assert info.value.param == "tool_choice"


def test_defaults_and_no_tools():
    assert validate_tool_choice(None, [ADD]) == "auto" and validate_tool_choice(None, None) == "none"
    assert plan_tools(None, None) is None and plan_tools(None, [], "auto") is None
    assert plan_tools(None, [ADD], {"type": "function", "function": {"name": "add"}}).forced_name == "add"


def test_required_schema_accepts_exactly_the_calls_of_the_tools():
    plan = plan_tools("<tool_call>", [ADD, tool("ping")], "required")
    schema = plan.json_schema()
    jsonschema.validate([{"name": "add", "parameters": {"a": 1}}, {"name": "ping", "parameters": {}}], schema)
    for bad in ([], [{"name": "sub", "parameters": {}}], [{"name": "add", "parameters": {"a": "x"}}],
                [{"name": "add"}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = plan_tools(None, [ADD, tool("ping")], "required", parallel_tool_calls=False).json_schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "ping", "parameters": {}}] * 2, single)
    assert isinstance(plan.new_parser(), RequiredParser)


def test_named_schema_is_the_functions_parameters():
    plan = plan_tools(None, [ADD, tool("ping")], {"type": "function", "function": {"name": "add"}})
    assert plan.json_schema() == ADD["function"]["parameters"]
    params = plan.sampling_params(SamplingParams(max_tokens=5))
    assert params.json_schema == ADD["function"]["parameters"] and params.max_tokens == 5
    assert isinstance(plan.new_parser(), NamedParser)
    named_ping = plan_tools(None, [ADD, tool("ping")], {"type": "function", "function": {"name": "ping"}})
    assert named_ping.json_schema() == {"type": "object"}  # no parameters: any object


def test_auto_and_none_plans():
    auto = plan_tools("[TOOL_CALLS]", [ADD])
    assert auto.json_schema() is None and isinstance(auto.new_parser(), MistralParser)
    params = SamplingParams()
    assert auto.sampling_params(params) is params
    assert auto.sampling_params(params, keep_markers=True).skip_special_tokens is False
    assert len(auto.new_parser().make_id()) == 9  # Mistral's ids
    none = plan_tools("<tool_call>", [ADD], "none")
    assert none.new_parser() is None and not none.is_parsing
    assert plan_tools("<tool_call>", [ADD]).parser_class is HermesParser


def test_enforced_choice_refuses_a_second_schema():
    plan = plan_tools(None, [ADD], "required")
    with pytest.raises(InvalidParameterError) as info:
        plan.sampling_params(SamplingParams(json_schema={"type": "object"}))
    assert info.value.param == "tool_choice"
