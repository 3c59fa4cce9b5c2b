"""Tools over HTTP with the official openai client: parsed calls (scripted replies, Hermes format),
streamed deltas that fold to the one-shot call, the tool-call chunk (ChunkWriter.delta_event)
against its plain reference, and on Qwen2.5-Coder-0.5B-Instruct: tool_choice "required" and a
named tool give a call whose arguments validate against the tool's schema, streamed and not."""
from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

import engine
from cext.chunk import ChunkWriter
from engine.errors import InvalidParameterError
from engine.params import SamplingParams
from engine.tools import ToolCallDelta, fold_tool_calls
from tests.model_fixtures import qwen_model_path
from tests.server_fixtures import LiveServer, scripted_engine
from webapp import protocol
from webapp.sse import delta_chunk

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
REPLY = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich \\"Z\\""}}\n</tool_call>'
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)


def fold_stream(chunks) -> tuple[str, dict, str, list]:
    """(content, {index: [name, id, arguments]}, finish_reason, tool call deltas) of a streamed reply."""
    content, calls, finish_reason, deltas = [], {}, None, []
    for chunk in chunks:
        choice = chunk.choices[0]
        content.append(choice.delta.content or "")
        for delta in choice.delta.tool_calls or ():
            deltas.append(delta)
            if delta.index not in calls:
                calls[delta.index] = [delta.function.name, delta.id, ""]
            else:
                assert delta.id is None and delta.function.name is None  # id and name come once
            calls[delta.index][2] += delta.function.arguments or ""
        finish_reason = choice.finish_reason or finish_reason
    return "".join(content), calls, finish_reason, deltas


# The script's token at logit 40 (ScriptedModel's 20 leaves p ~ 0.99985 per token at temperature
# 1: an unseeded ~60-token reply strayed in ~1% of runs, once into "<ο_call>" in a fresh clone).
SURE_PEAK = 40.0


@pytest.fixture(scope="module")
def scripted_server():
    with scripted_engine(REPLY, peak=SURE_PEAK) as eng, LiveServer(eng) as server:
        yield server


def test_auto_reply_with_a_call_streamed_and_not(scripted_server):
    api = client(scripted_server)
    full = api.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=200)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": 'Zürich "Z"'}
    content, calls, finish_reason, deltas = fold_stream(
        api.chat.completions.create(model="m", messages=ASK, tools=TOOLS, max_tokens=200, stream=True))
    assert content == "Checking." and finish_reason == "tool_calls"
    assert [(name, arguments) for name, _, arguments in calls.values()] == [("get_weather", call.function.arguments)]
    assert len(deltas) > 2  # the arguments arrive in pieces


def test_tool_choice_none_leaves_the_text(scripted_server):
    full = client(scripted_server).chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none",
                                                           max_tokens=200)
    assert full.choices[0].message.content == REPLY and not full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "stop"


def test_each_choice_is_parsed_on_its_own(scripted_server):
    # seeded: at temperature 1 the script's token has p ~ 0.99985, so an unseeded run strays
    # in ~1% of runs (it did in CI)
    full = client(scripted_server).chat.completions.create(model="m", messages=ASK, tools=TOOLS, n=2, max_tokens=200,
                                                           seed=7)
    assert [c.message.tool_calls[0].function.name for c in full.choices] == ["get_weather"] * 2
    assert full.choices[0].message.tool_calls[0].id != full.choices[1].message.tool_calls[0].id


