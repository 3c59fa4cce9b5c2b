"""cext.chunk: every chunk json.loads to exactly the plain-Python construction (webapp.protocol)."""
import json
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from cext.chunk import DONE, ChunkWriter, clamp_logprob, dumps_str
from engine.outputs import TokenLogprob
from webapp import protocol

# Characters that stress the escaper: quotes, backslashes, every control character,
# DEL, Latin-1, BMP, the U+2028/2029 separators, lone surrogates, emoji (4-byte UTF-8).
TRICKY = ('"\\/' + "".join(map(chr, range(0x20)))
          + "\x7f\x80\xa0é߿ࠀ\u2028\u2029\ufeff\uffff\ud800\udbff\udc00\udfff😀🤖\U0010ffff")
texts = st.text(alphabet=st.one_of(st.sampled_from(TRICKY), st.characters(codec=None)), max_size=40)
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(-50, 0))
byte_lists = st.lists(st.integers(0, 255), max_size=6)
top_entries = st.lists(st.tuples(st.integers(0, 50000), texts, byte_lists, floats), max_size=4)
token_logprobs = st.builds(TokenLogprob, st.integers(0, 50000), texts, byte_lists, floats, top_entries)
logprob_lists = st.one_of(st.none(), st.lists(token_logprobs, max_size=4))
finish_reasons = st.sampled_from([None, "stop", "length", "abort"])


def _load(chunk: bytes) -> dict:
    assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
    body = chunk[len(b"data: "):-2]
    assert b"\n" not in body  # one SSE data line
    return json.loads(body.decode("utf-8"))  # strict UTF-8: no surrogates leaked


@settings(max_examples=2000, deadline=None)
@given(texts)
def test_string_escape_roundtrip(text):
    encoded = dumps_str(text)
    encoded.decode("utf-8")  # always valid UTF-8
    assert json.loads(encoded) == protocol.clean_text(text)
    if not any("\ud800" <= c <= "\udfff" for c in text):
        assert json.loads(encoded) == text


def test_escape_choices():
    assert dumps_str('a"b\\c\n\t\x00\x1f\x7f') == b'"a\\"b\\\\c\\n\\t\\u0000\\u001f\x7f"'
    assert dumps_str("é😀") == '"é😀"'.encode()
    assert dumps_str("\ud83d\ude00") == '"\ufffd\ufffd"'.encode()  # a "pair" of two code points
    assert dumps_str("") == b'""'


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(texts, logprob_lists, finish_reasons), min_size=1, max_size=4),
       texts, texts, st.integers(0, 2**40), st.booleans())
def test_chat_chunks_match_plain_construction(events, request_id, model, created, include_usage):
    writer = ChunkWriter(request_id, model, created, True, include_usage)
    for k, (text, logprobs, finish_reason) in enumerate(events):
        got = _load(writer.event(text, logprobs, finish_reason))
        want = protocol.chat_chunk(request_id, model, created, text, logprobs, finish_reason,
                                   is_first=k == 0, include_usage=include_usage)
        assert got == want


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(texts, logprob_lists, finish_reasons), min_size=1, max_size=4),
       texts, st.integers(0, 2**40), st.booleans())
def test_text_chunks_match_plain_construction(events, model, created, include_usage):
    writer = ChunkWriter("cmpl-1", model, created, False, include_usage)
    offset = 0
    for text, logprobs, finish_reason in events:
        got = _load(writer.event(text, logprobs, finish_reason))
        want = protocol.text_chunk("cmpl-1", model, created, text, logprobs, finish_reason,
                                   text_offset=offset, include_usage=include_usage)
        assert got == want
        offset += sum(len(lp.token) for lp in logprobs or ())


@given(st.integers(0, 2**40), st.integers(0, 2**40), st.booleans())
def test_usage_chunk(prompt_tokens, completion_tokens, is_chat):
    writer = ChunkWriter("id-1", "m", 7, is_chat, True)
    writer.event("x", None, None)
    got = _load(writer.usage(prompt_tokens, completion_tokens))
    assert got == {"id": "id-1", "object": "chat.completion.chunk" if is_chat else "text_completion",
                   "created": 7, "model": "m", "choices": [],
                   "usage": protocol.usage_dict(prompt_tokens, completion_tokens)}
    # the writer is still usable after the usage chunk (buffer prefix intact)
    assert _load(writer.event("y", None, "stop"))["choices"][0]["finish_reason"] == "stop"


def test_role_only_in_first_chat_chunk():
    writer = ChunkWriter("c", "m", 1, True)
    first, second = _load(writer.event("a", None, None)), _load(writer.event("b", None, "stop"))
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert second["choices"][0]["delta"] == {"content": "b"}
    assert "usage" not in second


def test_logprob_clamping_and_float_repr():
    assert clamp_logprob(float("-inf")) == -9999.0
    assert clamp_logprob(float("nan")) == -9999.0
    assert clamp_logprob(float("inf")) == 0.0
    assert clamp_logprob(-1e-300) == -1e-300
    lp = TokenLogprob(5, "x", [120], -0.1 - 1e-17, [(5, "x", [120], 1e-310), (6, "y", [121], float("-inf"))])
    writer = ChunkWriter("c", "m", 1, True)
    chunk = writer.event("x", [lp], None)
    assert b"Infinity" not in chunk and b"NaN" not in chunk
    entry = _load(chunk)["choices"][0]["logprobs"]["content"][0]
    assert entry["logprob"] == lp.logprob and math.copysign(1, entry["logprob"]) == -1
    assert [t["logprob"] for t in entry["top_logprobs"]] == [1e-310, -9999.0]


def test_large_text_grows_buffer():
    text = "\x01" * 100_000 + "é" * 1000
    writer = ChunkWriter("c", "m", 1, False)
    assert _load(writer.event(text, None, None))["choices"][0]["text"] == text
    assert _load(writer.event("small", None, None))["choices"][0]["text"] == "small"


def test_done_marker():
    assert DONE == b"data: [DONE]\n\n"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), texts, logprob_lists, finish_reasons), min_size=1, max_size=8),
       st.booleans(), st.booleans())
def test_interleaved_choices_match_plain_construction(events, is_chat, include_usage):
    """n > 1: each choice has its index, its own first-chunk role and its own text offsets."""
    writer = ChunkWriter("id-1", "m", 3, is_chat, include_usage)
    seen, offsets = set(), {}
    for index, text, logprobs, finish_reason in events:
        got = _load(writer.event(text, logprobs, finish_reason, index))
        if is_chat:
            want = protocol.chat_chunk("id-1", "m", 3, text, logprobs, finish_reason, is_first=index not in seen,
                                       include_usage=include_usage, index=index)
        else:
            want = protocol.text_chunk("id-1", "m", 3, text, logprobs, finish_reason,
                                       text_offset=offsets.get(index, 0), include_usage=include_usage, index=index)
            offsets[index] = offsets.get(index, 0) + sum(len(lp.token) for lp in logprobs or ())
        seen.add(index)
        assert got == want
