"""GGUF vocabularies -> tokenizers: llama.cpp's own tokenizer test vectors, and synthetic files."""
from __future__ import annotations

import functools
import json
import os

import gguf
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine.gguf_file import read_gguf_metadata
from engine.tokenizer import load_tokenizer
from engine.tokenizer.gguf import TokenType, load_gguf_vocab
from engine.tokenizer.gguf_bpe import PRE_NAMES, split_merge
from engine.tokenizer.gguf_spm import spm_merges
from tests.tokenizer_fixtures import (
    DATA,
    default_model_path,
    read_vocab_tests,
    tiny_bpe_gguf,
    tiny_spm_gguf,
    vocab_data_file,
    write_gguf,
)

# Every BPE/SPM/WordPiece vocabulary of llama.cpp's test data with .inp/.out vectors, and what we expect.
REQUIRED = ["gpt-2", "llama-spm", "qwen2", "bert-bge"]
ALSO_PASSING = ["command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "llama-bpe", "mpt", "phi-3",
                "qwen35", "refact", "starcoder"]


@functools.cache
def vocab_tokenizer(name: str):
    return load_tokenizer(vocab_data_file(f"ggml-vocab-{name}.gguf"))


@pytest.mark.parametrize("name", REQUIRED + ALSO_PASSING)
def test_llamacpp_vectors(name):
    tok = vocab_tokenizer(name)
    mismatches = []
    for text, expected in read_vocab_tests(name):
        ids = tok.encode(text, add_special_tokens=False)
        if ids != expected:
            mismatches.append((text, ids, expected))
    assert not mismatches, f"{len(mismatches)} texts differ, first: {mismatches[0]!r}"


def test_unsupported_vocab_types_fail_clearly(tmp_path):
    path = write_gguf(tmp_path / "t5.gguf", model="t5", tokens=["<pad>", "</s>", "\u2581a"])  # Unigram: not yet
    with pytest.raises(ValueError, match="tokenizer.ggml.model 't5' is not supported") as info:
        load_tokenizer(path)
    assert str(path) in str(info.value)


def test_all_vocab_vectors_are_classified():
    names = {p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in vocab_data_file("VERSION").parent.glob("*.inp")}
    assert names == set(REQUIRED) | set(ALSO_PASSING)


# deepseek-coder is left out: its user-defined tokens "õ", "÷", ... are raw text that the byte-level
# decoder maps to single bytes, so "õ" encodes to one token that decodes to U+FFFD (as in HF).
@pytest.mark.parametrize("name", ["gpt-2", "qwen2", "llama-bpe", "command-r"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=80))
@example(text="<|endoftext|>x")
def test_byte_level_round_trip(name, text):
    tok = vocab_tokenizer(name)
    # special-token texts in `text` are parsed as special tokens, so render them back
    assert tok.decode(tok.encode(text, add_special_tokens=False), skip_special_tokens=False) == text


def test_byte_fallback_for_characters_outside_the_vocabulary():
    tok = vocab_tokenizer("llama-spm")
    ids = tok.encode("\U0001d11e", add_special_tokens=False)  # MUSICAL SYMBOL G CLEF, 4 UTF-8 bytes
    assert [tok.id_to_token(i) for i in ids] == ["▁", "<0xF0>", "<0x9D>", "<0x84>", "<0x9E>"]
    assert tok.decode(ids) == "\U0001d11e"


def test_spm_space_prefix_after_special_tokens():
    tok = vocab_tokenizer("llama-spm")
    ids = tok.encode("Hello</s>Hello", add_special_tokens=True)
    assert ids[0] == tok.bos_token_id == 1 and tok.add_bos
    hello = tok.encode("Hello", add_special_tokens=False)
    assert ids == [1] + hello + [2] + hello  # llama.cpp prefixes a space after a special token too


