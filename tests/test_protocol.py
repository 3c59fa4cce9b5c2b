"""webapp.protocol: request parsing/validation and the plain response builders."""
import json

import pytest

from engine.outputs import TokenLogprob
from webapp import errors, protocol
from webapp.errors import APIError


def chat(**fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(fields)
    return protocol.parse_chat(body)


def completion(**fields):
    body = {"model": "m", "prompt": "hi"}
    body.update(fields)
    return protocol.parse_completion(body)


def error_of(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    assert info.value.status == 400
    return info.value


def test_chat_fields_map_to_sampling_params():
    req = chat(max_tokens=7, temperature=0, top_p=0.5, top_k=3, seed=11, stop="\n", logprobs=True,
               top_logprobs=2, stream=True, stream_options={"include_usage": True}, ignore_eos=True,
               stop_token_ids=[2], include_stop_str_in_output=True, user="ignored", frequency_penalty=0,
               some_future_field={"x": 1}, metadata={"a": "b"}, store=False, response_format={"type": "text"},
               tool_choice="none", tools=[], presence_penalty=0.5, repetition_penalty=1.1, min_p=0.05,
               logit_bias={"15": -100, "16": 2.5}, n=2, min_tokens=1, allowed_token_ids=[1, 2, 15])
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (7, 0, 0.5, 3, 11)
    assert p.stop == ("\n",) and p.stop_token_ids == (2,) and p.ignore_eos and p.include_stop_str_in_output
    assert p.logprobs and p.top_logprobs == 2
    assert (p.presence_penalty, p.repetition_penalty, p.min_p, p.n, p.min_tokens) == (0.5, 1.1, 0.05, 2, 1)
    assert p.logit_bias == {15: -100.0, 16: 2.5} and p.allowed_token_ids == (1, 2, 15)
    assert req.is_stream and req.include_usage
    assert req.messages == [{"role": "user", "content": "hi"}]


def test_defaults_and_aliases():
    req = chat()
    # max_tokens None: the rest of the context
    assert req.params.max_tokens is None and not req.is_stream and not req.include_usage
    assert chat(max_completion_tokens=5, max_tokens=9).params.max_tokens == 5
    assert chat(top_k=-1).params.top_k == 0  # vLLM's "disabled"
    assert not chat(stream_options={"include_usage": True}).include_usage  # only with stream
    assert chat(n=1, stop=None, seed=None).params.stop == ()


def test_completions_max_tokens_defaults_to_16_as_openai():
    assert protocol.parse_completion({"prompt": "a"}).params.max_tokens == 16  # OpenAI's documented default
    assert protocol.parse_completion({"prompt": ["a", "b"]}).params.max_tokens == 16
    assert protocol.parse_completion({"prompt": "a", "max_tokens": None}).params.max_tokens is None  # vLLM
    assert protocol.parse_completion({"prompt": "a", "max_tokens": 40}).params.max_tokens == 40
    assert chat().params.max_tokens is None and chat(max_tokens=None).params.max_tokens is None


def test_content_parts_are_joined_with_newlines():
    req = protocol.parse_chat({"messages": [
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}, {"role": "user", "content": "q"}]})
    assert [m["content"] for m in req.messages] == ["a\nb", "", "q"]  # as in-process (and vLLM)


@pytest.mark.parametrize("fields, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "a\ud800"}]}, "messages[0].content"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**12}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 5.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": "2"}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"presence_penalty": "x"}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": [1]}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": "0.1"}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 1.5}, "min_tokens"),
    ({"logit_bias": "junk"}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -1]}, "allowed_token_ids"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": True, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": -1, "stream": True}, "prompt_logprobs"),
    ({"prompt_logprobs": "2", "stream": True}, "prompt_logprobs"),
    ({"best_of": 2}, "best_of"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}},
     "response_format.json_schema.strict"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "any"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": "no"},
     "parallel_tool_calls"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"guided_json": 5}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_regex": 5}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 1]}, "guided_choice"),
    ({"guided_grammar": ["root ::= 'a'"]}, "guided_grammar"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"guided_json": {}, "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a+", "choice": ["b"]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"whitespace_pattern": " *"}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": "regex"}, "structured_outputs"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"bad_words": "x"}, "bad_words"),
    ({"bad_words": [" "]}, "bad_words"),
    ({"echo": True}, "echo"),
    ({"chat_template": "{{ x }}"}, "chat_template"),
    ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"stop": 5}, "stop"),
    ({"stop": ["a", 1]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"top_logprobs": 50}, "top_logprobs"),
    ({"stream": "true"}, "stream"),
    ({"stream_options": []}, "stream_options"),
    ({"seed": 1.5}, "seed"),
    ({"model": 3}, "model"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
])
def test_chat_bad_input(fields, param):
    err = error_of(chat, **fields)
    assert err.param == param
    assert err.to_dict()["error"]["type"] == "invalid_request_error"
    assert err.message


