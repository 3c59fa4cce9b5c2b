"""Each model family end to end through the engine (ScriptedModel replies, real tokenizers and
templates): the parser is chosen from the template, and a format marker that is a special
token (Mistral's [TOOL_CALLS]) survives decoding so the call is parsed."""
from __future__ import annotations

import json
from pathlib import Path

import engine
from engine.params import SamplingParams
from engine.testing import ScriptedModel
from engine.tokenizer import Tokenizer, load_tokenizer
from engine.tools import fold_tool_calls
from tests import vocabs
from tests.tokenizer_fixtures import vocab_data_file

TEMPLATES = Path(__file__).parent / "data" / "templates"
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
ASK = [{"role": "user", "content": "2+3?"}]


def family_tokenizer(vocab: str, template_file: str, special: tuple[str, ...] = ()) -> Tokenizer:
    """A vocabulary of llama.cpp's test data with a real template (and extra special tokens)."""
    path = vocab_data_file(f"ggml-vocab-{vocab}.gguf")
    base = load_tokenizer(path)
    backend = vocabs.gguf_hf_backend(path)  # one that encodes (a SentencePiece backend only decodes)
    if special:
        backend = type(backend).from_str(backend.to_str())
        backend.add_special_tokens(list(special))
    return Tokenizer(backend, bos_token_id=base.bos_token_id, eos_token_ids=base.eos_token_ids, add_bos=base.add_bos,
                     chat_template=(TEMPLATES / template_file).read_text(),
                     vocab_size=backend.get_vocab_size(with_added_tokens=True), prepare_text=base.prepare_text)


def reply(tok: Tokenizer, text: str, tools, **params):
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_ids[0]]
    params.setdefault("temperature", 0)  # the script itself: an unseeded draw left it ~1e-4 a token
    with engine.Engine(ScriptedModel(ids, tok.vocab_size), tok, max_model_len=2048) as eng:
        done = eng.chat(ASK, SamplingParams(max_tokens=len(ids) + 2, **params), tools=tools)
        events = list(eng.stream_chat(ASK, SamplingParams(max_tokens=len(ids) + 2, **params), tools=tools))
    assert "".join(e.text for e in events) == done.text  # the events fold to the one-shot reply
    calls = fold_tool_calls([d for e in events for d in e.tool_calls or ()])
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in done.tool_calls or ()]
    return done


def test_llama3_json_reply():
    tok = family_tokenizer("llama-bpe", "meta-llama-Llama-3.1-8B-Instruct.jinja")
    assert "Environment: ipython" in tok.apply_chat_template(ASK, tools=[ADD])  # the template saw the tools
    done = reply(tok, '{"name": "add", "parameters": {"a": 2, "b": 3}}', [ADD])
    assert done.finish_reason == "tool_calls" and done.text == ""
    assert [(c.name, json.loads(c.arguments)) for c in done.tool_calls] == [("add", {"a": 2, "b": 3})]


def test_mistral_marker_is_a_special_token_and_is_kept():
    """Mistral 7B's own vocabulary is this 32k SentencePiece one, with [TOOL_CALLS] a control token."""
    tok = family_tokenizer("llama-spm", "mistralai-Mistral-Nemo-Instruct-2407.jinja", special=("[TOOL_CALLS]",))
    marker_id = tok.token_to_id("[TOOL_CALLS]")
    assert marker_id in tok.special_token_ids and tok.decode([marker_id]) == ""  # dropped by default
    done = reply(tok, 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 2, "b": 3}}]', [ADD])
    assert done.text == "Sure." and done.finish_reason == "tool_calls"
    (call,) = done.tool_calls
    assert call.name == "add" and json.loads(call.arguments) == {"a": 2, "b": 3}
    assert len(call.id) == 9 and call.id.isalnum()  # the template's own id rule
    # the call goes back into the history and renders in Mistral's format
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.to_dict()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "5"}]
    assert f'"id": "{call.id}"' in tok.apply_chat_template(history, tools=[ADD], add_generation_prompt=False)
