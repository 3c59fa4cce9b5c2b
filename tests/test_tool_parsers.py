"""engine.tools parsers: each format one-shot and streamed, split at every character boundary
(exhaustively for fixed replies, by hypothesis for generated ones), text before/after calls,
replies that only look like calls, and the folding of deltas."""
from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.tools import (
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    NamedParser,
    RequiredParser,
    ToolCall,
    ToolCallDelta,
    fold_tool_calls,
    parser_class_for,
)


def make(parser_class, name=None):
    ids = itertools.count()
    make_id = lambda: f"id{next(ids)}"  # noqa: E731
    return parser_class(name, make_id) if parser_class is NamedParser else parser_class(make_id)


def run(parser_class, pieces, name=None):
    """(content, calls, deltas) of a reply that arrives in ``pieces``."""
    parser = make(parser_class, name)
    contents, deltas = [], []
    for piece in pieces:
        content, new = parser.add(piece)
        contents.append(content)
        deltas += new
    content, new = parser.finish()
    contents.append(content)
    deltas += new
    return "".join(contents), fold_tool_calls(deltas), deltas


def one_shot(parser_class, text, name=None):
    content, calls, _ = run(parser_class, [text], name)
    return content, calls


def assert_every_split_agrees(parser_class, text, name=None):
    """Every split into two and three pieces, and one piece per character, gives the one-shot result."""
    want = one_shot(parser_class, text, name)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 3):
            assert run(parser_class, [text[:i], text[i:j], text[j:]], name)[:2] == want, (i, j)
    assert run(parser_class, list(text), name)[:2] == want
    return want


WEATHER = '{"name": "get_weather", "arguments": {"city": "Par\\"is", "days": [1, {"x": "}]"}]}}'

