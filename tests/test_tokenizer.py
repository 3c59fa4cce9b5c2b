"""engine.tokenizer: the default model's tokenizer against llama.cpp's reference, and every source kind."""
from __future__ import annotations

import functools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors

import engine
from engine.tokenizer import Tokenizer, load_tokenizer
from tests.tokenizer_fixtures import DATA, bytes_to_unicode, default_model_path, tiny_bpe_gguf

REFERENCE = json.loads((DATA / "smollm2_llamacpp_greedy.json").read_text(encoding="utf-8"))
SYSTEM_PREFIX = "<|im_start|>system\n"


@functools.cache
def smollm2() -> Tokenizer:
    return load_tokenizer(default_model_path())


def user_message(prompt: str) -> str:
    return prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]


# ------------------------------------------------------------------ the default model vs llama.cpp


@pytest.mark.parametrize("case", REFERENCE, ids=lambda case: case["prompt"][-40:])
def test_default_model_matches_llamacpp(case):
    tok = smollm2()
    assert tok.encode(case["prompt"]) == case["prompt_ids"]
    assert tok.decode(case["greedy_ids"]) == case["greedy_text"]


def test_default_model_chat_template_renders_reference_prompts():
    chat_cases = [case for case in REFERENCE if case["prompt"].startswith(SYSTEM_PREFIX)]
    assert len(chat_cases) == 5 and len(REFERENCE) == 6
    tok = smollm2()
    for case in chat_cases:
        messages = [{"role": "user", "content": user_message(case["prompt"])}]
        assert tok.apply_chat_template(messages, add_generation_prompt=True) == case["prompt"]
        ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
        assert ids == case["prompt_ids"]


def test_default_model_attributes():
    tok = smollm2()
    assert isinstance(tok, engine.Tokenizer) and engine.load_tokenizer is load_tokenizer
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and not tok.add_bos
    assert 2 in tok.eos_token_ids  # <|im_end|>
    assert tok.id_to_token(2) == "<|im_end|>" and tok.id_to_token(10**9) is None
    assert tok.backend is not None and tok.chat_template


def test_special_token_ids_are_exactly_what_decode_drops():
    tok = smollm2()
    ids = list(range(tok.vocab_size))
    kept = tok.backend.decode_batch([[i] for i in ids], skip_special_tokens=True)
    shown = tok.backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
    dropped = {i for i in ids if kept[i] == "" and shown[i] != ""}
    assert dropped == set(tok.special_token_ids)
    assert {0, 1, 2} <= tok.special_token_ids


def test_special_token_text_is_parsed_only_as_whole_tokens():
    tok = smollm2()
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert 1 not in tok.encode("<|im_start", add_special_tokens=False)


def test_encode_batch_and_encode_agree():
    tok = smollm2()
    texts = [case["prompt"] for case in REFERENCE] + ["", " ", "héllo wörld 12345"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]
    assert tok.encode("") == []


def representable(char: str) -> bool:
    """SmolLM2's vocabulary lacks 21 of the 256 byte symbols (e.g. U+0004, and 0xF1-0xF7, lead bytes
    of U+40000 and up); like llama.cpp, encode drops those bytes, so such text cannot round-trip."""
    byte_symbols = bytes_to_unicode()
    return all(smollm2().token_to_id(byte_symbols[b]) is not None for b in char.encode("utf-8"))


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)).filter(representable), max_size=100))
def test_default_model_round_trip(text):
    tok = smollm2()
    # special-token texts in `text` are parsed as special tokens, so render them back
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_default_model_drops_unrepresentable_bytes_like_llamacpp():
    tok = smollm2()
    assert not representable("\x04") and not representable("\U00040000")
    assert tok.encode("\x04", add_special_tokens=False) == []
    assert tok.encode("a\x04b", add_special_tokens=False) == [tok.token_to_id("a"), tok.token_to_id("b")]


def test_decode_edge_ids():
    tok = smollm2()
    assert tok.decode([]) == ""
    assert tok.decode([504, 10**7]) == tok.decode([504])  # unknown ids render as nothing
    with pytest.raises(ValueError, match="non-negative integers"):
        tok.decode([-1])


def test_encode_rejects_non_strings():
    with pytest.raises(ValueError, match="text must be a string"):
        smollm2().encode(b"bytes")
    with pytest.raises(ValueError, match="texts must be a list of strings"):
        smollm2().encode_batch(["a", 3])


# ------------------------------------------------------------------ other sources


def write_hf_dir(directory, backend: HFTokenizer, config: dict | None = None, **json_files) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    backend.save(str(directory / "tokenizer.json"))
    if config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, value in json_files.items():
        (directory / f"{name}.json").write_text(json.dumps(value), encoding="utf-8")


def test_hf_directory(tmp_path):
    template = smollm2().chat_template
    config = {"bos_token": {"content": "<|im_start|>"}, "eos_token": "<|im_end|>", "add_bos_token": True,
              "chat_template": template}
    write_hf_dir(tmp_path / "model", smollm2().backend, config, generation_config={"eos_token_id": [2, 0]})
    tok = load_tokenizer(tmp_path / "model")
    assert tok.bos_token_id == 1 and tok.add_bos
    assert tok.eos_token_ids[:2] == [2, 0]
    assert tok.chat_template == template
    assert tok.encode("Hello") == [1] + smollm2().encode("Hello")
    assert tok.encode(REFERENCE[4]["prompt"], add_special_tokens=False) == REFERENCE[4]["prompt_ids"]
    assert tok.special_token_ids == smollm2().special_token_ids
    # tokenizer.json alone, next to its config, gives the same tokenizer
    same = load_tokenizer(str(tmp_path / "model" / "tokenizer.json"))
    assert (same.bos_token_id, same.add_bos, same.chat_template) == (1, True, template)


