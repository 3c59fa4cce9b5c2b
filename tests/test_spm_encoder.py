"""cext.spm.SpmEncoder: SentencePiece BPE as llama.cpp runs it, in C, for GGUF "llama" vocabularies.

Checked against an independent implementation of the same rule (`tokenizers`' BPE model over every
two-token split ranked by score: gguf_spm.reference_backend, what the engine built before) on the
real vocabularies (Gemma 3's 262k tokens, LLaMA's, Phi-3's), and on tiny vocabularies where
llama.cpp's own tie and fallback rules decide."""
from __future__ import annotations

import copy
import functools
import pickle
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cext.spm import SpmEncoder
from cext.utf8 import TokenKind
from engine.gguf_file import read_gguf_metadata
from engine.tokenizer import load_tokenizer
from engine.tokenizer.gguf_spm import SpmBackend
from engine.tokenizer.token_bytes import TokenPieces
from tests import vocabs
from tests.model_fixtures import GEMMA3_FILE, TESTDATA
from tests.tokenizer_fixtures import tiny_spm_gguf, vocab_data_file

VOCAB_FILES = {"gemma3": TESTDATA / GEMMA3_FILE, "llama-spm": vocab_data_file("ggml-vocab-llama-spm.gguf"),
               "phi-3": vocab_data_file("ggml-vocab-phi-3.gguf")}
ODD_TEXT = list("abc xyz  \n\t.,;<>[]{}()'\"é中文한국어🙂\u3000\u00a0_▁") + ["\U00040fd7", "\U0001d11e", "  ", "\r\n"]