FIXED = [
    # parser, reply, content, [(name, arguments)]
    (HermesParser, f"Let me look.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me look.",
     [("get_weather", '{"city": "Par\\"is", "days": [1, {"x": "}]"}]}')]),
    (HermesParser, '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n'
                   '{"arguments": {"k": "v"}, "name": "b"}\n</tool_call>\n', "",
     [("a", "{}"), ("b", '{"k": "v"}')]),
    (HermesParser, "Text <tool_ca and more\n", "Text <tool_ca and more\n", []),
    (HermesParser, "<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    (HermesParser, '<tool_call>{"name": "a", "arguments": {"q": 1}}', "", [("a", '{"q": 1}')]),  # cut off
    (HermesParser, '<tool_call>{"name": "a", "arguments": {"q": 1}}</tool_call>\nDone.', "Done.", [("a", '{"q": 1}')]),
    (Llama3JsonParser, '<|python_tag|>{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "",
     [("f", '{"a": 1}'), ("g", "{}")]),
    (Llama3JsonParser, ' {"name": "f", "parameters": {"a": "x"}}', "", [("f", '{"a": "x"}')]),
    (Llama3JsonParser, '  {"foo": 1} and more', '  {"foo": 1} and more', []),
    (Llama3JsonParser, "Hello {there}", "Hello {there}", []),
    (MistralParser, '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "]"}}]',
     "", [("f", '{"a": 1}'), ("g", '{"b": "]"}')]),
    (MistralParser, "Sure [TOOL_CALLS] nope", "Sure [TOOL_CALLS] nope", []),
    (MistralParser, 'Ok.[TOOL_CALLS]get_weather[ARGS]{"city": "{Paris}"}[TOOL_CALLS]add{"a": [1]} Done',
     "Ok.Done", [("get_weather", '{"city": "{Paris}"}'), ("add", '{"a": [1]}')]),
    (MistralParser, "[TOOL_CALLS]bad name[ARGS]{}", "[TOOL_CALLS]bad name[ARGS]{}", []),
    (MistralParser, '[TOOL_CALLS]f[ARGS]{"a": 1', "", [("f", '{"a": 1')]),  # cut off: the call keeps what came
    (MistralParser, "[TOOL_CALLS]f[AR", "[TOOL_CALLS]f[AR", []),
    (MistralParser, "Plain [TOOL_ text", "Plain [TOOL_ text", []),
    (RequiredParser, '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"s": "x,y"}}]', "",
     [("f", '{"a": 1}'), ("g", '{"s": "x,y"}')]),
]


@pytest.mark.parametrize("parser_class, text, content, calls", FIXED)
def test_fixed_replies_at_every_split(parser_class, text, content, calls):
    got_content, got_calls = assert_every_split_agrees(parser_class, text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert [c.id for c in got_calls] == [f"id{i}" for i in range(len(calls))]


def test_named_reply_is_the_arguments():
    content, calls = assert_every_split_agrees(NamedParser, ' {"a": [1, 2]}', name="add")
    assert content == "" and calls == [ToolCall("id0", "add", '{"a": [1, 2]}')]


def test_arguments_stream_in_pieces_with_the_name_first():
    _, calls, deltas = run(HermesParser,
                           ["<tool_call>", '{"name": "f", ', '"arguments": {"a"', ': 1}', "}</tool_call>"])
    assert deltas[0] == ToolCallDelta(0, "id0", "f", '{"a"')  # announced with the arguments so far
    assert len(deltas) == 2 and "".join(d.arguments for d in deltas) == '{"a": 1}'
    assert all(d.id is None and d.name is None for d in deltas[1:])


def test_text_that_may_start_a_call_is_held_back():
    parser = make(HermesParser)
    assert parser.add("Hi <tool") == ("Hi", [])  # the space waits with the partial marker
    content, deltas = parser.add("_call>")
    assert content == "" and deltas == []
    parser = make(HermesParser)
    assert parser.add("Hi <tool") == ("Hi", [])
    assert parser.add("box>") == (" <toolbox>", [])


def test_reply_without_calls_keeps_its_text_exactly():
    text = "  Two spaces, a newline\n\nand a trailing one \n"
    for parser_class in (HermesParser, Llama3JsonParser, MistralParser):
        assert assert_every_split_agrees(parser_class, text) == (text, [])


def test_call_without_the_usual_key_order_is_read_whole():
    arguments = {"text": "x" * 5000, "nested": {"k": [1]}}
    text = "<tool_call>" + json.dumps({"arguments": arguments, "name": "f"}) + "</tool_call>"
    content, calls, deltas = run(HermesParser, [text[i:i + 7] for i in range(0, len(text), 7)])
    assert content == "" and len(deltas) == 1 and json.loads(calls[0].arguments) == arguments


def test_fold_orders_by_index_and_joins_arguments():
    deltas = [ToolCallDelta(1, "b", "g", "{"), ToolCallDelta(0, "a", "f", "{}"), ToolCallDelta(1, arguments="}")]
    assert fold_tool_calls(deltas) == [ToolCall("a", "f", "{}"), ToolCall("b", "g", "{}")]
    assert ToolCallDelta(0, arguments="x").to_dict() == {"index": 0, "function": {"arguments": "x"}}
    assert ToolCallDelta(0, "a", "f").to_dict() == {"index": 0, "id": "a", "type": "function",
                                                     "function": {"name": "f", "arguments": ""}}


@pytest.mark.parametrize("template, parser_class", [
    ("... <tool_call> ...", HermesParser), ("[TOOL_CALLS]", MistralParser),
    ("<|start_header_id|>", Llama3JsonParser), ("{{ messages }}", HermesParser), (None, HermesParser)])
def test_parser_is_chosen_from_the_template(template, parser_class):
    assert parser_class_for(template) is parser_class


# ---- generated replies ----

SAFE_TEXT = st.text(st.characters(codec="utf-8", exclude_characters="<[{;"), max_size=12)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
CALLS = st.lists(st.tuples(st.from_regex(r"[a-z_]{1,8}", fullmatch=True),
                           st.dictionaries(st.text(max_size=5), JSON_VALUES, max_size=3)), min_size=0, max_size=3)


FORMATS = {"hermes": HermesParser, "mistral": MistralParser, "mistral-v11": MistralParser, "llama3": Llama3JsonParser}


def render(form: str, before: str, calls, after: str) -> str:
    if form == "hermes":
        body = "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>\n" for n, a in calls)
        return before + body + after
    if form == "mistral-v11":
        return before + "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls) + after
    if form == "mistral":
        listed = json.dumps([{"name": n, "arguments": a} for n, a in calls])
        return before + ("[TOOL_CALLS]" + listed if calls else "") + after
    return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)  # Llama: calls only


@settings(max_examples=150, deadline=None)
@given(form=st.sampled_from(sorted(FORMATS)), before=SAFE_TEXT, calls=CALLS, after=SAFE_TEXT,
       cuts=st.lists(st.integers(0, 400), max_size=6))
def test_generated_replies_parse_the_same_however_split(form, before, calls, after, cuts):
    parser_class = FORMATS[form]
    text = render(form, before, calls, after)
    content, got = one_shot(parser_class, text)
    assert [(c.name, json.loads(c.arguments)) for c in got] == [(n, a) for n, a in calls]
    if parser_class is not Llama3JsonParser:
        # whitespace next to calls is dropped; a reply without calls keeps its text
        assert content == (before.rstrip() + after.strip() if calls else before + after)
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[i:j] for i, j in zip([0] + bounds, bounds + [len(text)])]
    assert run(parser_class, pieces)[:2] == (content, got)