def test_hf_directory_template_forms(tmp_path):
    backend = smollm2().backend
    write_hf_dir(tmp_path / "a", backend, {"chat_template": [{"name": "tool_use", "template": "T"},
                                                             {"name": "default", "template": "D"}]})
    assert load_tokenizer(tmp_path / "a").chat_template == "D"
    write_hf_dir(tmp_path / "b", backend, {})
    (tmp_path / "b" / "chat_template.jinja").write_text("J{{ messages[0]['content'] }}", encoding="utf-8")
    tok = load_tokenizer(tmp_path / "b")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "Jx"


def test_hf_directory_config_tokens_and_post_processor_bos(tmp_path):
    backend = HFTokenizer.from_str(smollm2().backend.to_str())
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
    num_ids = backend.get_vocab_size(with_added_tokens=True)
    config = {"added_tokens_decoder": {str(num_ids): {"content": "<|newtool|>", "special": True}}}
    write_hf_dir(tmp_path / "m", backend, config)
    tok = load_tokenizer(tmp_path / "m")
    assert tok.bos_token_id == 1 and tok.add_bos  # found from the post-processor, not a config key
    assert tok.encode("hi") == [1] + smollm2().encode("hi")
    new_id = tok.token_to_id("<|newtool|>")
    assert new_id == num_ids and new_id in tok.special_token_ids and tok.vocab_size == num_ids + 1
    assert tok.encode("a<|newtool|>", add_special_tokens=False)[-1] == new_id


def test_tokenizers_object_source():
    backend = HFTokenizer.from_str(smollm2().backend.to_str())
    tok = load_tokenizer(backend)
    assert tok.backend is backend
    assert tok.encode(REFERENCE[0]["prompt"]) == REFERENCE[0]["prompt_ids"]
    assert tok.bos_token_id is None and not tok.add_bos
    assert {0, 2} <= set(tok.eos_token_ids)  # <|endoftext|>, <|im_end|>: special and end-of-turn texts
    assert load_tokenizer(tok) is tok
    # the stand-in id for bytes SmolLM2 lacks is recognised and dropped from this source too
    assert tok.encode("a\U00040000b", add_special_tokens=False) == smollm2().encode("a\U00040000b")


def test_gguf_source_by_path_string(tmp_path):
    path = tiny_bpe_gguf(tmp_path / "tiny.gguf")
    tok = load_tokenizer(str(path))
    assert tok.encode("hello") == [tok.token_to_id("hello")]


def test_source_errors_name_the_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_tokenizer(tmp_path / "missing.json")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(ValueError, match=r"empty: no tokenizer.json"):
        load_tokenizer(empty_dir)
    bad = tmp_path / "bad" / "tokenizer.json"
    bad.parent.mkdir()
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad/tokenizer.json: not a valid tokenizer.json"):
        load_tokenizer(bad)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00" * 16)
    with pytest.raises(ValueError, match="weights.bin: not a tokenizer source"):
        load_tokenizer(other)
    with pytest.raises(ValueError, match="tokenizer source must be a path"):
        load_tokenizer(42)


def test_config_errors_name_the_field(tmp_path):
    write_hf_dir(tmp_path / "m", smollm2().backend, {"bos_token": "<nope>"})
    with pytest.raises(ValueError, match=r"bos_token '<nope>' is not in the vocabulary"):
        load_tokenizer(tmp_path / "m")
    write_hf_dir(tmp_path / "n", smollm2().backend, None)
    (tmp_path / "n" / "tokenizer_config.json").write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(ValueError, match=r"tokenizer_config.json: expected a JSON object"):
        load_tokenizer(tmp_path / "n")


def test_constructor_validates_ids():
    backend = smollm2().backend
    with pytest.raises(ValueError, match="bos_token_id"):
        Tokenizer(backend, bos_token_id=10**6)
    with pytest.raises(ValueError, match="add_bos"):
        Tokenizer(backend, add_bos=True)
    with pytest.raises(ValueError, match="backend must be a tokenizers.Tokenizer"):
        Tokenizer("not a tokenizer")


def test_against_transformers_oracle():
    import transformers  # test-only oracle (requirements-test.txt)
    tok = smollm2()
    oracle = transformers.PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tok.backend.to_str()))
    texts = [case["prompt"] for case in REFERENCE] + ["Ünïcödé 🤖 and\ttabs\n\nnewlines  ", "x" * 300]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False) == oracle.encode(text, add_special_tokens=False)
    ids = REFERENCE[1]["greedy_ids"] + [1, 2]
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == oracle.decode(ids, skip_special_tokens=skip)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    expected = oracle.apply_chat_template(messages, chat_template=tok.chat_template, tokenize=False,
                                          add_generation_prompt=True)
    assert tok.apply_chat_template(messages) == expected