def test_completion_prompt_forms():
    assert completion(prompt="x").prompt == "x"
    assert completion(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert completion(prompt=["x"]).prompt == "x"
    assert completion(prompt=[[4, 5]]).prompt == [4, 5]
    assert completion(prompt=["a", "b"]).prompts == ["a", "b"]
    assert completion(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    assert completion(prompt=["a", [2, 3]]).prompts == ["a", [2, 3]]
    assert completion(echo=True).is_echo and not completion(add_special_tokens=False).add_special_tokens
    req = completion(logprobs=3)
    assert req.params.logprobs and req.params.top_logprobs == 3
    assert completion(logprobs=0).params.logprobs
    assert not completion().params.logprobs


@pytest.mark.parametrize("fields, param", [
    ({"prompt": ""}, None), ({"prompt": []}, "prompt"), ({"prompt": None}, "prompt"), ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", 5]}, "prompt"), ({"prompt": [1, -2]}, "prompt"), ({"prompt": [1, True]}, "prompt"),
    ({"prompt": [[1], [-2]]}, "prompt[1]"), ({"prompt": ["a"] * 300}, "prompt"),
    ({"prompt": ["a", "b"], "n": 200}, "n"),
    ({"echo": "yes"}, "echo"), ({"echo": 1, "logprobs": 1}, "echo"),
    ({"echo": True, "logprobs": 21}, "logprobs"), ({"echo": True, "logprobs": -1}, "logprobs"),
    ({"echo": True, "logprobs": 1, "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 2, "stream": True, "prompt_logprobs": "1"}, "prompt_logprobs"),
    ({"suffix": 5}, "suffix"),
    ({"suffix": "x", "echo": True}, "suffix"),  # a suffix itself is the model's to refuse (test_infill.py)
    ({"best_of": 3}, "best_of"), ({"logprobs": True}, "logprobs"), ({"logprobs": 21}, "logprobs"),
    ({"add_special_tokens": 1}, "add_special_tokens"), ({"guided_json": []}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs.regex"),
    ({"logit_bias": {"1": 200}}, "logit_bias"),
])
def test_completion_bad_input(fields, param):
    if fields == {"prompt": ""}:  # an empty string is a valid request (the engine adds BOS or rejects)
        assert completion(**fields).prompt == ""
        return
    assert error_of(completion, **fields).param == param


@pytest.mark.parametrize("raw", [b"", b"{", b"[1, 2]", b'"x"', b"\xff\xfe{}", b'{"a": NaN}', b"nul",
                                 b'{"messages": [' * 100000])
def test_decode_body_rejects(raw):
    assert error_of(protocol.decode_body, raw).status == 400


def test_decode_body_accepts_utf8():
    assert protocol.decode_body('{"prompt": "é😀"}'.encode()) == {"prompt": "é😀"}


def test_error_shapes():
    err = errors.overloaded()
    assert err.status == 429 and err.headers["Retry-After"] == "1"
    body = json.loads(err.body())
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert errors.context_length_exceeded("x", "messages").to_dict()["error"]["code"] == "context_length_exceeded"
    assert errors.engine_dead().status == 503 and errors.unauthorized().status == 401
    assert errors.from_http_status(413, "big").to_dict()["error"]["code"] == "request_too_large"


def test_response_builders():
    lp = TokenLogprob(3, "ab", [97, 98], -0.25, [(3, "ab", [97, 98], -0.25), (4, "c", [99], float("-inf"))])

    class Done:
        text, logprobs, finish_reason = "ab", [lp], "stop"

        class usage:
            prompt_tokens, completion_tokens = 5, 1

    Done.index, Done.prompt_logprobs = 0, None
    chat_body = protocol.chat_response("chatcmpl-1", "m", 9, [Done])
    assert chat_body["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert chat_body["choices"][0]["logprobs"]["content"][0]["top_logprobs"][1] == {
        "token": "c", "logprob": -9999.0, "bytes": [99]}
    assert chat_body["usage"] == {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}
    text_body = protocol.text_response("cmpl-1", "m", 9, [Done])
    assert text_body["choices"][0]["logprobs"] == {
        "tokens": ["ab"], "token_logprobs": [-0.25], "top_logprobs": [{"ab": -0.25, "c": -9999.0}],
        "text_offset": [0]}
    json.dumps(chat_body, allow_nan=False)
