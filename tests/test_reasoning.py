"""Reasoning output in-process: the parser against a plain one-shot split (any text, any split
into pieces), and the chat path with ScriptedModel over Qwen3's and DeepSeek-R1's templates:
reasoning_content never in text, streamed pieces equal to the Completion, tool calls parsed
from the content only, enable_thinking honoured, constrained requests left whole."""
from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cext.chunk import ChunkWriter
from engine import SamplingParams, StreamEvent
from engine.errors import InvalidParameterError
from engine.reasoning import ReasoningParser, reasoning_markers
from engine.tools import ToolCallDelta
from tests.reasoning_fixtures import DEEPSEEK_R1, QWEN3, reasoning_engine, template
from tests.server_fixtures import scripted_engine
from webapp import protocol
from webapp.sse import delta_chunk

MARKERS = ("<think>", "</think>")
ASK = [{"role": "user", "content": "What is 2+2?"}]
GREEDY = SamplingParams(temperature=0, max_tokens=200)
THOUGHT = "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nIt is 4."


def plain_split(text: str, is_open: bool) -> tuple[str, str]:
    """The definition: (reasoning, content) of a whole reply."""
    if not is_open:
        rest = text.lstrip()
        if not rest.startswith("<think>"):
            return "", text
        text = rest[len("<think>"):]
    end = text.find("</think>")
    return (text, "") if end < 0 else (text[:end], text[end + len("</think>"):])


PIECES = st.sampled_from(["<think>", "</think>", "<th", "ink>", "</", "think", ">", "<", " ", "\n", "a", "é", "😀"])


@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(PIECES, max_size=14), cuts=st.lists(st.integers(0, 60), max_size=8), is_open=st.booleans())
def test_parser_pieces_join_to_the_one_shot_split(pieces, cuts, is_open):
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    parser = ReasoningParser(MARKERS, is_open)
    reasoning, content = [], []
    for chunk in chunks:
        r, c = parser.add(chunk)
        reasoning.append(r)
        content.append(c)
    r, c = parser.finish()
    assert ("".join(reasoning) + r, "".join(content) + c) == plain_split(text, is_open)


def test_parser_holds_only_what_may_be_a_tag():
    parser = ReasoningParser(MARKERS)
    assert parser.add("  <thi") == ("", "")
    assert parser.add("nk>abc</th") == ("abc", "")  # "</th" may begin the closing tag
    assert parser.add("e end") == ("</the end", "")
    assert parser.add("</think>") == ("", "")
    assert parser.add("<think>x") == ("", "<think>x")  # a later opening tag is content
    parser = ReasoningParser(MARKERS)
    assert parser.add("<thin") == ("", "")
    assert parser.add("g") == ("", "<thing")
    assert ReasoningParser(MARKERS).finish() == ("", "")


def test_markers_come_from_the_template():
    assert reasoning_markers(template(QWEN3)) == MARKERS
    assert reasoning_markers(template(DEEPSEEK_R1)) == MARKERS
    assert reasoning_markers(template("google-gemma-2-2b-it.jinja")) is None
    assert reasoning_markers(None) is None


@pytest.mark.parametrize("per_char", [False, True])
def test_chat_splits_reasoning_streamed_and_not(per_char):
    with reasoning_engine(THOUGHT, per_char=per_char) as eng:
        done = eng.chat(ASK, GREEDY)
        events = list(eng.stream_chat(ASK, GREEDY))
    assert done.reasoning_content == "\nThe user asks 2+2. That is 4.\n"
    assert done.text == "\n\nIt is 4." and done.finish_reason == "stop"
    assert "".join(e.reasoning_content or "" for e in events) == done.reasoning_content
    assert "".join(e.text for e in events) == done.text
    assert not any("think>" in e.text for e in events)
    assert sum(len(e.token_ids) for e in events) == len(done.token_ids)
    # pieces arrive as they are generated, not all at the end
    assert sum(1 for e in events if e.reasoning_content) > 5


def test_async_chat_and_n_choices_split_each_choice():
    async def main():
        with reasoning_engine(THOUGHT) as eng:
            return await eng.achat(ASK, GREEDY), eng.chat(ASK, SamplingParams(temperature=0, max_tokens=200, n=2))

    done, choices = asyncio.run(main())
    assert done.reasoning_content.strip() == "The user asks 2+2. That is 4." and done.text.strip() == "It is 4."
    assert [c.index for c in choices] == [0, 1]
    assert all((c.reasoning_content, c.text) == (done.reasoning_content, done.text) for c in choices)


