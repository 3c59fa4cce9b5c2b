"""engine.tokenizer.chat_template: message validation, the jinja2 sandbox, HF template helpers, transformers parity."""
from __future__ import annotations

import pytest

from engine.tokenizer.chat_template import ChatTemplateError, render_chat_template, validate_messages

SIMPLE = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}" \
         "{% if add_generation_prompt %}[assistant]{% endif %}"

# A Llama-3 style template: bos_token, trimmed blocks, tojson, raise_exception, loop controls.
LLAMA3_STYLE = """{{ bos_token }}
{% if messages[0]['role'] == 'system' %}
    {% set system = messages[0]['content'] %}
    {% set messages = messages[1:] %}
{% else %}
    {% set system = '' %}
{% endif %}
{% if tools is not none %}
{{ '<|tools|>' + tools | tojson + '\n' }}
{% endif %}
{{ '<|system|>' + system + '<|eot_id|>' }}
{% for message in messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {% endif %}
    {{ '<|' + message['role'] + '|>' + message['content'] | trim + '<|eot_id|>' }}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|assistant|>' }}
{% endif %}"""


def render(template, messages, **kwargs):
    return render_chat_template(template, messages, **kwargs)


def user(text):
    return {"role": "user", "content": text}


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("messages, match", [
    ("hello", r"messages must be a list"),
    ([], r"at least one message"),
    (["hi"], r"messages\[0\] must be an object"),
    ([{"content": "x"}], r"messages\[0\]\.role must be one of system, developer, user, assistant, tool; got None"),
    ([user("a"), {"role": "wizard", "content": "x"}], r"messages\[1\]\.role .* got 'wizard'"),
    ([{"role": "user"}], r"messages\[0\]\.content is missing"),
    ([{"role": "user", "content": 5}], r"messages\[0\]\.content must be a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[0\]\.content\[0\]\.type must be 'text', got 'image_url'"),
    ([{"role": "user", "content": [{"type": "text", "text": None}]}],
     r"messages\[0\]\.content\[0\]\.text must be a string"),
    ([{"role": "user", "content": ["x"]}], r"messages\[0\]\.content\[0\] must be an object"),
])
def test_invalid_messages_name_the_field(messages, match):
    with pytest.raises(ValueError, match=match):
        render(SIMPLE, messages)


def test_validation_error_is_a_value_error():
    assert issubclass(ChatTemplateError, ValueError)


def test_content_parts_become_text():
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    assert render(SIMPLE, [{"role": "user", "content": parts}]) == "[user]one\ntwo[assistant]"


CALL = {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, "x"]}'}}


def test_assistant_tool_calls_without_content():
    messages = [user("q"), {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "content": "42", "tool_call_id": "1"}]
    checked = validate_messages(messages)
    assert checked[1]["content"] == ""
    # arguments as JSON text become the object templates serialize (transformers' server does this)
    assert checked[1]["tool_calls"] == [{**CALL, "function": {"name": "f", "arguments": {"a": [1, "x"]}}}]
    assert validate_messages(checked) == checked
    assert messages[1]["content"] is None and isinstance(CALL["function"]["arguments"], str)  # caller's dicts kept
    assert render(SIMPLE, messages, add_generation_prompt=False) == "[user]q[assistant][tool]42"


def test_keys_set_to_none_are_dropped():
    checked = validate_messages([{"role": "user", "content": "q", "name": None, "tool_calls": None}])
    assert checked == [{"role": "user", "content": "q"}]