def test_history_with_tool_results_is_accepted(scripted_server):
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    full = client(scripted_server).chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=3)
    assert full.choices[0].finish_reason == "length"
    status, body = scripted_server.post_json("/v1/chat/completions", {"messages": [
        *messages[:1], {**messages[1], "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]}]})
    assert status == 400 and body["error"]["param"] == "messages[1].tool_calls[0].function.arguments"


@pytest.mark.parametrize("index", [0, 3])
@pytest.mark.parametrize("text", ["", "pre \"x\""])
@pytest.mark.parametrize("include_usage", [False, True])
def test_delta_chunk_matches_the_plain_reference(index, text, include_usage):
    deltas = [ToolCallDelta(0, "call_a", "f", '{"q": "é\\n'), ToolCallDelta(1, arguments="}")]
    event = engine.StreamEvent("r", text, [1], None, "tool_calls", index, deltas)
    writer = ChunkWriter("chatcmpl-r", "m", 7, True, include_usage)
    for is_first in (True, False):
        raw = delta_chunk(writer, event)
        assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
        want = protocol.chat_chunk("chatcmpl-r", "m", 7, text, None, "tool_calls", is_first=is_first,
                                   include_usage=include_usage, index=index, tool_calls=deltas)
        assert json.loads(raw[6:]) == want
    assert writer.event("after", None, None, 0).startswith(b'data: {"id":"chatcmpl-r"')  # head intact


def test_in_process_chat_with_tools_and_errors():
    with scripted_engine(REPLY, peak=SURE_PEAK) as eng:
        done = eng.chat(ASK, SamplingParams(max_tokens=200), tools=TOOLS)
        assert done.text == "Checking." and done.finish_reason == "tool_calls"
        assert [c.name for c in done.tool_calls] == ["get_weather"]
        assert "tool_calls=['get_weather']" in repr(done) and "tool call: get_weather(" in done.describe()
        events = list(eng.stream_chat(ASK, SamplingParams(max_tokens=200), tools=TOOLS))
        assert "".join(e.text for e in events) == done.text
        for tool_choice, param in [("required", "tool_choice"), ({"type": "function", "function": {"name": "x"}},
                                                                 "tool_choice")]:
            with pytest.raises(InvalidParameterError) as info:
                eng.chat(ASK, tools=[ADD] if tool_choice != "required" else None, tool_choice=tool_choice)
            assert info.value.param == param
        with pytest.raises(InvalidParameterError) as info:
            eng.chat(ASK, tools=[{"type": "function", "function": {"name": "a b"}}])
        assert info.value.param == "tools[0].function.name"


def test_async_chat_with_tools_folds_like_the_stream():
    async def run():
        with scripted_engine(REPLY, peak=SURE_PEAK) as eng:
            done = await eng.achat(ASK, SamplingParams(max_tokens=200), tools=TOOLS)
            events = [e async for e in eng.astream_chat(ASK, SamplingParams(max_tokens=200), tools=TOOLS)]
            return done, events

    done, events = asyncio.run(run())
    assert done.text == "Checking." and done.tool_calls[0].name == "get_weather"
    assert "".join(e.text for e in events) == done.text and events[-1].finish_reason == "tool_calls"
    assert fold_tool_calls([d for e in events for d in e.tool_calls or ()])[0].arguments == \
        done.tool_calls[0].arguments



def test_async_ready_events_are_filtered_like_the_iterated_ones():
    # AsyncRequestStream shares RequestStream's drain: events taken by ready_events() pass the
    # tool filter too (content + call deltas), as the iterated ones do.
    async def run():
        with scripted_engine(REPLY, peak=SURE_PEAK) as eng:
            done = await eng.achat(ASK, SamplingParams(max_tokens=200), tools=TOOLS)
            stream = eng.astream_chat(ASK, SamplingParams(max_tokens=200), tools=TOOLS)
            events = [await stream.__anext__()]
            drained = []
            deadline = time.monotonic() + 60  # a bound for a busy machine, not a timing assertion
            while events[-1].finish_reason is None and time.monotonic() < deadline:
                more = stream.ready_events()
                drained += more
                events += more
                await asyncio.sleep(0.01)
            events += [e async for e in stream]
            return done, events, drained

    done, events, drained = asyncio.run(run())
    assert drained
    assert "".join(e.text for e in events) == done.text and events[-1].finish_reason == "tool_calls"
    assert fold_tool_calls([d for e in events for d in e.tool_calls or ()])[0].arguments == \
        done.tool_calls[0].arguments

# ---- the real instruct model: enforced calls ----

@pytest.fixture(scope="module")
def qwen_server():
    with engine.Engine.from_pretrained(qwen_model_path(), max_model_len=1024) as eng, LiveServer(eng) as server:
        yield server


def test_qwen_required_and_named_calls_validate_streamed_and_not(qwen_server):
    """Four requests at once (one batch): required and a named tool, each streamed and not."""
    api = client(qwen_server)
    common = {"model": "m", "messages": ASK, "tools": TOOLS, "max_tokens": 48, "temperature": 0}
    named = {"type": "function", "function": {"name": "add"}}

    def full(tool_choice):
        return api.chat.completions.create(tool_choice=tool_choice, **common).choices[0]

    def streamed(tool_choice):
        return fold_stream(api.chat.completions.create(tool_choice=tool_choice, stream=True, **common))

    with ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(full, "required"), pool.submit(streamed, "required"),
                pool.submit(full, named), pool.submit(streamed, named)]
        required_full, required_streamed, named_full, named_streamed = [job.result() for job in jobs]
    for choice, want_name in [(required_full, None), (named_full, "add")]:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        call = choice.message.tool_calls[0]
        assert call.function.name in SCHEMAS and (want_name is None or call.function.name == want_name)
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    for (content, calls, finish_reason, _), choice in [(required_streamed, required_full),
                                                       (named_streamed, named_full)]:
        assert content == "" and finish_reason == "tool_calls"
        assert [(name, arguments) for name, _, arguments in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
