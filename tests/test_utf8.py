"""cext.utf8 against plain references: Python's UTF-8 codec and a Python model of ByteFallback."""
import codecs

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cext.utf8 import DecodeMode, TokenKind, TokenTable, Utf8Tracker

# Fragments that stress boundaries: lead bytes alone, truncated sequences, overlongs,
# surrogates, out-of-range code points, stray continuation bytes.
FRAGMENTS = [
    b"\xc2", b"\xdf", b"\xe0", b"\xe0\xa0", b"\xe0\x80", b"\xed", b"\xed\xa0", b"\xed\x9f",
    b"\xf0", b"\xf0\x90", b"\xf0\x8f", b"\xf0\x9f\x98", b"\xf4\x8f\xbf", b"\xf4\x90", b"\xf5",
    b"\xc0\xaf", b"\x80", b"\xbf", b"\xff", "é".encode(), "你".encode(), "😀".encode(), b"a",
]
pieces_strategy = st.lists(
    st.lists(st.one_of(st.binary(max_size=3), st.sampled_from(FRAGMENTS)), max_size=4).map(b"".join),
    max_size=12,
)


def is_incomplete_char(tail: bytes) -> bool:
    """Whether tail is a proper prefix of the UTF-8 encoding of some code point."""
    second = [b""] if len(tail) > 1 else [b"\x80", b"\xa0"]  # 0x80 or 0xA0 fits every lead's first range
    for s in second:
        for length in range(len(tail) + 1, 5):
            candidate = (tail + s + b"\x80\x80\x80")[:length]
            try:
                if len(candidate.decode("utf-8")) == 1:
                    return True
            except UnicodeDecodeError:
                pass
    return False


def num_incomplete(data: bytes) -> int:
    return next((k for k in (3, 2, 1) if len(data) >= k and is_incomplete_char(data[-k:])), 0)


@settings(max_examples=600, deadline=None)
@given(pieces_strategy)
def test_bytes_mode_matches_python_codec(pieces):
    tracker = Utf8Tracker()
    released, seen = "", b""
    for piece in pieces:
        released += tracker.push(piece)
        seen += piece
        # Released as soon as it can no longer change: all but an incomplete last character.
        assert released == seen[: len(seen) - num_incomplete(seen)].decode("utf-8", errors="replace")
        assert tracker.num_held_bytes == num_incomplete(seen)
        assert tracker.peek() == ("\ufffd" if num_incomplete(seen) else "")
    released += tracker.finish()
    assert released == seen.decode("utf-8", errors="replace")
    # Python's own incremental decoder agrees on the whole (it may hold invalid bytes longer).
    reference = codecs.getincrementaldecoder("utf-8")(errors="replace")
    assert "".join(reference.decode(p) for p in pieces) + reference.decode(b"", final=True) == released


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64))
def test_bytes_mode_one_buffer_and_byte_by_byte(data):
    expected = data.decode("utf-8", errors="replace")
    whole = Utf8Tracker()
    assert whole.push(data) + whole.finish() == expected
    single = Utf8Tracker()
    assert "".join(single.push_byte(b) for b in data) + single.finish() == expected


def test_bytes_mode_holds_only_an_incomplete_character():
    tracker = Utf8Tracker()
    assert tracker.push("a你".encode()[:3]) == "a"
    assert tracker.num_held_bytes == 2
    assert tracker.push(b"\xa0b") == "你b"
    assert tracker.num_held_bytes == 0
    assert tracker.push(b"\xf0\x9f") == ""
    assert tracker.push(b"x") == "\ufffdx"  # the held prefix is one maximal invalid subpart
    assert tracker.push(b"\xe4") == ""
    assert tracker.finish() == "\ufffd"


def pieces_reference(items):
    """Python model of SentencePiece Replace/ByteFallback/Fuse: ('t', bytes) text, ('b', int) byte token."""
    out, run = [], []
    for kind, value in items + [("t", b"")]:
        if kind == "b":
            run.append(value)
            continue
        if run:
            try:
                out.append(bytes(run).decode("utf-8"))
            except UnicodeDecodeError:
                out.append("\ufffd" * len(run))
            run = []
        out.append(value.decode("utf-8"))
    return "".join(out)


items_strategy = st.lists(
    st.one_of(
        st.tuples(st.just("t"), st.sampled_from([b"", b"a", b" b", "\u00e9".encode(), "你好".encode()])),
        st.tuples(st.just("b"),
                  st.one_of(st.integers(0, 255), st.sampled_from([0xE4, 0xBD, 0xA0, 0xF0, 0x9F, 0x98, 0x80]))),
    ),
    max_size=16,
)


