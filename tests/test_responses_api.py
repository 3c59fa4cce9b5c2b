"""POST /v1/responses (+ GET, DELETE) through the live server and the official openai client, unchanged.

Scripted replies (the embedded tokenizer, Hermes-format tool calls) test the shapes, the typed
stream events and the conversation the prompt is built from (its token count against the
engine's own chat template); Qwen2.5-Coder-0.5B-Instruct runs a function tool round trip and a
json_schema text format for real. The Ray Serve front-end is tested in tests/test_ray_serve.py.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

import engine
from tests.model_fixtures import qwen_model_path
from tests.server_fixtures import SCRIPT_TEXT, LiveServer, scripted_engine
from webapp.response_store import ResponseStore

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
REPLY = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
SURE_PEAK = 40.0  # the script's token at logit 40: p ~ 1 - 2e-9 per token at temperature 1


def api(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def text_server():
    with scripted_engine(peak=SURE_PEAK, max_model_len=512) as eng, LiveServer(eng) as server:
        yield server


@pytest.fixture(scope="module")
def call_server():
    with scripted_engine(REPLY, peak=SURE_PEAK, max_model_len=1024) as eng, LiveServer(eng) as server:
        yield server


def prompt_tokens(server: LiveServer, messages: list[dict], tools=None) -> int:
    return len(server.engine.tokenizer.encode_chat(messages, add_generation_prompt=True, tools=tools))


def test_text_reply_non_streamed_and_streamed(text_server):
    client = api(text_server)
    full = client.responses.create(model="m", input="Say hi", instructions="Be brief.", metadata={"k": "v"})
    assert full.object == "response" and full.status == "completed" and full.id.startswith("resp_")
    assert full.output_text == SCRIPT_TEXT and full.instructions == "Be brief."
    assert full.metadata == {"k": "v"}
    (message,) = full.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert full.usage.input_tokens == prompt_tokens(
        text_server, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}])
    assert full.usage.output_tokens == len(text_server.engine.tokenizer.encode(SCRIPT_TEXT,
                                                                               add_special_tokens=False)) + 1
    with client.responses.stream(model="m", input="Say hi", instructions="Be brief.") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-5:] == ["response.output_text.delta", "response.output_text.done",
                          "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == SCRIPT_TEXT
    assert final.output_text == SCRIPT_TEXT and final.usage.input_tokens == full.usage.input_tokens
    assert final.usage.output_tokens == full.usage.output_tokens and final.id == events[0].response.id


def test_max_output_tokens_makes_an_incomplete_response(text_server):
    client = api(text_server)
    short = client.responses.create(model="m", input="Say hi", max_output_tokens=3, store=False)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 3 and SCRIPT_TEXT.startswith(short.output_text)
    with client.responses.stream(model="m", input="Say hi", max_output_tokens=3, store=False) as stream:
        kinds = [e.type for e in stream]
    assert kinds[-1] == "response.incomplete"


def test_function_call_streamed_and_not(call_server):
    client = api(call_server)
    full = client.responses.create(model="m", input="Weather in Zürich?", tools=[WEATHER])
    message, call = full.output
    assert message.type == "message" and message.content[0].text == "Checking."
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Zürich"} and call.status == "completed"
    with client.responses.stream(model="m", input="Weather in Zürich?", tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments == final.output[1].arguments
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[1].name == "get_weather" and final.output[0].content[0].text == "Checking."
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["message", "function_call"]


def test_function_call_output_round_trip_builds_the_chat_prompt(call_server):
    """input = the question, the reply's own output items, then function_call_output: the prompt is
    the chat template's rendering of the same conversation with the tool result."""
    client = api(call_server)
    first = client.responses.create(model="m", input="Weather in Zürich?", tools=[WEATHER], store=False)
    call = first.output[1]
    items = [{"role": "user", "content": "Weather in Zürich?"}, *first.output,  # the SDK's own output objects
             {"type": "function_call_output", "call_id": call.call_id, "output": "21 C, sunny"}]
    second = client.responses.create(model="m", input=items, tools=[WEATHER], tool_choice="none", store=False)
    assert second.output[0].type == "message" and len(second.output) == 1  # tool_choice none: text only
    chat = [{"role": "user", "content": "Weather in Zürich?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "21 C, sunny"}]
    assert second.usage.input_tokens == prompt_tokens(call_server, chat, [CHAT_WEATHER])


def test_previous_response_id_continues_the_stored_conversation(text_server):
    client = api(text_server)
    first = client.responses.create(model="m", input="Hello", instructions="Be brief.")
    second = client.responses.create(model="m", input="And again?", previous_response_id=first.id)
    conversation = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": SCRIPT_TEXT},
                    {"role": "user", "content": "And again?"}]  # instructions are not carried over
    assert second.previous_response_id == first.id and second.instructions is None
    assert second.usage.input_tokens == prompt_tokens(text_server, conversation)
    with client.responses.stream(model="m", input="Third", previous_response_id=second.id) as stream:
        third = stream.get_final_response()
    assert third.usage.input_tokens == prompt_tokens(
        text_server, [*conversation, {"role": "assistant", "content": SCRIPT_TEXT},
                      {"role": "user", "content": "Third"}])
    assert client.responses.retrieve(third.id).output_text == SCRIPT_TEXT  # the streamed one was stored too


def test_store_false_get_and_delete(text_server):
    client = api(text_server)
    kept = client.responses.create(model="m", input="Hello")
    assert client.responses.retrieve(kept.id).model_dump() == kept.model_dump()
    unstored = client.responses.create(model="m", input="Hello", store=False)
    for missing in (unstored.id, "resp_never"):
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(missing)
        assert missing in info.value.body["message"]
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model="m", input="Hi", previous_response_id=unstored.id)
    assert info.value.body["param"] == "previous_response_id"
    assert info.value.body["code"] == "previous_response_not_found"
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(kept.id)
    answer = httpx.get(f"{text_server.base_url}/v1/responses/{unstored.id}?stream=true")
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "stream"


