"""Invariant 1 (byte-exact incremental detokenization) against `tokenizers`' own decode."""
import functools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer, TokenPieces
from tests import vocabs

REAL_VOCABS = {"smollm2": vocabs.smollm2, "qwen": vocabs.qwen, "llama_spm": vocabs.llama_spm}
MORE_VOCABS = {"qwen2_gguf": vocabs.qwen2_gguf}
SYNTHETIC = ["spm", "spm_strip2", "metaspace", "metaspace_never", "wordpiece", "none", "strip_per_token"]
ALL_VOCABS = dict(REAL_VOCABS, **MORE_VOCABS, synthetic_byte_level=vocabs.synthetic_byte_level)
ALL_VOCABS.update({f"synthetic_{name}": functools.partial(vocabs.synthetic_spm, name) for name in SYNTHETIC})


def detokenize(tok, ids, skip_special_tokens):
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    return [d.add(i) for i in ids] + [d.finish()]


@functools.cache
def id_pools(name):
    """Ids to over-represent: byte tokens and pieces that are not valid UTF-8 alone, specials, real text."""
    tok = ALL_VOCABS[name]()
    pieces = TokenPieces(tok)
    fragments = [i for i in range(pieces.num_ids) if not _is_valid(pieces.bytes_of(i))]
    specials = sorted(pieces.special_token_ids) or [0]
    backend = vocabs.backend_of(tok)
    text_ids = vocabs.encode_ids(tok, vocabs.MIXED_TEXT)
    return pieces.num_ids, fragments or [0], specials, text_ids, char_byte_runs(backend)


def char_byte_runs(backend):
    """Characters spelled one byte token each (<0xNN> or a byte-level single byte), when the vocab has them."""
    runs = []
    for char in "aé你한😀🇰‍":
        for spell in (lambda b: f"<0x{b:02X}>", lambda b: vocabs.byte_level_str(bytes([b]))):
            ids = [backend.token_to_id(spell(b)) for b in char.encode()]
            if None not in ids:
                runs.append(ids)
                break
    return runs or [[0]]


def _is_valid(piece):
    try:
        piece.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


@st.composite
def id_sequences(draw, name):
    num_ids, fragments, specials, text_ids, runs = id_pools(name)
    ids = []
    for _ in range(draw(st.integers(0, 10))):
        choice = draw(st.integers(0, 10))
        if choice < 3:
            ids.append(draw(st.integers(0, num_ids - 1)))
        elif choice < 5:  # a run of byte / partial-character tokens
            ids.extend(draw(st.lists(st.sampled_from(fragments), min_size=1, max_size=6)))
        elif choice < 7:  # whole characters spelled in byte tokens, maybe cut short
            run = [i for r in draw(st.lists(st.sampled_from(runs), min_size=1, max_size=3)) for i in r]
            ids.extend(run[: draw(st.integers(1, len(run)))])
        elif choice < 9:
            ids.append(draw(st.sampled_from(specials)))
        else:  # a slice of real multilingual text
            start = draw(st.integers(0, len(text_ids) - 1))
            ids.extend(text_ids[start : start + draw(st.integers(1, 12))])
    return ids


