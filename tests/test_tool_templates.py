"""Tools in chat templates: a history with tool calls and tool results renders exactly as
transformers renders it (text and, for the Qwen GGUF, token ids), for Qwen2.5's template (the
GGUF's own), Llama 3.1's and Mistral Nemo's (tests/data/templates, from llama.cpp), and the
default model's template, which has no tool support."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from engine.tokenizer import load_tokenizer
from engine.tokenizer.chat_template import render_chat_template
from tests.model_fixtures import qwen_model_path
from tests.server_fixtures import default_tokenizer

TEMPLATES = Path(__file__).parent / "data" / "templates"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOLS = [WEATHER, ADD]


def history(call_ids=("call_1", "call_2"), num_calls: int = 2) -> list[dict]:
    """OpenAI's shapes: arguments as JSON text, content None beside tool calls, tool results by id."""
    calls = [{"id": call_ids[0], "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "unit": "c"}'}},
             {"id": call_ids[1], "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]
    messages = [{"role": "system", "content": "You are helpful."},
                {"role": "user", "content": "Weather in Zürich, and 2+3?"},
                {"role": "assistant", "content": None, "tool_calls": calls[:num_calls]},
                {"role": "tool", "tool_call_id": call_ids[0], "content": '{"temp": 21}'}]
    if num_calls > 1:
        messages.append({"role": "tool", "tool_call_id": call_ids[1], "content": "5"})
    messages += [{"role": "assistant", "content": "21 °C and 5."}, {"role": "user", "content": "Thanks!"}]
    return messages


def as_transformers_serves_it(messages: list[dict]) -> list[dict]:
    """What transformers' own server hands its templates: arguments parsed into objects
    (transformers.cli.serving.utils), keys set to None dropped (apply_chat_template)."""
    out = copy.deepcopy(messages)
    for message in out:
        for call in message.get("tool_calls") or ():
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return out


def oracle(backend=None, bos="<s>", eos="</s>"):
    import transformers  # test-only oracle (requirements-test.txt)
    from tokenizers import Tokenizer, models

    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend or Tokenizer(models.BPE()),
                                                bos_token=bos, eos_token=eos)


@pytest.fixture(scope="module")
def qwen_tokenizer():
    return load_tokenizer(qwen_model_path())


def test_qwen_history_with_tool_calls_matches_transformers_text_and_ids(qwen_tokenizer):
    tok = qwen_tokenizer
    reference = oracle(tok.backend, tok.bos_token, tok.eos_token)
    messages = history()
    for add_generation_prompt in (True, False):
        want_text = reference.apply_chat_template(as_transformers_serves_it(messages), tools=TOOLS,
                                                  chat_template=tok.chat_template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        want_ids = reference.apply_chat_template(as_transformers_serves_it(messages), tools=TOOLS,
                                                 chat_template=tok.chat_template, tokenize=True, return_dict=False,
                                                 add_generation_prompt=add_generation_prompt)
        assert tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=TOOLS) == want_text
        assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=TOOLS) == want_ids
    text = tok.apply_chat_template(messages, tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "c"}}\n</tool_call>' in text
    assert "<tool_response>\n5\n</tool_response>" in text and json.dumps(WEATHER, ensure_ascii=False) in text


def test_qwen_tool_call_token_is_ordinary_text(qwen_tokenizer):
    """<tool_call> is an added token that is not special: decoding keeps it, so the reply is parsed as is."""
    tok = qwen_tokenizer
    ids = tok.encode("<tool_call>", add_special_tokens=False)
    assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == "<tool_call>"


@pytest.mark.parametrize("file, call_ids, num_calls, extra", [
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", ("call_1", "call_2"), 1, {"date_string": "26 Jul 2024"}),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", ("abcDEF123", "XYZ987abc"), 2, {}),
])
def test_llama_and_mistral_templates_match_transformers(file, call_ids, num_calls, extra):
    template = (TEMPLATES / file).read_text()
    messages = history(call_ids, num_calls)
    if "Mistral" in file:  # its template takes no system message in the middle of the roles check
        messages = messages[1:]
    for add_generation_prompt in (True, False):
        want = oracle().apply_chat_template(as_transformers_serves_it(messages), tools=TOOLS, chat_template=template,
                                            tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
        ours = render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token="<s>", eos_token="</s>", tools=TOOLS, **extra)
        assert ours == want
    assert '"get_weather"' in ours


def test_default_model_template_ignores_tools():
    """SmolLM2's template has no tool support: tools are validated but do not reach the prompt
    (as with transformers and vLLM); tool_choice "required" or a named tool still forces a call."""
    tok = default_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    assert tok.encode_chat(messages, tools=TOOLS) == tok.encode_chat(messages)
    # Its template reads message['content'] unconditionally: a tool-call turn renders with content ""
    # (transformers, which drops content None, fails on it instead), the tool results as tool turns.
    messages = history()
    messages[2]["content"] = ""
    want = oracle().apply_chat_template(as_transformers_serves_it(messages), tools=TOOLS,
                                        chat_template=tok.chat_template, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(history(), tools=TOOLS) == want