BAD = [
    ({"input": [{"type": "computer_call", "call_id": "c"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "nope", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input[0].name"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input[0].extra"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": 5}]}, "tools[0].parameters"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"input": "hi", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": "nope"}}}, "text"),
    ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": "hi", "include": ["message.output_text.logprobs"]}, "include"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "truncation": "auto"}, "truncation"),
    ({"input": "hi", "seed": 1}, "seed"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": 10_000}, "max_output_tokens"),  # past the context: 400
    ({"input": "x " * 600}, "input"),  # the prompt alone is past max_model_len
    ({}, "input"),
]


@pytest.mark.parametrize("body, param", BAD)
def test_bad_requests_are_400s_naming_the_field(text_server, body, param):
    answer = httpx.post(f"{text_server.base_url}/v1/responses", json={"model": "m", **body}, timeout=60)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_the_official_client_raises_on_a_bad_item(text_server):
    with pytest.raises(openai.BadRequestError) as info:
        api(text_server).responses.create(model="m", input=[{"type": "function_call_output", "output": "x"}])
    assert info.value.body["param"] == "input[0].call_id"


def test_store_is_an_lru_bounded_by_count_and_characters():
    store = ResponseStore(max_responses=3, max_chars=100)
    for i in range(4):
        store.put(f"r{i}", {"id": f"r{i}"}, [{"role": "user", "content": "x" * 10}])
    assert store.get("r0") is None and len(store) == 3  # the count bound: the oldest went
    assert store.get("r1") is not None  # r1 is now the most recent
    store.put("r4", {}, [{"role": "user", "content": "y" * 70}])
    assert store.num_chars <= 100 and store.get("r1") is not None and store.get("r2") is None
    store.put("big", {}, [{"role": "user", "content": "z" * 500}])
    assert len(store) == 1 and store.get("big") is not None  # the newest is kept even past the bound
    assert store.delete("big") and not store.delete("big") and store.num_chars == 0
    with pytest.raises(ValueError):
        ResponseStore(max_responses=0)


def test_schema_route_describes_responses(text_server):
    schema = httpx.get(f"{text_server.base_url}/v1/schema").json()["responses"]
    assert schema["required"] == ["input"] and schema["additionalProperties"] is False
    names = {"input", "previous_response_id", "text", "tools", "max_output_tokens"}
    assert names <= set(schema["properties"])


# ---- the real instruct model ----

@pytest.fixture(scope="module")
def qwen_server():
    with engine.Engine.from_pretrained(qwen_model_path(), max_model_len=1024) as eng:
        with LiveServer(eng) as server:
            yield server


ADD = {"type": "function", "name": "add", "description": "Add two integers",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"]}}


def test_qwen_function_tool_round_trip(qwen_server):
    """function_call -> function_call_output -> the final answer, continued by previous_response_id.
    (The 0.5B model answers a tool result by writing the call out again, so the answer's words are
    not checked: its prompt is, against the chat template's rendering of the whole conversation.)"""
    client = api(qwen_server)
    first = client.responses.create(model="m", input="What is 17 + 25? Use the add tool.", tools=[ADD],
                                    tool_choice="required", temperature=0, max_output_tokens=48)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "add" and first.status == "completed"
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, ADD["parameters"])
    result = arguments["a"] + arguments["b"]
    with client.responses.stream(model="m", previous_response_id=first.id, tools=[ADD], tool_choice="none",
                                 temperature=0, max_output_tokens=32,
                                 input=[{"type": "function_call_output", "call_id": call.call_id,
                                         "output": str(result)}]) as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["message"] and final.output_text.strip()
    assert final.previous_response_id == first.id and final.status in ("completed", "incomplete")
    chat = [{"role": "user", "content": "What is 17 + 25? Use the add tool."},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": "add", "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": str(result)}]
    tools = [{"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}]
    assert final.usage.input_tokens == prompt_tokens(qwen_server, chat, tools)


def test_qwen_json_schema_text_format_validates(qwen_server):
    client = api(qwen_server)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    text = {"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}}
    full = client.responses.create(model="m", input="Describe Paris as JSON.", text=text, temperature=0,
                                   max_output_tokens=64)
    jsonschema.validate(json.loads(full.output_text), schema)
    assert full.text.format.type == "json_schema"
    with client.responses.stream(model="m", input="Describe Paris as JSON.", text=text, temperature=0,
                                 max_output_tokens=64) as stream:
        streamed = stream.get_final_response()
    assert streamed.output_text == full.output_text


def test_parse_maps_onto_the_chat_request():
    """The Responses body -> the chat route's ParsedRequest (what engine.stream_chat receives)."""
    from webapp.responses import parse_responses

    store = ResponseStore()
    req = parse_responses({"input": [{"role": "developer", "content": [{"type": "input_text", "text": "a"},
                                                                     {"type": "input_text", "text": "b"}]},
                                     {"role": "user", "content": "q"}],
                           "instructions": "sys", "text": {"format": {"type": "json_object"}},
                           "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
                           "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9}, store)
    chat = req.chat
    assert chat.is_chat and chat.messages == [{"role": "system", "content": "sys"},
                                              {"role": "developer", "content": "a\nb"},
                                              {"role": "user", "content": "q"}]
    assert chat.params.json_schema == {"type": "object"} and chat.constraint_param == "text.format"
    assert (chat.params.max_tokens, chat.params.temperature, chat.params.top_p) == (7, 0.5, 0.9)
    assert chat.tools == [CHAT_WEATHER] and chat.tool_choice == {"type": "function",
                                                                "function": {"name": "get_weather"}}
    assert req.conversation[0]["role"] == "developer"  # instructions are not part of what is stored
    assert req.settings["tool_choice"] == {"type": "function", "name": "get_weather"}