def make_invariant_test(name, max_examples):
    @settings(max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(data=st.data())
    def test(data):
        tok = ALL_VOCABS[name]()
        ids = data.draw(id_sequences(name))
        backend = vocabs.backend_of(tok)
        for skip in (True, False):
            assert "".join(detokenize(tok, ids, skip)) == backend.decode(ids, skip_special_tokens=skip)
            # At every step: released text + what is held (peek) == decode of the ids so far.
            d, released = IncrementalDetokenizer(tok, skip_special_tokens=skip), ""
            for k, token_id in enumerate(ids, 1):
                released += d.add(token_id)
                assert released + d.peek() == backend.decode(ids[:k], skip_special_tokens=skip)

    return test


for _name in ALL_VOCABS:
    globals()[f"test_invariant_{_name}"] = make_invariant_test(_name, 250 if _name in REAL_VOCABS else 100)


@pytest.mark.parametrize("name", list(ALL_VOCABS))
def test_path_is_chosen_from_the_decoder(name):
    is_generic = name in ("synthetic_wordpiece", "synthetic_none", "synthetic_strip_per_token")
    assert IncrementalDetokenizer(ALL_VOCABS[name]()).is_fast is not is_generic


NAMED_TEXTS = {
    "korean": "안녕하세요, 반갑습니다. 한국어 텍스트입니다.",
    "cjk": "你好，世界。東京は晴れです。中文和日本語。",
    "emoji_zwj_flags": "👨‍👩‍👧‍👦 👩🏽‍💻 🏳️‍🌈 🇰🇷🇯🇵🇺🇸 ❤️‍🔥",
    "combining_marks": "e\u0301 a\u0308 n\u0303 Z\u0357\u0350\u034ca\u0352l\u0357g\u0350o \u1100\u1161\u11a8",
    "mixed": vocabs.MIXED_TEXT,
}


@pytest.mark.parametrize("text_name", list(NAMED_TEXTS))
@pytest.mark.parametrize("name", list(REAL_VOCABS))
def test_named_texts_round_trip(name, text_name):
    tok = REAL_VOCABS[name]()
    backend = vocabs.backend_of(tok)
    text = NAMED_TEXTS[text_name]
    ids = vocabs.encode_ids(tok, text)
    expected = backend.decode(ids)
    assert "".join(detokenize(tok, ids, True)) == expected
    assert expected.strip() == text.strip()


@pytest.mark.parametrize("name", ["smollm2", "qwen"])
def test_byte_level_releases_all_but_an_incomplete_character(name):
    """On real text, after every token all text is out except a character still missing bytes."""
    tok = REAL_VOCABS[name]()
    pieces = TokenPieces(tok)
    ids = vocabs.encode_ids(tok, vocabs.MIXED_TEXT)
    d = IncrementalDetokenizer(tok)
    released, seen = "", b""
    num_held_steps = 0
    for token_id in ids:
        released += d.add(token_id)
        seen += pieces.bytes_of(token_id)
        complete = next(seen[: len(seen) - k] for k in range(4) if _is_valid(seen[: len(seen) - k]))
        assert released == complete.decode("utf-8")
        num_held_steps += len(complete) < len(seen)
    assert num_held_steps > 0  # the text does split characters across tokens
    assert d.finish() == ""


def test_byte_fallback_only_text_is_held_until_the_run_ends():
    tok = vocabs.llama_spm()
    backend = vocabs.backend_of(tok)
    ids = vocabs.encode_ids(tok, "🙂🙂")  # no piece in the vocabulary: 8 byte tokens
    assert len(ids) >= 8
    d = IncrementalDetokenizer(tok)
    assert [d.add(i) for i in ids] == [""] * len(ids)
    assert d.finish() == backend.decode(ids)
    word = vocabs.encode_ids(tok, " ok")
    d = IncrementalDetokenizer(tok)
    out = [d.add(i) for i in ids + word]
    assert out[len(ids)].startswith(backend.decode(ids)) and "".join(out) + d.finish() == backend.decode(ids + word)


@pytest.mark.parametrize("name", list(REAL_VOCABS))
def test_stream_ending_mid_character(name):
    tok = REAL_VOCABS[name]()
    backend = vocabs.backend_of(tok)
    if name == "llama_spm":
        tail, expected_tail = ["<0xE4>", "<0xBD>"], "\ufffd\ufffd"  # an unfinished run: every byte token
    else:
        tail, expected_tail = [vocabs.byte_level_str("你".encode()[:2])], "\ufffd"  # one maximal subpart
    ids = vocabs.encode_ids(tok, "ok") + [backend.token_to_id(t) for t in tail]
    out = detokenize(tok, ids, True)
    assert out[-1] == expected_tail  # held until finish(), then rendered as decode renders it
    assert "".join(out) == backend.decode(ids) == "ok" + expected_tail


def test_special_tokens_both_ways():
    tok = vocabs.qwen()
    ids = [151644] + vocabs.encode_ids(tok, "hi 你") + [151645]
    assert "".join(detokenize(tok, ids, True)) == "hi 你"
    assert "".join(detokenize(tok, ids, False)) == "<|im_start|>hi 你<|im_end|>"


def test_strip_only_at_start_of_whole_output():
    tok = vocabs.synthetic_spm("spm")
    backend = vocabs.backend_of(tok)
    vocab = backend.get_vocab()
    ids = [vocab["<s>"], vocab["\u2581hello"], vocab["<x>"], vocab["\u2581world"]]
    assert "".join(detokenize(tok, ids, True)) == "hello<x> world" == backend.decode(ids)
    assert ("".join(detokenize(tok, ids, False)) == "<s> hello<x> world"
            == backend.decode(ids, skip_special_tokens=False))


class WrappedTokenizer:
    """Stands in for engine.tokenizer.Tokenizer: the detokenizer reads only `.backend`."""

    def __init__(self, backend):
        self.backend = backend


def test_accepts_wrapper_and_caches_pieces():
    backend = vocabs.backend_of(vocabs.smollm2())
    pieces = TokenPieces(backend)
    assert TokenPieces(WrappedTokenizer(backend)) is pieces
    d = IncrementalDetokenizer(WrappedTokenizer(backend), skip_special_tokens=False)
    assert d.add(1) == "<|im_start|>"


def test_table_is_rebuilt_when_tokens_are_added():
    tok = vocabs.synthetic_byte_level()
    backend = vocabs.backend_of(tok).from_str(vocabs.backend_of(tok).to_str())  # a private copy
    before = TokenPieces(backend)
    backend.add_tokens(["<new>"])
    new_id = backend.token_to_id("<new>")
    after = TokenPieces(backend)
    assert after is not before and after.bytes_of(new_id) == b"<new>"
    assert "".join(detokenize(backend, [new_id], True)) == "<new>"


def test_token_pieces_bytes_and_text():
    qwen = TokenPieces(vocabs.qwen())
    backend = vocabs.backend_of(vocabs.qwen())
    ni = backend.token_to_id("\u0120hi")  # byte-level "Ġhi"
    assert qwen.bytes_of(ni) == b" hi" and qwen.text_of(ni) == " hi"
    partial = backend.token_to_id(vocabs.byte_level_str("你".encode()[:2]))
    assert qwen.bytes_of(partial) == b"\xe4\xbd" and qwen.text_of(partial) == "\ufffd"
    assert qwen.bytes_of(151644) == b"<|im_start|>"
    spm = TokenPieces(vocabs.llama_spm())
    spm_backend = vocabs.backend_of(vocabs.llama_spm())
    assert spm.bytes_of(spm_backend.token_to_id("<0xE4>")) == b"\xe4"
    assert spm.text_of(spm_backend.token_to_id("<0xE4>")) == "\ufffd"
    assert spm.bytes_of(spm_backend.token_to_id("\u2581the")) == b" the"
    assert qwen.bytes_of(10**7) == b"" and qwen.text_of(-5) == ""
    generic = TokenPieces(vocabs.synthetic_spm("wordpiece"))
    assert generic.bytes_of(generic.backend.token_to_id("hello")) == b"hello"


class TextsTokenizer(WrappedTokenizer):
    """A wrapper that also hands TokenPieces an id -> text list (Tokenizer.token_texts)."""

    def __init__(self, backend, token_texts):
        super().__init__(backend)
        self.token_texts = token_texts


def _fresh_pieces(tokenizer) -> TokenPieces:
    TokenPieces._cache.pop(tokenizer.backend, None)
    return TokenPieces(tokenizer)


def _table_state(pieces: TokenPieces) -> tuple:
    table = pieces.table
    return (table.blob, table.offsets.tolist(), table.kinds.tolist(), [table.text(i) for i in range(table.num_ids)],
            [pieces.text_of(i) for i in range(table.num_ids)])


@pytest.mark.parametrize("name", ["llama_spm", "qwen2_gguf"])
def test_table_from_the_loaders_texts_equals_the_backends(name):
    """The GGUF loader hands its token list to TokenPieces (no id_to_token call per id): the
    table is the one the backend's own texts give, and a list that disagrees with the backend at
    a checked id or has the wrong length is not used."""
    tok = getattr(vocabs, name)()
    assert tok.token_texts is not None and len(tok.token_texts) == tok.backend.get_vocab_size(True)
    reference = _table_state(_fresh_pieces(WrappedTokenizer(tok.backend)))
    assert _table_state(_fresh_pieces(tok)) == reference
    for wrong in (["x"] + tok.token_texts[1:], tok.token_texts[:-1], ["x"] * len(tok.token_texts)):
        assert _table_state(_fresh_pieces(TextsTokenizer(tok.backend, wrong))) == reference
    TokenPieces._cache.pop(tok.backend, None)


def test_token_pieces_forms():
    """cext.utf8.token_pieces: ByteFallback's token forms (as `tokenizers` parses them), unknown
    ids, replaces in order, and ByteLevel pieces that are not valid UTF-8."""
    import numpy as np

    from cext.utf8 import TokenKind, token_pieces

    tokens = ["<0x01>", "<0x41>", "<0xfF>", "<0x+A>", "<0xg1>", "<0x0A", "<0x+AB>", None, "\u2581a\u2581"]
    kinds = np.zeros(len(tokens), dtype=np.uint8)
    kinds[1] = TokenKind.KIND_SPECIAL
    pieces, strict, texts = token_pieces(tokens, (("\u2581", " "), ("  ", "!")), True, None, kinds)
    assert pieces == [b"\x01", b"A", b"\xff", b"\n", b"<0xg1>", b"<0x0A", b"<0x+AB>", b"", b" a "]
    assert strict == [None, None, None, None, "<0xg1>", "<0x0A", "<0x+AB>", "", " a "]
    assert texts == ["\x01", "A", "\ufffd", "\n", "<0xg1>", "<0x0A", "<0x+AB>", "", " a "]
    byte, special, unknown = TokenKind.KIND_BYTE, TokenKind.KIND_SPECIAL, TokenKind.KIND_UNKNOWN
    assert kinds.tolist() == [byte, byte | special, byte, byte, 0, 0, 0, unknown, 0]
    kinds = np.zeros(2, dtype=np.uint8)
    pieces, strict, texts = token_pieces(["<0x41>", "ab"], (), False, lambda t: t.encode()[:1] + b"\xe4", kinds)
    assert pieces == [b"<\xe4", b"a\xe4"] and strict == [None, None] and texts == ["<\ufffd", "a\ufffd"]
    assert kinds.tolist() == [0, 0]
    with pytest.raises(ValueError, match="kinds has 1 entries for 2 tokens"):
        token_pieces(["a", "b"], (), False, None, kinds[:1])


def test_skip_special_tokens_must_be_bool():
    with pytest.raises(ValueError, match="skip_special_tokens"):
        IncrementalDetokenizer(vocabs.smollm2(), skip_special_tokens="yes")
    with pytest.raises(ValueError, match="tokenizer"):
        TokenPieces(object())


def test_long_random_streams_match_decode():
    """Longer streams than hypothesis draws, all vocabularies, both skip settings."""
    rng = random.Random(1234)
    for name in ALL_VOCABS:
        tok = ALL_VOCABS[name]()
        backend = vocabs.backend_of(tok)
        num_ids, fragments, specials, text_ids, _ = id_pools(name)
        for _ in range(3):
            ids = [rng.choice((rng.randrange(num_ids), rng.choice(fragments), rng.choice(specials),
                               rng.choice(text_ids)))
                   for _ in range(400)]
            for skip in (True, False):
                assert "".join(detokenize(tok, ids, skip)) == backend.decode(ids, skip_special_tokens=skip), name


def test_add_bound_before_the_first_token_still_renders_metaspace_right():
    tok = vocabs.synthetic_spm("metaspace")
    backend = vocabs.backend_of(tok)
    vocab = backend.get_vocab()
    ids = [vocab["<s>"], vocab["\u2581hello"], vocab["\u2581world"], vocab["\u2581\u2581"]]
    d = IncrementalDetokenizer(tok)
    add = d.add  # engines often keep the bound method
    assert "".join(add(i) for i in ids) + d.finish() == backend.decode(ids) == "hello world  "


def test_qwen_vocab_from_tiktoken_encodes_like_llama_cpp():
    """tests/vocabs.py's merges-from-ranks rebuild of qwen.tiktoken tokenizes llama.cpp's test texts exactly."""
    texts = (vocabs.TESTDATA / "ggml-vocab-qwen2.gguf.inp").read_text().split("\n__ggml_vocab_test__\n")
    expected = (vocabs.TESTDATA / "ggml-vocab-qwen2.gguf.out").read_text().split("\n")
    backend = vocabs.backend_of(vocabs.qwen())
    assert len(texts) > 30
    for text, ids in zip(texts, expected):
        assert backend.encode(text, add_special_tokens=False).ids == [int(i) for i in ids.split()], text
    gguf = vocabs.backend_of(vocabs.qwen2_gguf())
    for token_id in range(0, 151643, 997):  # the same vocabulary: same pieces
        assert TokenPieces(gguf).bytes_of(token_id) == TokenPieces(backend).bytes_of(token_id)


def test_pieces_cache_does_not_keep_a_tokenizer_alive():
    import gc
    import weakref

    backend = vocabs.backend_of(vocabs.synthetic_byte_level())
    copy = backend.from_str(backend.to_str())
    TokenPieces(copy)
    ref = weakref.ref(copy)
    del copy
    gc.collect()
    assert ref() is None


LLAMA_CPP_VOCABS = [
    "aquila", "baichuan", "command-r", "deepseek-coder", "deepseek-llm", "falcon", "gpt-2", "gpt-neox",
    "llama-bpe", "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder",
]


@pytest.mark.parametrize("vocab_name", LLAMA_CPP_VOCABS)
def test_every_llama_cpp_vocab_the_engine_loads(vocab_name):
    """Invariant 1 for each llama.cpp test vocabulary through engine.tokenizer.load_tokenizer."""
    from engine.tokenizer import load_tokenizer

    path = vocabs.TESTDATA / f"ggml-vocab-{vocab_name}.gguf"
    assert path.exists(), f"{path} is missing: run `make testdata`"
    tok = load_tokenizer(str(path))
    pieces = TokenPieces(tok)
    assert pieces.is_fast  # byte-level BPE or SentencePiece byte fallback: all on the table path
    fragments = [i for i in range(pieces.num_ids) if pieces.table.text(i) is None] or [0]
    specials = sorted(pieces.special_token_ids) or [0]
    rng = random.Random(vocab_name)
    for _ in range(40):
        pools = (range(pieces.num_ids), fragments, specials)
        ids = [rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            assert "".join(detokenize(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)