@pytest.mark.parametrize("message, param", [
    ({"role": "assistant", "content": None, "tool_calls": {"id": "1"}}, "messages[0].tool_calls"),
    ({"role": "assistant", "content": None, "tool_calls": [3]}, "messages[0].tool_calls[0]"),
    ({"role": "assistant", "content": None, "tool_calls": [{**CALL, "type": "code"}]},
     "messages[0].tool_calls[0].type"),
    ({"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}, "messages[0].tool_calls[0].function"),
    ({"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]},
     "messages[0].tool_calls[0].function.name"),
    ({"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{x"}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "assistant", "content": None, "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "[1]"}}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"role": "user", "content": "q", "tool_calls": [CALL]}, "messages[0].tool_calls"),
    ({"role": "tool", "content": "42"}, "messages[0].tool_call_id"),
    ({"role": "tool", "content": "42", "tool_call_id": 7}, "messages[0].tool_call_id"),
])
def test_bad_tool_messages_name_the_field(message, param):
    with pytest.raises(ChatTemplateError) as info:
        validate_messages([message])
    assert info.value.param == param


# ------------------------------------------------------------------ rendering


def test_generation_prompt_flag_and_special_tokens():
    template = "{{ bos_token }}" + SIMPLE + "{{ eos_token }}"
    assert render(template, [user("hi")], bos_token="<s>", eos_token="</s>") == "<s>[user]hi[assistant]</s>"
    assert render(template, [user("hi")], add_generation_prompt=False) == "[user]hi"


def test_missing_template():
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render(None, [user("hi")])


def test_raise_exception_becomes_a_clear_error():
    with pytest.raises(ChatTemplateError, match="rejected the messages: Conversation roles must alternate"):
        render(LLAMA3_STYLE, [user("a"), user("b")])


def test_syntax_error():
    with pytest.raises(ChatTemplateError, match="not valid jinja2"):
        render("{% for m in messages %}", [user("a")])


def test_runtime_error_in_template():
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        render("{{ messages[0]['content'] + 1 }}", [user("a")])


@pytest.mark.parametrize("template", [
    "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "{{ ''.__class__.__base__.__subclasses__() }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'system'}) }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
])
def test_sandbox_blocks_unsafe_templates(template):
    with pytest.raises(ChatTemplateError):
        render(template, [user("a")])


def test_sandbox_hides_internals():
    # An unsafe attribute is undefined (renders empty) and any use of it raises.
    assert render("{{ raise_exception.__globals__ }}", [user("a")]) == ""
    with pytest.raises(ChatTemplateError, match="unsafe"):
        render("{{ raise_exception.__globals__['os'] }}", [user("a")])


def test_helpers_tojson_strftime_loopcontrols_generation():
    template = ("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|"
                "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}|"
                "{% generation %}gen{% endgeneration %}")
    out = render(template, [user("héllo"), user("second")])
    assert out == '[{"role": "user", "content": "héllo"}, {"role": "user", "content": "second"}]|4|héllo|gen'


def test_trim_and_lstrip_blocks():
    assert render("  {% if true %}\nA\n  {% endif %}\nB", [user("x")]) == "A\nB"


def test_extra_variables_reach_the_template():
    out = render(LLAMA3_STYLE, [user("hi")], bos_token="<B>", tools=[{"name": "f"}])
    assert out.startswith("<B>\n<|tools|>[{\"name\": \"f\"}]\n")
    assert out.endswith("<|user|>hi<|eot_id|>\n<|assistant|>\n")
    assert "<|tools|>" not in render(LLAMA3_STYLE, [user("hi")])  # tools defaults to None


@pytest.mark.parametrize("template", [SIMPLE, LLAMA3_STYLE])
def test_matches_transformers(template):
    import transformers  # test-only oracle (requirements-test.txt)
    from tokenizers import Tokenizer, models

    oracle = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), bos_token="<s>",
                                                  eos_token="</s>")
    messages = [{"role": "system", "content": "Be brief. "}, user("Hi  "),
                {"role": "assistant", "content": "Hello!"}, user("Café ☕?")]
    for add_generation_prompt in (True, False):
        expected = oracle.apply_chat_template(messages, chat_template=template, tokenize=False,
                                              add_generation_prompt=add_generation_prompt)
        ours = render(template, messages, add_generation_prompt=add_generation_prompt, bos_token="<s>",
                      eos_token="</s>", tools=None)
        assert ours == expected


# ------------------------------------------------------------------ real templates vs transformers

CONVERSATIONS = [
    [user("What is 2+2?")],
    [{"role": "system", "content": "Be brief."}, user("Hi"), {"role": "assistant", "content": "Hello!"},
     user("Café ☕ — naïve?")],
]


def gguf_template(name: str) -> str:
    from engine.gguf_file import read_gguf_metadata
    from tests.tokenizer_fixtures import default_model_path, vocab_data_file

    path = default_model_path() if name == "smollm2" else vocab_data_file(f"ggml-vocab-{name}.gguf")
    return read_gguf_metadata(path)["tokenizer.chat_template"]


@pytest.mark.parametrize("name", ["smollm2", "command-r", "gemma-4", "phi-3", "qwen2", "qwen35"])
def test_model_file_templates_match_transformers(name):
    import transformers  # test-only oracle (requirements-test.txt)
    from tokenizers import Tokenizer, models

    template = gguf_template(name)
    oracle = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), bos_token="<B>",
                                                  eos_token="<E>")
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = oracle.apply_chat_template(messages, chat_template=template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
            ours = render(template, messages, add_generation_prompt=add_generation_prompt, bos_token="<B>",
                          eos_token="<E>")
            assert ours == expected
