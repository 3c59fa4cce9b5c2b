"""Reasoning over HTTP with the official openai client, unchanged: a scripted <think> reply
(ScriptedModel over Qwen3's template) gives ``message.reasoning_content`` and streamed
``delta.reasoning_content``, never in ``content``; tool calls after the reasoning; the Responses
API's reasoning item; ``chat_template_kwargs: {"enable_thinking": false}`` changes the prompt
exactly as transformers renders it (token for token)."""
from __future__ import annotations

import json

import openai
import pytest

from tests.reasoning_fixtures import QWEN3, reasoning_engine, template
from tests.server_fixtures import LiveServer

ASK = [{"role": "user", "content": "What is 2+2?"}]
REASONING = "\nThe user asks 2+2. That is 4.\n"
THOUGHT = f"<think>{REASONING}</think>\n\nIt is 4."
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL_REASONING = "\nI need the weather: <tool_call> comes next.\n"
CALL_REPLY = (f"<think>{CALL_REASONING}</think>\n\n"
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


@pytest.fixture(scope="module")
def server():
    with reasoning_engine(THOUGHT, per_char=True) as eng, LiveServer(eng) as live:
        yield live


@pytest.fixture(scope="module")
def call_server():
    with reasoning_engine(CALL_REPLY) as eng, LiveServer(eng) as live:
        yield live


def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def streamed(chunks) -> tuple[str, str, list, list]:
    reasoning, content, roles, calls = [], [], [], []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            roles.append(delta.role)
            reasoning.append(getattr(delta, "reasoning_content", None) or "")
            content.append(delta.content or "")
            calls.extend(delta.tool_calls or ())
    return "".join(reasoning), "".join(content), roles, calls


def test_non_streamed_message_has_reasoning_content(server):
    full = client(server).chat.completions.create(model="m", messages=ASK, temperature=0)
    message = full.choices[0].message
    assert message.reasoning_content == REASONING  # an extra field: the client keeps it (model_extra)
    assert message.model_extra["reasoning_content"] == REASONING
    assert message.content == "\n\nIt is 4." and full.choices[0].finish_reason == "stop"


def test_streamed_deltas_carry_reasoning_content_never_content(server):
    chunks = list(client(server).chat.completions.create(model="m", messages=ASK, temperature=0, stream=True))
    reasoning, content, roles, _ = streamed(chunks)
    assert reasoning == REASONING and content == "\n\nIt is 4."
    assert roles[0] == "assistant"
    assert not any("think" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    num_reasoning = sum(1 for c in chunks if c.choices and getattr(c.choices[0].delta, "reasoning_content", None))
    assert num_reasoning >= len(REASONING.strip()) // 2  # one character per token: streamed as generated


def test_tool_calls_after_reasoning(call_server):
    api = client(call_server)
    full = api.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], temperature=0)
    message = full.choices[0].message
    assert message.reasoning_content == CALL_REASONING and message.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert full.choices[0].finish_reason == "tool_calls"
    reasoning, content, _, calls = streamed(api.chat.completions.create(model="m", messages=ASK, tools=[WEATHER],
                                                                        temperature=0, stream=True))
    assert reasoning == CALL_REASONING and content == ""
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris"}


def transformers_ids(live: LiveServer, messages, **kwargs) -> list[int]:
    import transformers  # test-only oracle (requirements-test.txt)

    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=live.engine.tokenizer.backend)
    return reference.apply_chat_template(messages, chat_template=template(QWEN3), tokenize=True, return_dict=False,
                                         add_generation_prompt=True, **kwargs)


def prompt_ids(body) -> list[int]:
    """The prompt ids from vLLM's prompt_logprobs (entry 0 is null; each entry holds the prompt token)."""
    return [int(next(iter(entry))) for entry in body.model_extra["prompt_logprobs"][1:]]


def test_enable_thinking_false_gives_transformers_prompt(server):
    api = client(server)
    on = api.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=1,
                                     extra_body={"prompt_logprobs": 0})
    off = api.chat.completions.create(model="m", messages=ASK, temperature=0, max_tokens=1,
                                      extra_body={"prompt_logprobs": 0,
                                                  "chat_template_kwargs": {"enable_thinking": False}})
    want_on, want_off = transformers_ids(server, ASK), transformers_ids(server, ASK, enable_thinking=False)
    assert want_on != want_off
    assert on.usage.prompt_tokens == len(want_on) and prompt_ids(on) == want_on[1:]
    assert off.usage.prompt_tokens == len(want_off) and prompt_ids(off) == want_off[1:]
    tok = server.engine.tokenizer
    assert tok.decode(want_off[len(want_on):], skip_special_tokens=False) == "<think>\n\n</think>\n\n"
    status, body = server.post_json("/tokenize", {"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}})
    assert status == 200 and body["tokens"] == want_off


@pytest.mark.parametrize("kwargs, param", [({"enable_thinkin": False}, "chat_template_kwargs.enable_thinkin"),
                                           ({"messages": []}, "chat_template_kwargs.messages"),
                                           ("enable_thinking", "chat_template_kwargs")])
def test_chat_template_kwargs_errors_are_400s_naming_the_key(server, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        client(server).chat.completions.create(model="m", messages=ASK, extra_body={"chat_template_kwargs": kwargs})
    assert info.value.body["param"] == param


def test_responses_api_reasoning_item(server):
    api = client(server)
    full = api.responses.create(model="m", input="What is 2+2?", temperature=0)
    reasoning, message = full.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", REASONING)]
    assert message.type == "message" and full.output_text == "\n\nIt is 4."
    with api.responses.stream(model="m", input="What is 2+2?", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == REASONING and len(deltas) > 5
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "\n\nIt is 4."
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == REASONING and final.output_text == "\n\nIt is 4."
    # the output sent back as input: the reasoning item becomes the assistant turn's reasoning_content
    items = [item.model_dump(exclude_none=True) for item in full.output]
    again = api.responses.create(model="m", input=[{"role": "user", "content": "What is 2+2?"}, *items,
                                                   {"role": "user", "content": "And 3+3?"}], temperature=0)
    history = [*ASK, {"role": "assistant", "content": "\n\nIt is 4.", "reasoning_content": REASONING},
               {"role": "user", "content": "And 3+3?"}]
    assert again.usage.input_tokens == len(transformers_ids(server, history))
    follow = api.responses.create(model="m", input="And 3+3?", previous_response_id=full.id, temperature=0)
    assert follow.usage.input_tokens == again.usage.input_tokens
    status, body = server.post_json("/v1/responses", {"input": [{"type": "reasoning", "content": []}]})
    assert status == 400 and body["error"]["param"] == "input[0]"