@functools.cache
def pair(name: str):
    """(engine Tokenizer, the reference `tokenizers` backend with merges, the vocabulary's texts)."""
    path = VOCAB_FILES[name]
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make testdata` first")
    tok = load_tokenizer(path)
    tokens = read_gguf_metadata(path)["tokenizer.ggml.tokens"]
    return tok, vocabs.gguf_hf_backend(path), tokens


def random_text(rng: random.Random, tokens: list[str], specials: list[str]) -> str:
    parts = []
    for _ in range(rng.randint(1, 14)):
        r = rng.random()
        if r < 0.55:
            parts.append(rng.choice(tokens).replace("\u2581", " "))
        elif r < 0.65 and specials:
            parts.append(rng.choice(specials))
        else:
            parts.append("".join(rng.choice(ODD_TEXT) for _ in range(rng.randint(1, 6))))
    return "".join(parts)


@pytest.mark.parametrize("name", list(VOCAB_FILES))
def test_encoder_equals_the_merges_implementation_on_real_vocabularies(name):
    tok, reference, tokens = pair(name)
    assert isinstance(tok.backend, SpmBackend)
    specials = [tokens[i] for i in sorted(tok.special_token_ids)][:200] + ["<unk>", "</s>"]
    rng = random.Random(7)
    texts = [random_text(rng, tokens, specials) for _ in range(2000)]
    texts += ["", " ", "  leading", "trailing  ", "\n\n", vocabs.MIXED_TEXT, vocabs.MIXED_TEXT * 20]
    ours = tok.encode_batch(texts, add_special_tokens=False)
    prepare = tok.prepare_text or (lambda text: text)  # Phi-3's ASCII strip after special tokens
    for text, ids in zip(texts, ours):
        assert ids == reference.encode(prepare(text), add_special_tokens=False).ids, repr(text)
        assert tok.encode(text, add_special_tokens=False) == ids


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.lists(st.sampled_from(ODD_TEXT + list("abcdefghij ABC0123<>|/s")), max_size=40).map("".join))
def test_encoder_equals_the_merges_implementation_on_any_text(text):
    for name in ("gemma3", "llama-spm"):
        tok, reference, _ = pair(name)
        assert tok.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("name", ["gemma3", "llama-spm"])
def test_backend_decodes_and_names_ids_as_tokenizers_does(name):
    """The SpmBackend stands in for the `tokenizers` object: the same ids, texts, added tokens and
    decoded text, over every id of the vocabulary."""
    tok, reference, tokens = pair(name)
    backend = tok.backend
    num_ids = len(tokens)
    assert backend.get_vocab_size(True) == reference.get_vocab_size(True) == num_ids
    assert [backend.id_to_token(i) for i in range(num_ids)] == [reference.id_to_token(i) for i in range(num_ids)]
    assert backend.id_to_token(num_ids) is None and backend.id_to_token(-1) is None
    rng = random.Random(3)
    for text in rng.sample(tokens, 3000) + ["no such token", "", "<0x41>"]:
        assert backend.token_to_id(text) == reference.token_to_id(text), text
    ours = {i: (t.content, t.special) for i, t in backend.get_added_tokens_decoder().items()}
    assert ours == {i: (t.content, t.special) for i, t in reference.get_added_tokens_decoder().items()}
    assert ours and {i for i, (_, special) in ours.items() if special} == tok.special_token_ids
    sequences = [rng.sample(range(num_ids), rng.randint(0, 40)) for _ in range(300)]
    sequences += [list(range(3, 300)), [num_ids + 5, 10, 2**31]]
    for ids in sequences:
        for skip in (True, False):
            assert backend.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    with pytest.raises(OverflowError):
        backend.decode([5, -1])
    with pytest.raises(TypeError):
        backend.decode([5, "a"])
    with pytest.raises(ValueError, match="non-negative"):
        tok.decode([5, -1])


@pytest.mark.parametrize("name", ["gemma3", "llama-spm", "phi-3"])
def test_detokenizer_table_from_the_blob_equals_the_generic_one(name):
    """TokenPieces builds an SpmBackend's table with numpy over its UTF-8 blob (no object per id):
    the same bytes, offsets, kinds and texts as the per-token build over the `tokenizers` form."""
    tok, reference, _ = pair(name)
    TokenPieces._cache.pop(tok.backend, None)
    ours, theirs = TokenPieces(tok).table, TokenPieces(reference).table
    assert ours.blob == theirs.blob
    assert ours.offsets.tolist() == theirs.offsets.tolist() and ours.kinds.tolist() == theirs.kinds.tolist()
    assert [ours.text(i) for i in range(ours.num_ids)] == [theirs.text(i) for i in range(theirs.num_ids)]
    assert int((ours.kinds & TokenKind.KIND_BYTE != 0).sum()) == 256


def encoder(tokens, scores, special=(), byte_ids=None, add_space_prefix=False):
    ids = {t: i for i, t in enumerate(tokens)}
    if byte_ids is None:
        byte_ids = [ids.get(f"<0x{b:02X}>", -1) for b in range(256)]
    return SpmEncoder(tokens, np.asarray(scores, dtype=np.float32), np.asarray(special, dtype=np.int32),
                      np.asarray(byte_ids, dtype=np.int32), add_space_prefix)


def test_equal_scores_merge_the_leftmost_pair():
    """llama.cpp's queue: the higher score, then the leftmost pair (not the lower token id, which is
    what the merges-list form ranks by)."""
    tokens = ["a", "b", "c", "bc", "ab"]
    enc = encoder(tokens, [0, 0, 0, -1, -1])
    assert enc.encode("abc") == [4, 2]   # "ab" + "c": the pair at 0 goes first
    assert enc.encode("bcab") == [3, 4]
    enc = encoder(tokens, [0, 0, 0, -1, -2])
    assert enc.encode("abc") == [0, 3]   # "bc" scores higher


def test_a_character_outside_the_vocabulary_still_merges_and_falls_back_to_bytes():
    """llama.cpp merges characters that are not tokens when the pair is one; what is left of them
    comes out as byte tokens, and a byte without one is dropped."""
    tokens = ["a", "aé", "<0xC3>", "<0xA9>"]
    enc = encoder(tokens, [0, -1, 0, 0])
    assert enc.encode("aé") == [1]
    assert enc.encode("éa") == [2, 3, 0]
    assert enc.encode("中") == []  # none of its bytes has a token
    enc = encoder(tokens, [0, -1, 0, 0], byte_ids=[0] * 256)  # every byte falls back to id 0
    assert enc.encode("中") == [0, 0, 0]


def test_special_tokens_leftmost_then_longest_and_space_prefix_per_piece():
    tokens = ["<s>", "<s>x", "▁", "a", "▁a", "x", "s", "<", ">"]
    enc = encoder(tokens, [0, 0, -3, -1, -2, -1, -1, -1, -1], special=[0, 1], add_space_prefix=True)
    assert enc.encode("a<s>xa") == [4, 1, 4]      # "<s>x" is longer than "<s>" at the same place
    assert enc.encode("<s>a<s>") == [0, 4, 0]     # each piece after a special token gets the prefix
    assert enc.encode("a a") == [4, 4]
    assert enc.encode("") == []
    assert enc.encode("s>") == [2, 6, 8]           # not a special token: its characters
    assert enc.encode_batch(["a", "<s>", ""]) == [[4], [0], []]


def test_tiny_vocabulary_file_goes_through_the_encoder(tmp_path):
    tok = load_tokenizer(tiny_spm_gguf(tmp_path / "spm.gguf"))
    assert isinstance(tok.backend, SpmBackend)
    assert [tok.id_to_token(i) for i in tok.encode("abc", add_special_tokens=False)] == ["▁abc"]
    assert tok.encode("</s>ab</s>", add_special_tokens=False) == [2, tok.token_to_id("▁ab"), 2]


def test_tokenizer_survives_deepcopy_and_pickle():
    tok, _, _ = pair("llama-spm")
    text = "Hello <s> world 🙂 中文"
    for copied in (copy.deepcopy(tok), pickle.loads(pickle.dumps(tok))):
        assert isinstance(copied.backend, SpmBackend) and copied.backend is not tok.backend
        assert copied.encode(text) == tok.encode(text)
        assert copied.decode(tok.encode(text)) == tok.decode(tok.encode(text))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="scores"):
        SpmEncoder(["a"], np.zeros(2, np.float32), np.zeros(0, np.int32), np.full(256, -1, np.int32), False)
    with pytest.raises(ValueError, match="byte_ids"):
        SpmEncoder(["a"], np.zeros(1, np.float32), np.zeros(0, np.int32), np.full(256, 5, np.int32), False)
    with pytest.raises(ValueError, match="special_ids"):
        SpmEncoder(["a"], np.zeros(1, np.float32), np.array([3], np.int32), np.full(256, -1, np.int32), False)
    with pytest.raises(ValueError, match="1 to"):
        SpmEncoder([], np.zeros(0, np.float32), np.zeros(0, np.int32), np.full(256, -1, np.int32), False)
    enc = encoder(["a"], [0])
    with pytest.raises(ValueError, match=r"texts\[1\] must be a string"):
        enc.encode_batch(["a", 3])
    with pytest.raises(UnicodeEncodeError):
        enc.encode("\ud800")