def test_reply_cut_inside_its_reasoning_is_all_reasoning():
    with reasoning_engine(THOUGHT) as eng:
        done = eng.chat(ASK, SamplingParams(temperature=0, max_tokens=6))
    assert done.finish_reason == "length" and done.text == ""
    assert done.reasoning_content and "<think>" not in done.reasoning_content


def test_reply_without_a_block_is_content():
    with reasoning_engine("Just 4.") as eng:
        done = eng.chat(ASK, GREEDY)
    assert (done.text, done.reasoning_content) == ("Just 4.", None)


def test_template_without_reasoning_leaves_the_text_whole():
    with scripted_engine(THOUGHT) as eng:  # SmolLM2's own template writes no <think>
        done = eng.chat(ASK, GREEDY)
    assert done.text == THOUGHT and done.reasoning_content is None


def test_enable_thinking_false_closes_the_block_in_the_prompt():
    with reasoning_engine("It is 4.") as eng:
        tok = eng.tokenizer
        thinking = tok.decode(eng.stream_chat(ASK, GREEDY).prompt_token_ids, skip_special_tokens=False)
        off = eng.stream_chat(ASK, GREEDY, chat_template_kwargs={"enable_thinking": False})
        prompt = tok.decode(off.prompt_token_ids, skip_special_tokens=False)
        done = off.collect()
    assert thinking.endswith("<|im_start|>assistant\n")
    assert prompt == thinking + "<think>\n\n</think>\n\n"
    assert (done.text, done.reasoning_content) == ("It is 4.", None)


