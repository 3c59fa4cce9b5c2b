"""Structured output over HTTP, on the real default model: response_format (OpenAI), guided_* and
structured_outputs (vLLM), through the official openai client and raw requests; bad ones are 400s."""
import json
import re

import jsonschema
import openai
import pytest

import engine
from tests.server_fixtures import LiveServer

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


@pytest.fixture(scope="module")
def live():
    with engine.Engine.from_pretrained(max_model_len=1024) as eng, LiveServer(eng) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
        yield c


def test_openai_client_response_format_json_schema_streamed_and_not(client):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    full = client.chat.completions.create(model="default", messages=MESSAGES, response_format=response_format,
                                          max_tokens=100, temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    stream = client.chat.completions.create(model="default", messages=MESSAGES, response_format=response_format,
                                            max_tokens=100, temperature=0, stream=True)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_openai_client_parse_with_pydantic_model(client):
    """client.beta...parse / chat.completions.parse sends a strict json_schema built from a pydantic model."""
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        population: int = Field(ge=0, le=10**8)

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    got = parse(model="default", messages=[{"role": "user", "content": "A city."}], response_format=City,
                max_tokens=60, temperature=0)
    city = got.choices[0].message.parsed
    assert isinstance(city, City) and 0 <= city.population <= 10**8


def test_json_object_gives_a_json_object(client):
    messages = [{"role": "system", "content": 'You reply with one JSON object like {"name": "Ann", "age": 30}.'},
                {"role": "user", "content": "A person."}]
    full = client.chat.completions.create(model="default", messages=messages, max_tokens=80, temperature=0,
                                          response_format={"type": "json_object"})
    assert full.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(full.choices[0].message.content), dict)


@pytest.mark.parametrize("extra, check", [
    ({"guided_json": PERSON}, lambda text: jsonschema.validate(json.loads(text), PERSON)),
    ({"guided_json": json.dumps(PERSON)}, lambda text: jsonschema.validate(json.loads(text), PERSON)),
    ({"guided_regex": r"[A-Z][a-z]+ is [0-9]{1,2}"}, lambda text: re.fullmatch(r"[A-Z][a-z]+ is [0-9]{1,2}", text)),
    ({"guided_choice": ["yes", "no", "maybe"]}, lambda text: text in ("yes", "no", "maybe")),
    ({"guided_grammar": 'root ::= "age: " [0-9] [0-9]?'}, lambda text: re.fullmatch(r"age: [0-9]{1,2}", text)),
    ({"structured_outputs": {"json": PERSON}}, lambda text: jsonschema.validate(json.loads(text), PERSON)),
    ({"structured_outputs": {"regex": r"(red|blue)-[0-9]{3}"}},
     lambda text: re.fullmatch(r"(red|blue)-[0-9]{3}", text)),
    ({"structured_outputs": {"choice": ["A", "B"]}}, lambda text: text in ("A", "B")),
    ({"structured_outputs": {"grammar": 'start: "ok" | "fail"'}}, lambda text: text in ("ok", "fail")),
])
def test_vllm_fields_through_the_openai_client(client, extra, check):
    for kwargs in ({"temperature": 0}, {"temperature": 1.0, "seed": 11}):
        full = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=100, extra_body=extra,
                                              **kwargs)
        text = full.choices[0].message.content
        assert full.choices[0].finish_reason == "stop", text
        assert check(text) is not False, text


def test_completions_endpoint_with_guided_choice_streamed(live):
    status, events = live.stream_events("/v1/completions", {"prompt": "The sky is", "max_tokens": 10, "stream": True,
                                                            "guided_choice": [" blue", " green"], "n": 2, "seed": 3,
                                                            "temperature": 1.0})
    assert status == 200 and events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    for event in events[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert set(texts.values()) <= {" blue", " green"}


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"d": {"type": "string", "format": "not-a-format"}}}}}}, "response_format"),
    ({"guided_json": {"type": "number", "minimum": "zero"}}, "guided_json"),
    ({"guided_regex": "[unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
])
def test_bad_constraints_are_400_naming_the_field(live, client, body, param):
    status, _, raw = live.request("POST", "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 5, **body})
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", error
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=5, extra_body=body)


def test_schema_endpoint_declares_the_structured_fields(live):
    status, _, raw = live.request("GET", "/v1/schema")
    schema = json.loads(raw)
    for endpoint in ("chat", "completions"):
        properties = schema[endpoint]["properties"]
        assert {"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                "structured_outputs"} <= set(properties)
        assert "[request]" in properties["response_format"]["description"]
    formats = [s["properties"]["type"] for s in schema["chat"]["properties"]["response_format"]["anyOf"][:3]]
    assert formats == [{"const": "text"}, {"const": "json_object"}, {"const": "json_schema"}]
