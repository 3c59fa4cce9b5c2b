"""Tokenizer.encode_chat: the one chat prompt path (in-process and over HTTP), one message check."""
from __future__ import annotations

import pytest

from engine.errors import InvalidParameterError
from engine.params import SamplingParams
from engine.tokenizer import ChatTemplateError, load_tokenizer, validate_messages
from tests.server_fixtures import default_tokenizer, scripted_engine
from tests.tokenizer_fixtures import tiny_bpe_gguf
from webapp import create_app, protocol

CONVERSATION = [
    {"role": "developer", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Line one"}, {"type": "text", "text": "line two"}]},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                           "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "content": "42", "tool_call_id": "c1"},
    {"role": "user", "content": "Thanks."},
]
# The same conversation as plain strings and the role the template knows.
PLAIN = [{**m, "role": "system" if m["role"] == "developer" else m["role"]} for m in CONVERSATION]
PLAIN[1] = {"role": "user", "content": "Line one\nline two"}
PLAIN[2] = {**PLAIN[2], "content": ""}


def test_encode_chat_is_template_then_encode_without_bos(tmp_path):
    for tok in (default_tokenizer(), load_tokenizer(tiny_bpe_gguf(tmp_path / "bpe.gguf", add_bos=True))):
        for add_generation_prompt in (True, False):
            text = tok.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
            ids = tok.encode_chat(CONVERSATION, add_generation_prompt=add_generation_prompt)
            assert ids == tok.encode(text, add_special_tokens=False)
    assert tok.add_bos and ids[:1] != [tok.bos_token_id]  # a template writes its own BOS


def test_joiner_and_developer_role_render_as_vllm():
    tok = default_tokenizer()  # SmolLM2's template knows system, not developer
    assert tok.encode_chat(CONVERSATION) == tok.encode_chat(PLAIN)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in tok.apply_chat_template(CONVERSATION)
    assert "Line one\nline two" in tok.apply_chat_template(CONVERSATION)


def test_a_template_that_knows_developer_gets_it(tmp_path):
    knows = "{% for m in messages %}{% if m.role == 'developer' %}D:{% else %}{{ m.role }}:{% endif %}" \
            "{{ m.content }};{% endfor %}"
    tok = load_tokenizer(tiny_bpe_gguf(tmp_path / "bpe.gguf", chat_template=knows))
    messages = [{"role": "developer", "content": "hello"}, {"role": "system", "content": "world"}]
    assert tok.apply_chat_template(messages) == "D:hello;system:world;"


def test_http_parsing_gives_the_same_prompt_ids():
    tok = default_tokenizer()
    parsed = protocol.parse_chat({"model": "m", "messages": CONVERSATION})
    assert parsed.messages == validate_messages(CONVERSATION)
    assert tok.encode_chat(parsed.messages) == tok.encode_chat(CONVERSATION)


def test_server_and_engine_count_the_same_prompt():
    eng = scripted_engine(max_model_len=512)
    try:
        completion = eng.chat(CONVERSATION, SamplingParams(max_tokens=2, temperature=0))
        assert completion.prompt_token_ids == eng.tokenizer.encode_chat(CONVERSATION)
        client = create_app(eng).test_client()
        resp = client.post("/v1/chat/completions", json={"model": "m", "messages": CONVERSATION, "max_tokens": 2})
        assert resp.status_code == 200
        assert resp.get_json()["usage"]["prompt_tokens"] == len(completion.prompt_token_ids)
    finally:
        eng.close()


def test_tools_reach_the_template(tmp_path):
    template = "{% if tools %}T={{ tools | tojson }};{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    tok = load_tokenizer(tiny_bpe_gguf(tmp_path / "bpe.gguf", chat_template=template))
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], tools=tools) == \
        'T=[{"type": "function", "function": {"name": "f"}}];x'
    assert tok.encode_chat([{"role": "user", "content": "x"}], tools=tools) == \
        tok.encode('T=[{"type": "function", "function": {"name": "f"}}];x', add_special_tokens=False)
    with pytest.raises(ChatTemplateError) as info:
        tok.encode_chat([{"role": "user", "content": "x"}], tools="f")
    assert info.value.param == "tools"


@pytest.mark.parametrize("messages, param", [
    ("hello", "messages"),
    ([], "messages"),
    (["hi"], "messages[0]"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": "a"}, {"role": "wizard", "content": "x"}], "messages[1].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": "a\ud800"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}], "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}], "messages[0].content[0].text"),
])
def test_errors_are_typed_and_name_the_field(messages, param):
    with pytest.raises(ChatTemplateError) as info:
        default_tokenizer().encode_chat(messages)
    assert isinstance(info.value, InvalidParameterError) and isinstance(info.value, ValueError)
    assert info.value.param == param
    with pytest.raises(protocol.APIError) as http:  # the server reports the same field
        protocol.parse_chat({"messages": messages})
    assert http.value.status == 400 and http.value.param == param


def test_template_failures_blame_the_messages(tmp_path):
    raises = "{{ raise_exception('roles must alternate') }}"
    tok = load_tokenizer(tiny_bpe_gguf(tmp_path / "bpe.gguf", chat_template=raises))
    with pytest.raises(ChatTemplateError, match="roles must alternate") as info:
        tok.encode_chat([{"role": "user", "content": "x"}])
    assert info.value.param == "messages"
    surrogate_name = [{"role": "user", "content": "x", "name": "\ud800"}]
    named = load_tokenizer(tiny_bpe_gguf(tmp_path / "named.gguf", chat_template="{{ messages[0].name }}"))
    with pytest.raises(ChatTemplateError) as info:
        named.encode_chat(surrogate_name)
    assert info.value.param == "messages"
