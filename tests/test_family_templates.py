"""Each family's own chat template renders exactly as transformers' ``apply_chat_template``
(text, and token ids through a real vocabulary): Qwen3 (enable_thinking on, off, unset; tools;
reasoning_content in a tool-call loop), QwQ, the DeepSeek-R1 distills, SmolLM3, Gemma 2, Phi-3.5
(tests/data/templates, from llama.cpp's models/templates) and the templates inside the GGUF test
vocabularies (Gemma 4, Phi-3; text only: a GGUF vocabulary tokenizes as llama.cpp does, which
strips blanks around some special tokens, Phi-3's <|end|>). A template's own refusal (Gemma's
"System role not supported") is refused by both."""
from __future__ import annotations

import copy

import jinja2
import pytest

from engine.tokenizer import ChatTemplateError, Tokenizer, load_tokenizer
from engine.tokenizer.chat_template import check_template_kwargs
from tests import vocabs
from tests.reasoning_fixtures import tokenizer_with
from tests.test_tool_templates import TOOLS, as_transformers_serves_it, history
from tests.tokenizer_fixtures import vocab_data_file

FILES = ["Qwen-Qwen3-0.6B.jinja", "Qwen-QwQ-32B.jinja", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
         "HuggingFaceTB-SmolLM3-3B.jinja", "google-gemma-2-2b-it.jinja", "microsoft-Phi-3.5-mini-instruct.jinja"]
GGUF_VOCABS = ["ggml-vocab-gemma-4.gguf", "ggml-vocab-phi-3.gguf"]

THOUGHT_TURN = {"role": "assistant", "content": "It is 4.", "reasoning_content": "2+2 is 4."}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "Hi there"}],
    "system": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "  2+2?  "}],
    "think_in_content": [{"role": "user", "content": "2+2?"},
                         {"role": "assistant", "content": "<think>\nadd them\n</think>\n\nIt is 4."},
                         {"role": "user", "content": "and 3+3?"}],
    "reasoning_content": [{"role": "user", "content": "2+2?"}, THOUGHT_TURN],
    # the call's turn with content "" (ours renders content None as ""; transformers hands None to the template)
    "tool_loop": [*[{**m, "content": m["content"] or ""} for m in history()[:4]],
                  {"role": "assistant", "content": "", "reasoning_content": "call done"}],
}


def oracle(tok: Tokenizer, backend=None):
    """transformers' tokenizer over ``backend`` (default: tok's own `tokenizers` backend)."""
    import transformers  # test-only oracle (requirements-test.txt)

    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend or tok.backend,
                                                bos_token=tok.bos_token or "<s>", eos_token=tok.eos_token or "</s>")


def with_own_tokens(tok: Tokenizer) -> Tokenizer:
    """``tok`` with bos/eos the oracle also has (a vocabulary without BOS renders the oracle's "<s>")."""
    return Tokenizer(tok.backend, bos_token_id=tok.bos_token_id or tok.token_to_id("<s>"),
                     eos_token_ids=tok.eos_token_ids, add_bos=False, chat_template=tok.chat_template)


def tokenizers():
    for name in FILES:
        yield name, lambda name=name: with_own_tokens(tokenizer_with(name))
    for name in GGUF_VOCABS:
        yield name, lambda name=name: load_tokenizer(vocab_data_file(name))


def thinking_options(tok: Tokenizer) -> list[dict]:
    try:
        check_template_kwargs(tok.chat_template, {"enable_thinking": True})
    except ChatTemplateError:
        return [{}]
    return [{}, {"enable_thinking": True}, {"enable_thinking": False}]


def render_both(tok, reference, messages, tools, kwargs, add_generation_prompt, is_ids_compared=True):
    """(ours, transformers') as (text, ids), or the exception type each raised."""
    try:
        ours = (tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs),
                tok.encode_chat(messages, add_generation_prompt, tools=tools, chat_template_kwargs=kwargs))
    except ChatTemplateError:
        ours = ChatTemplateError
    theirs_messages = as_transformers_serves_it(copy.deepcopy(messages))
    try:
        text = reference.apply_chat_template(theirs_messages, chat_template=tok.chat_template, tools=tools,
                                             tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
        ids = reference.apply_chat_template(theirs_messages, chat_template=tok.chat_template, tools=tools,
                                            tokenize=True, return_dict=False,
                                            add_generation_prompt=add_generation_prompt, **kwargs)
        theirs = (text, ids if is_ids_compared else tok.encode(text, add_special_tokens=False))
    except (jinja2.TemplateError, ValueError, TypeError):
        theirs = ChatTemplateError
    return ours, theirs


@pytest.mark.parametrize("name, make", list(tokenizers()), ids=[n for n, _ in tokenizers()])
def test_template_renders_as_transformers(name, make):
    tok = make()
    # A GGUF SentencePiece vocabulary's backend is ours (gguf_spm.SpmBackend): transformers gets its
    # `tokenizers` form.
    reference = oracle(tok, vocabs.gguf_hf_backend(vocab_data_file(name)) if name in GGUF_VOCABS else None)
    num_rendered = 0
    for label, messages in CONVERSATIONS.items():
        for tools in (None, TOOLS):
            for kwargs in thinking_options(tok):
                for add_generation_prompt in (True, False):
                    ours, theirs = render_both(tok, reference, messages, tools, kwargs, add_generation_prompt,
                                               is_ids_compared=name not in GGUF_VOCABS)
                    assert ours == theirs, (label, tools is not None, kwargs, add_generation_prompt)
                    num_rendered += ours is not ChatTemplateError
    assert num_rendered >= 4  # every template renders some of them (Gemma 2 refuses system turns, ...)


def test_qwen3_enable_thinking_and_reasoning_content():
    tok = tokenizer_with("Qwen-Qwen3-0.6B.jinja")
    ask = CONVERSATIONS["user"]
    on = tok.apply_chat_template(ask)
    assert tok.apply_chat_template(ask, enable_thinking=False) == on + "<think>\n\n</think>\n\n"
    assert tok.apply_chat_template(ask, enable_thinking=True) == on
    # reasoning of the turn after the last user message is rendered, of earlier turns dropped
    loop = tok.apply_chat_template(CONVERSATIONS["reasoning_content"], add_generation_prompt=False)
    assert loop.endswith("<|im_start|>assistant\n<think>\n2+2 is 4.\n</think>\n\nIt is 4.<|im_end|>\n")
    earlier = tok.apply_chat_template(CONVERSATIONS["think_in_content"])
    assert "add them" not in earlier and "<|im_start|>assistant\nIt is 4.<|im_end|>" in earlier


def test_reasoning_content_must_be_a_string_of_an_assistant():
    tok = tokenizer_with("Qwen-Qwen3-0.6B.jinja")
    for messages in ([{"role": "user", "content": "x", "reasoning_content": "y"}],
                     [{"role": "assistant", "content": "x", "reasoning_content": 3}]):
        with pytest.raises(ChatTemplateError) as info:
            tok.apply_chat_template(messages)
        assert info.value.param == "messages[0].reasoning_content"