CORPUS = json.loads((DATA / "llamacpp_tokenize_corpus.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(CORPUS["ids"]))
def test_llamacpp_random_corpus(name):
    """Random texts (special-token texts, odd whitespace, unassigned code points) tokenized by llama.cpp."""
    tok = vocab_tokenizer(name)
    got = tok.encode_batch(CORPUS["texts"], add_special_tokens=False)
    mismatches = [(text, ids, expected) for text, ids, expected in zip(CORPUS["texts"], got, CORPUS["ids"][name])
                  if ids != expected]
    assert not mismatches, f"{len(mismatches)} texts differ, first: {mismatches[0]!r}"


def test_eog_texts_become_control_tokens_as_in_llamacpp():
    tok = vocab_tokenizer("qwen2")  # "</s>" is an ordinary BPE token in this file
    assert tok.encode("a</s>", add_special_tokens=False) == [64, 128247]
    assert 128247 in tok.special_token_ids and 128247 in tok.eos_token_ids
    assert tok.eos_token_ids[0] == 151643  # the header's eos first


def test_llama_bpe_adds_bos_by_default():
    tok = vocab_tokenizer("llama-bpe")  # no add_bos_token key; llama.cpp defaults to true for llama3
    assert tok.add_bos and tok.encode("a")[0] == tok.bos_token_id == 128000


# Expected ids below come from llama.cpp itself (llama_tokenize, parse_special=true) on these vocabularies.

def test_phi3_rstrips_ascii_whitespace_after_special_tokens():
    tok = vocab_tokenizer("phi-3")  # llama.cpp sets RSTRIP on its special tokens because of the model name
    assert tok.encode("<|user|>  Hello", add_special_tokens=False) == [32010, 15043]
    assert tok.encode("<|user|>\u00a0Hello", add_special_tokens=False) == [32010, 20246, 10994]  # not ASCII
    assert tok.encode("<s>  Hello", add_special_tokens=False) == [1, 259, 15043]  # <s> keeps its spaces
    assert tok.encode("</s>\n\nHi", add_special_tokens=False) == [2, 6324]
    assert tok.encode("Hi <|end|>\r\n", add_special_tokens=False) == [6324, 29871, 32007]


def test_missing_byte_symbol_blocks_merges_and_is_dropped():
    tok = vocab_tokenizer("starcoder")  # lacks the byte symbol of 0xF1, the lead byte of U+40FD7
    assert tok.encode("\u060c\U00040fd7*", add_special_tokens=False) == [39024, 246, 161, 269, 47]
    assert max(tok.encode("\U00040fd7" * 3, add_special_tokens=False)) < tok.vocab_size


def test_deepseek_llm_non_ascii_whitespace_is_only_whitespace():
    tok = vocab_tokenizer("deepseek-llm")  # U+3000 matches \s but none of the explicit ranges
    assert tok.encode("    \u3000_", add_special_tokens=False) == [251, 88946, 62]
    assert tok.encode("a  \u3000", add_special_tokens=False) == [64, 243, 88946]
    assert tok.encode("中\u3000文", add_special_tokens=False) == [764, 88946, 1930]


# ------------------------------------------------------------------ header reader


def test_metadata_reader_matches_gguf_package():
    path = vocab_data_file("ggml-vocab-gpt-2.gguf")
    ours = read_gguf_metadata(path)
    reader = gguf.GGUFReader(os.fspath(path))
    assert set(ours) == {key for key in reader.fields if not key.startswith("GGUF.")}
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                "tokenizer.ggml.pre", "tokenizer.ggml.bos_token_id"):
        assert ours[key] == reader.fields[key].contents(), key


def test_metadata_reader_rejects_non_gguf_and_truncated(tmp_path):
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(not_gguf)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty.gguf: not a GGUF file"):
        read_gguf_metadata(empty)
    whole = vocab_data_file("ggml-vocab-gpt-2.gguf").read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(whole[:5000])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf_metadata(truncated)
    # a string array whose count does not fit in a C ssize_t (found by the fuzz test): a clean
    # refusal naming the count, not an OverflowError from the C loop
    import struct

    key = b"tokenizer.ggml.tokens"
    huge = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<IIQ", 9, 8, 2 ** 63 + 5) + b"\0" * 64)
    bad = tmp_path / "huge_array.gguf"
    bad.write_bytes(huge)
    with pytest.raises(ValueError, match=r"truncated at byte \d+: an array of 9223372036854775813 strings"):
        read_gguf_metadata(bad)


# ------------------------------------------------------------------ synthetic vocabularies


def test_tiny_bpe_token_types_and_special_parsing(tmp_path):
    tok = load_tokenizer(tiny_bpe_gguf(tmp_path / "bpe.gguf"))
    assert tok.vocab_size == 2 + 256 + 9
    hello, world = tok.token_to_id("hello"), tok.token_to_id("Ġworld")
    assert tok.encode("hello world", add_special_tokens=False) == [hello, world]
    # control and user-defined tokens are parsed out of the text
    assert tok.encode("hello<|end|><tool>", add_special_tokens=False) == [hello, 0, 1]
    # control tokens are special (dropped by decode), user-defined ones are not
    assert tok.special_token_ids == frozenset({0})
    assert tok.decode([hello, 0, 1]) == "hello<tool>"
    assert tok.decode([hello, 0, 1], skip_special_tokens=False) == "hello<|end|><tool>"
    assert tok.bos_token_id == 0 and tok.eos_token_ids == [0] and not tok.add_bos
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "user:hi<|end|>"


def test_tiny_bpe_add_bos_flag(tmp_path):
    tok = load_tokenizer(tiny_bpe_gguf(tmp_path / "bpe.gguf", add_bos=True))
    assert tok.add_bos
    assert tok.encode("hello") == [0, tok.token_to_id("hello")]
    assert tok.encode("hello", add_special_tokens=False) == [tok.token_to_id("hello")]


def test_unknown_pre_tokenizer_is_named(tmp_path):
    path = tiny_bpe_gguf(tmp_path / "bpe.gguf", pre="klingon-bpe")
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre 'klingon-bpe' is not a supported pre-tokenizer"):
        load_tokenizer(path)


@pytest.mark.parametrize("pre", sorted(PRE_NAMES))
def test_every_known_pre_tokenizer_builds(tmp_path, pre):
    tok = load_tokenizer(tiny_bpe_gguf(tmp_path / "bpe.gguf", pre=pre))
    assert tok.decode(tok.encode("hello world 123 ¿qué?\n", add_special_tokens=False)) == "hello world 123 ¿qué?\n"


def test_missing_pre_uses_llamacpp_default(tmp_path):
    tok = load_tokenizer(tiny_bpe_gguf(tmp_path / "bpe.gguf", pre=None))
    assert tok.decode(tok.encode("hello, world!", add_special_tokens=False)) == "hello, world!"


def test_missing_merges_and_tokens_are_named(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.ggml.merges is missing"):
        load_tokenizer(write_gguf(tmp_path / "a.gguf", model="gpt2", pre="gpt-2", tokens=["a", "b"]))
    with pytest.raises(ValueError, match="tokenizer.ggml.tokens is missing"):
        load_tokenizer(write_gguf(tmp_path / "b.gguf", model="gpt2", pre="gpt-2"))
    with pytest.raises(ValueError, match="no embedded vocabulary"):
        load_tokenizer(write_gguf(tmp_path / "c.gguf", chat_template="x"))


def test_merge_lines_split_at_first_inner_space():
    assert split_merge("Ġ t") == ("Ġ", "t")
    assert split_merge("  a") == (" ", "a")  # a merge whose left part is a space, as llama.cpp reads it
    with pytest.raises(ValueError, match="no space"):
        split_merge("ab")


def test_tiny_spm_merges_follow_scores(tmp_path):
    tok = load_tokenizer(tiny_spm_gguf(tmp_path / "spm.gguf"))
    ids = tok.encode("abc", add_special_tokens=False)
    # "▁a" (-5) beats "ab" (-6), then "▁ab" (-7), then "▁abc" (-8): one token.
    assert [tok.id_to_token(i) for i in ids] == ["▁abc"]
    assert [tok.id_to_token(i) for i in tok.encode("ba", add_special_tokens=False)] == ["▁", "b", "a"]
    assert tok.encode("d", add_special_tokens=False) == [tok.token_to_id("▁"), 3 + 0x64]  # byte fallback
    assert tok.add_bos and tok.encode("a")[0] == 1
    assert tok.special_token_ids == frozenset({0, 1, 2})
    assert tok.decode(tok.encode("ab abc d")) == "ab abc d"


def test_tiny_spm_without_space_prefix(tmp_path):
    tok = load_tokenizer(tiny_spm_gguf(tmp_path / "spm.gguf", add_space_prefix=False, add_bos=False))
    assert [tok.id_to_token(i) for i in tok.encode("ab")] == ["ab"]
    assert tok.decode(tok.encode(" ab")) == " ab"


def _two_token_splits(tokens: list[str], skip) -> tuple[list, list, list, list]:
    """The definition cext.gguf_strings.two_token_splits implements, in Python."""
    first_id = {}
    for token_id, text in enumerate(tokens):
        first_id.setdefault(text, token_id)
    lefts, rights, ids, splits = [], [], [], []
    for token_id, text in enumerate(tokens):
        if skip[token_id]:
            continue
        for split in range(1, len(text)):
            left, right = text[:split], text[split:]
            if left in first_id and right in first_id:
                lefts.append(first_id[left])
                rights.append(first_id[right])
                ids.append(token_id)
                splits.append(split)
    return lefts, rights, ids, splits


def test_spm_splits_in_c_and_in_python_agree():
    """The C loop (cext.gguf_strings.two_token_splits) and its definition in Python give the same
    splits, in the same order, on a real SentencePiece vocabulary."""
    import numpy as np

    from cext.gguf_strings import two_token_splits
    from engine.gguf_file import read_gguf_metadata as read_metadata
    from engine.tokenizer.gguf import llamacpp_special_tokens, token_types, unique_token_texts

    md = read_metadata(vocab_data_file("ggml-vocab-llama-spm.gguf"))
    tokens = unique_token_texts(md["tokenizer.ggml.tokens"])
    types, _ = llamacpp_special_tokens(md, tokens, token_types(md, len(tokens)))
    skip = np.array([t == TokenType.BYTE for t in types], dtype=np.uint8)
    in_c = [a.tolist() for a in two_token_splits(tokens, skip)]
    assert in_c == list(_two_token_splits(tokens, skip)) and len(in_c[0]) > 50_000
    lefts, rights, ids, splits = in_c
    scores = np.asarray(md["tokenizer.ggml.scores"], dtype=np.float64)
    by_definition = np.lexsort((np.asarray(splits), np.asarray(ids), -scores[np.asarray(ids)]))  # -score, id, split
    assert spm_merges(tokens, md["tokenizer.ggml.scores"], types) == [
        (tokens[lefts[i]], tokens[rights[i]]) for i in by_definition]
    from cext.gguf_strings import pairs_in_order

    ids = np.array([0], dtype=np.int64)
    with pytest.raises(IndexError, match="order\\[1\\] = 5"):
        pairs_in_order(["a"], ids, ids, np.array([0, 5], dtype=np.int64))
    with pytest.raises(IndexError, match="ids 0, 7"):
        pairs_in_order(["a"], ids, np.array([7], dtype=np.int64), np.array([0], dtype=np.int64))
    # Multi-byte characters split only between characters; a repeated text finds its first id.
    tokens = ["ab", "a", "b", "\u2581\u00e9", "\u2581", "\u00e9", "a", "\u00e9\u2581"]
    skip = np.zeros(len(tokens), dtype=np.uint8)
    skip[2] = 1
    in_c = [a.tolist() for a in two_token_splits(tokens, skip)]
    assert in_c == list(_two_token_splits(tokens, skip)) == [[1, 4, 5], [2, 5, 4], [0, 3, 7], [1, 1, 1]]
    with pytest.raises(ValueError, match="skip has 2 entries for 8 tokens"):
        two_token_splits(tokens, skip[:2])


def test_spm_merges_ranked_by_merged_score():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    merges = spm_merges(tokens, scores, [TokenType.NORMAL] * 6)
    assert merges == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


def test_gemma4_flags():
    tok = vocab_tokenizer("gemma-4")
    assert tok.add_bos and tok.bos_token_id == 2
    assert {1, 106} <= set(tok.eos_token_ids)  # <eos>, <turn|>
    ids = tok.encode("Hi  there\n\n\tok", add_special_tokens=False)
    assert tok.decode(ids) == "Hi  there\n\n\tok"


def test_default_model_vocabulary():
    vocab = load_gguf_vocab(default_model_path())
    assert vocab.vocab_size == 49152
    assert vocab.bos_token_id == 1 and not vocab.add_bos
    # llama.cpp's end-of-generation set: eos <|im_end|>, the FIM repo token <reponame>, <|endoftext|>
    assert vocab.eos_token_ids == [2, 4, 0]
    assert vocab.chat_template.startswith("{% for message in messages %}")
    assert [vocab.backend.id_to_token(i) for i in (0, 1, 2)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_token_types_are_llamacpp_s():
    assert {t.name: int(t) for t in TokenType if t != TokenType.UNDEFINED} == {t.name: int(t) for t in gguf.TokenType}