def test_prompt_that_opens_the_block_makes_the_reply_start_inside_it():
    """DeepSeek-R1's generation prompt ends in "<think>\\n" (enable_thinking true in llama.cpp's copy
    of its template): the reply has no opening tag and starts as reasoning."""
    with reasoning_engine("Four, clearly.\n</think>\n\n4", DEEPSEEK_R1) as eng:
        stream = eng.stream_chat(ASK, GREEDY, chat_template_kwargs={"enable_thinking": True})
        assert eng.tokenizer.decode(stream.prompt_token_ids, skip_special_tokens=False).endswith("<think>\n")
        events = list(stream)
        closed = eng.chat(ASK, GREEDY)  # its default closes the block in the prompt: all content
    assert "".join(e.reasoning_content or "" for e in events) == "Four, clearly.\n"
    assert "".join(e.text for e in events) == "\n\n4"
    assert closed.reasoning_content is None and closed.text == "Four, clearly.\n</think>\n\n4"


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_REPLY = ('<think>\nI could write <tool_call>{"name": "nope"}</tool_call> here; it is only a thought.\n</think>\n\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def test_tool_calls_are_parsed_from_the_content_only():
    with reasoning_engine(CALL_REPLY) as eng:
        done = eng.chat(ASK, GREEDY, tools=[WEATHER])
        events = list(eng.stream_chat(ASK, GREEDY, tools=[WEATHER]))
    assert [(c.name, json.loads(c.arguments)) for c in done.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert done.finish_reason == "tool_calls" and done.text == ""
    assert '<tool_call>{"name": "nope"}</tool_call>' in done.reasoning_content
    assert "".join(e.reasoning_content or "" for e in events) == done.reasoning_content
    assert [d.name for e in events for d in e.tool_calls or () if d.name] == ["get_weather"]


def test_constrained_reply_is_not_split():
    """A grammar governs the whole reply (no room for a block): the reasoning parser stays off."""
    with reasoning_engine('<think>x</think>{"a": 1}') as eng:
        done = eng.chat(ASK, SamplingParams(temperature=0, max_tokens=50, regex=r'<think>x</think>\{"a": 1\}'))
    assert done.reasoning_content is None and done.text == '<think>x</think>{"a": 1}'


@pytest.mark.parametrize("kwargs, param", [
    ({"enable_thinkin": False}, "chat_template_kwargs.enable_thinkin"),
    ({"messages": []}, "chat_template_kwargs.messages"),
    ({"tools": None}, "chat_template_kwargs.tools"),
    (["enable_thinking"], "chat_template_kwargs"),
])
def test_chat_template_kwargs_errors_name_the_key(kwargs, param):
    with reasoning_engine("x") as eng:
        with pytest.raises(InvalidParameterError) as info:
            eng.chat(ASK, GREEDY, chat_template_kwargs=kwargs)
    assert info.value.param == param


def test_chat_template_kwargs_unknown_to_a_template_without_the_variable():
    with scripted_engine("x") as eng:
        with pytest.raises(InvalidParameterError) as info:
            eng.chat(ASK, GREEDY, chat_template_kwargs={"enable_thinking": False})
        assert eng.chat(ASK, GREEDY, chat_template_kwargs={}).text == "x"
    assert info.value.param == "chat_template_kwargs.enable_thinking"


@pytest.mark.parametrize("index", [0, 3])
@pytest.mark.parametrize("text, reasoning, with_calls", [
    ("", "step \"1\"\n", False), ("\n\nIt is 4.", "é 😀", False), ("", "", False), ("x", "why", True),
])
@pytest.mark.parametrize("include_usage", [False, True])
def test_reasoning_chunk_matches_the_plain_reference(index, text, reasoning, with_calls, include_usage):
    deltas = [ToolCallDelta(0, "call_a", "f", '{"q": 1}')] if with_calls else None
    event = StreamEvent("r", text, [1], None, None, index, deltas, reasoning)
    writer = ChunkWriter("chatcmpl-r", "m", 7, True, include_usage)
    for is_first in (True, False):
        raw = delta_chunk(writer, event)
        want = protocol.chat_chunk("chatcmpl-r", "m", 7, text, None, None, is_first=is_first,
                                   include_usage=include_usage, index=index, tool_calls=deltas,
                                   reasoning_content=reasoning)
        assert json.loads(raw[6:]) == want
    assert json.loads(writer.event("after", None, None, 0)[6:]) == protocol.chat_chunk(
        "chatcmpl-r", "m", 7, "after", None, None, is_first=index != 0, include_usage=include_usage)


def test_repl_shows_the_reasoning_apart_and_keeps_only_the_content():
    from engine.chat_repl import ChatSession

    shown = []
    with reasoning_engine(THOUGHT) as eng:
        session = ChatSession(eng, GREEDY, write=shown.append)
        assert session.turn("What is 2+2?") == "\n\nIt is 4."
    assert "".join(shown) == "[thinking] \nThe user asks 2+2. That is 4.\n [/thinking]\n\n\nIt is 4.\n"
    assert session.messages[-1] == {"role": "assistant", "content": "\n\nIt is 4."}


def test_markers_that_are_special_tokens_are_kept_for_the_parser():
    """A vocabulary whose <think> / </think> are special tokens (dropped by skip_special_tokens)
    still has its reasoning split: the chat path keeps special tokens in the text for it."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend

    import engine
    from engine.testing import ScriptedModel
    from engine.tokenizer import Tokenizer
    from tests.reasoning_fixtures import SURE_PEAK, reply_ids, tokenizer_with

    base = tokenizer_with(QWEN3)
    backend = Backend.from_str(base.backend.to_str())
    backend.add_special_tokens([AddedToken("<think>", special=True), AddedToken("</think>", special=True)])
    tok = Tokenizer(backend, eos_token_ids=base.eos_token_ids, chat_template=base.chat_template)
    assert tok.token_to_id("</think>") in tok.special_token_ids
    ids = reply_ids(tok, THOUGHT)
    with engine.Engine(ScriptedModel(ids, tok.vocab_size, SURE_PEAK), tok, max_model_len=1024) as eng:
        done = eng.chat(ASK, GREEDY)
    assert (done.reasoning_content, done.text) == ("\nThe user asks 2+2. That is 4.\n", "\n\nIt is 4.")


def test_completion_shows_its_reasoning():
    with reasoning_engine(THOUGHT) as eng:
        done = eng.chat(ASK, GREEDY)
    assert "reasoning_content='\\nThe user asks" in repr(done)
    assert "reasoning_content: '\\nThe user asks 2+2. That is 4.\\n'" in done.describe()
    assert "reasoning_content" in done.to_html()