@settings(max_examples=600, deadline=None)
@given(items_strategy)
def test_pieces_mode_matches_byte_fallback_model(items):
    tracker = Utf8Tracker(mode=DecodeMode.MODE_PIECES, num_strip=1)
    out = []
    for k, (kind, value) in enumerate(items):
        out.append(tracker.push_byte(value) if kind == "b" else tracker.push(value))
        # peek() is what finish() would add if the output ended here.
        assert "".join(out) + tracker.peek() == pieces_reference(items[: k + 1])[len(_leading_space(items[: k + 1])):]
    out.append(tracker.finish())
    reference = pieces_reference(items)
    assert "".join(out) == reference[len(_leading_space(items)):]


def _leading_space(items):
    return " " if pieces_reference(items).startswith(" ") else ""


def test_pieces_mode_releases_an_invalid_run_at_once():
    tracker = Utf8Tracker(mode=DecodeMode.MODE_PIECES)
    assert tracker.push_byte(0xE4) == ""
    assert tracker.push_byte(0xBD) == ""
    assert tracker.push_byte(0x41) == "\ufffd\ufffd\ufffd"  # run turned invalid: all three bytes
    assert tracker.push_byte(0xA0) == "\ufffd"  # still the same invalid run
    assert tracker.push(b"x") == "x"
    for b in "你".encode():
        assert tracker.push_byte(b) == ""  # a valid run is held until it ends
    assert tracker.finish() == "你"


def test_strip_removes_leading_spaces_of_the_whole_output_only():
    tracker = Utf8Tracker(mode=DecodeMode.MODE_PIECES, num_strip=2)
    assert tracker.push(b" ") == ""
    assert tracker.push(b"  a") == " a"
    assert tracker.push(b" b") == " b"
    one = Utf8Tracker(mode=DecodeMode.MODE_PIECES, num_strip=1)
    assert one.push(b"x") + one.push(b" y") == "x y"


def make_table(pieces, kinds):
    offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(p) for p in pieces])
    texts = [None if k & TokenKind.KIND_BYTE else p.decode("utf-8", "strict") if _valid(p) else None
             for p, k in zip(pieces, kinds)]
    return TokenTable(b"".join(pieces), offsets, np.array(kinds, dtype=np.uint8), texts)


def _valid(piece):
    try:
        piece.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def test_table_add_uses_kinds():

    table = make_table([b"a", b"\xe4", b"\xbd\xa0", b"<s>", b""],
                       [0, 0, 0, TokenKind.KIND_SPECIAL, TokenKind.KIND_UNKNOWN])
    tracker = Utf8Tracker(table, DecodeMode.MODE_BYTES, skip_special=True)
    assert [tracker.add(i) for i in (0, 1, 3, 4, 99, -1, 2)] == ["a", "", "", "", "", "", "你"]
    keep = Utf8Tracker(table, DecodeMode.MODE_BYTES, skip_special=False)
    assert [keep.add(i) for i in (1, 3, 2)] == ["", "\ufffd<s>", "\ufffd\ufffd"]
    assert table.piece(2) == b"\xbd\xa0" and table.piece(100) == b""


def test_table_without_texts_makes_each_on_first_use():
    """A table built without texts (engine.tokenizer.token_bytes keeps no per-id str, nor a slot per
    id) gives the same texts and the same tracker output as one built with them, and keeps each
    text it made for the next use."""
    pieces = [b"a", b"\xe4", b"\xbd\xa0", b"<s>", b"", b"\xe4\xbd\xa0", "你".encode()]
    kinds = [0, 0, 0, TokenKind.KIND_SPECIAL, TokenKind.KIND_UNKNOWN, TokenKind.KIND_BYTE, 0]
    full = make_table(pieces, kinds)
    lazy = TokenTable(full.blob, full.offsets, full.kinds.copy())
    assert lazy.texts is None and lazy.made == {} and full.made is None
    assert [lazy.text(i) for i in range(len(pieces))] == full.texts == ["a", None, None, "<s>", "", None, "你"]
    assert lazy.text(-1) is None and lazy.text(len(pieces)) is None
    lazy = TokenTable(full.blob, full.offsets, full.kinds.copy())
    for skip in (True, False):
        ids = [6, 0, 1, 2, 3, 6, 4, 0, 6]
        ours, theirs = Utf8Tracker(lazy, DecodeMode.MODE_BYTES, skip), Utf8Tracker(full, DecodeMode.MODE_BYTES, skip)
        assert [ours.add(i) for i in ids] == [theirs.add(i) for i in ids]
    assert lazy.made[6] == "你" and 5 not in lazy.made  # kept as used; 5 never was
    assert lazy.text(6) is lazy.made[6]


def test_invalid_arguments_raise_value_error():
    with pytest.raises(ValueError, match="mode"):
        Utf8Tracker(mode=7)
    with pytest.raises(ValueError, match="num_strip"):
        Utf8Tracker(num_strip=-1)
    with pytest.raises(ValueError, match="value"):
        Utf8Tracker().push_byte(256)
    with pytest.raises(ValueError, match="offsets"):
        TokenTable(b"ab", np.array([0, 1], dtype=np.int64), np.zeros(2, dtype=np.uint8), [None, None])
    with pytest.raises(ValueError, match="TokenTable"):
        Utf8Tracker().add(0)
