"""StopMatcher: invariant 3 on its own and composed with the detokenizer; the automaton
against the plain quadratic matcher it replaced; linear memory; the caps."""
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.params import SamplingParams
from engine.text.stops import MAX_NUM_STOPS, MAX_STOP_LEN, MAX_TOTAL_STOP_LEN, StopMatcher
from tests import vocabs
from webapp import protocol
from webapp.errors import APIError


class QuadraticStopMatcher:
    """The reference model: the matcher before the automaton (a set of every prefix of every
    stop string, so quadratic memory in the stop length), same interface and semantics."""

    def __init__(self, stops, include_stop_str=False):
        self.stops = tuple(dict.fromkeys(stops))
        self.include_stop_str = include_stop_str
        self.is_stopped = False
        self.stop_str = None
        self._held = ""
        self._prefixes = frozenset(s[:k] for s in self.stops for k in range(1, len(s)))
        self._max_prefix_len = max((len(s) - 1 for s in self.stops), default=0)

    def push(self, text):
        if self.is_stopped:
            return "", True
        if not self.stops:
            return text, False
        if not text:
            return "", False
        held = self._held
        buffer = held + text
        cut, stop_str = -1, None
        for stop in self.stops:
            index = buffer.find(stop, max(0, len(held) - len(stop) + 1))
            if index >= 0 and (cut < 0 or index < cut or (index == cut and len(stop) < len(stop_str))):
                cut, stop_str = index, stop
        if stop_str is not None:
            self.is_stopped = True
            self.stop_str = stop_str
            self._held = ""
            return buffer[: cut + len(stop_str) if self.include_stop_str else cut], True
        num_held = self._held_suffix_len(buffer)
        self._held = buffer[len(buffer) - num_held :]
        return buffer[: len(buffer) - num_held], False

    def completes_with(self, tentative):
        if self.is_stopped or not self.stops or not tentative:
            return False
        held = self._held
        buffer = held + tentative
        return any(buffer.find(stop, max(0, len(held) - len(stop) + 1)) >= 0 for stop in self.stops)

    def _held_suffix_len(self, buffer):
        for k in range(min(len(buffer), self._max_prefix_len), 0, -1):
            if buffer[-k:] in self._prefixes:
                return k
        return 0

    def flush(self):
        held, self._held = self._held, ""
        return "" if self.is_stopped else held


def run(matcher, chunks):
    released, is_stopped = [], False
    for chunk in chunks:
        text, is_stopped = matcher.push(chunk)
        released.append(text)
        if is_stopped:
            break
    if not is_stopped:
        released.append(matcher.flush())
    return "".join(released), is_stopped


def reference(stops, include, chunks):
    """Text seen so far is checked after each chunk; the earliest (then shortest) occurrence cuts it."""
    seen = ""
    for chunk in chunks:
        seen += chunk
        hits = [(seen.find(s), len(s)) for s in stops if s in seen]
        if hits:
            index, length = min(hits)
            return seen[: index + length if include else index], True
    return seen, False


def longest_held_suffix(text, stops):
    return max([k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])], default=0)


chunks_strategy = st.lists(st.text(alphabet="abc\u00e9 ", max_size=5), max_size=10)
stops_strategy = st.lists(st.text(alphabet="abc\u00e9 ", min_size=1, max_size=4), min_size=1, max_size=3)


@settings(max_examples=500, deadline=None)
@given(chunks_strategy, stops_strategy, st.booleans())
def test_matches_reference_and_holds_back_minimally(chunks, stops, include):
    matcher = StopMatcher(tuple(stops), include)
    released, seen = "", ""
    for chunk in chunks:
        text, is_stopped = matcher.push(chunk)
        released += text
        seen += chunk
        if is_stopped:
            break
        # Only the longest suffix that is a prefix of some stop string is held back.
        assert released == seen[: len(seen) - longest_held_suffix(seen, stops)]
    if not matcher.is_stopped:
        released += matcher.flush()
    assert (released, matcher.is_stopped) == reference(stops, include, chunks)


def test_stop_at_the_very_start():
    assert StopMatcher(("Hello",), False).push("Hello world") == ("", True)
    assert StopMatcher(("Hello",), True).push("Hello world") == ("Hello", True)


def test_earliest_occurrence_wins_and_overlapping_stops():
    assert run(StopMatcher(("world", "o w"), False), ["hello wor", "ld"]) == ("hell", True)
    assert run(StopMatcher(("abc", "bc"), False), ["xab", "c"]) == ("x", True)  # "abc" starts first
    assert run(StopMatcher(("aab",), False), ["aa", "a", "ab"]) == ("aa", True)  # overlap with itself
    matcher = StopMatcher(("ab", "abcd"), True)
    assert matcher.push("xxabcd") == ("xxab", True) and matcher.stop_str == "ab"


def test_nothing_passes_the_cut_and_nothing_after_stop():
    matcher = StopMatcher(("</s>",), False)
    assert matcher.push("text <") == ("text ", False)
    assert matcher.push("/") == ("", False)
    assert matcher.push("s> more") == ("", True)
    assert matcher.push("even more") == ("", True)
    assert matcher.flush() == ""


def test_held_text_is_released_when_it_cannot_match():
    matcher = StopMatcher(("stop",), False)
    assert matcher.push("a st") == ("a ", False)
    assert matcher.push("ep") == ("step", False)
    assert matcher.push("sto") == ("", False)
    assert matcher.flush() == "sto"


def test_no_stops_passes_text_through():
    matcher = StopMatcher((), False)
    assert matcher.push("anything") == ("anything", False) and matcher.flush() == ""


def test_invalid_stops_raise_value_error():
    # Stops are validated once, by SamplingParams; StopMatcher takes its checked tuple.
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=("ok", ""))
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=("abc", 3))


def stream(tok, ids, stops, include):
    detok, matcher = IncrementalDetokenizer(tok), StopMatcher(stops, include)
    released, num_tokens = "", 0
    for token_id in ids:
        num_tokens += 1
        text, is_stopped = matcher.push(detok.add(token_id))
        released += text
        if is_stopped:
            return released, num_tokens
    text, _ = matcher.push(detok.finish())
    return released + text + matcher.flush(), num_tokens


@pytest.mark.parametrize("name", ["smollm2", "qwen", "llama_spm"])
def test_multi_token_stop_stops_at_the_completing_token(name):
    tok = getattr(vocabs, name)()
    backend = vocabs.backend_of(tok)
    ids = vocabs.encode_ids(tok, "The answer is 42. The End of the story continues")
    released, num_tokens = stream(tok, ids, ("The End",), False)
    assert released == "The answer is 42. "
    completing = next(k for k in range(1, len(ids) + 1) if "The End" in backend.decode(ids[:k]))
    assert num_tokens == completing


@pytest.mark.parametrize("name", ["smollm2", "qwen", "llama_spm"])
def test_stop_string_cut_mid_character(name):
    """A stop that ends inside a multi-byte character matches once the character is complete."""
    tok = getattr(vocabs, name)()
    backend = vocabs.backend_of(tok)
    if name == "llama_spm":
        emoji = [backend.token_to_id(f"<0x{b:02X}>") for b in "🙂".encode()]
    else:
        emoji = [backend.token_to_id(vocabs.byte_level_str(bytes([b]))) for b in "🙂".encode()]
    ids = vocabs.encode_ids(tok, "x") + emoji
    tail = vocabs.encode_ids(tok, "after")
    ids += tail
    assert backend.decode(ids).startswith("x🙂") and backend.decode(ids).endswith("after")
    detok, matcher = IncrementalDetokenizer(tok), StopMatcher(("x🙂",), True)
    outputs = [matcher.push(detok.add(i)) for i in ids]
    stop_at = next(k for k, (_, is_stopped) in enumerate(outputs) if is_stopped)
    assert "".join(text for text, _ in outputs) == "x🙂"
    # Byte-level stops at the 4th byte; byte fallback only when the run ends (the next token).
    assert stop_at == len(ids) - len(tail) - (name != "llama_spm")


def test_completes_with_does_not_change_state():
    matcher = StopMatcher(("abc",), False)
    assert matcher.push("xab") == ("x", False)
    assert matcher.completes_with("c") and not matcher.completes_with("d") and not matcher.completes_with("")
    assert matcher.push("d") == ("abd", False)


# Small alphabets so that stops overlap, nest and match; one 1-byte, one 2-byte and one 4-byte
# character so that stops and text of different string kinds meet.
ALPHABET = "ab\u00e9\U0001f642"


@settings(max_examples=1500, deadline=None)
@given(
    st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=7), min_size=1, max_size=8),
    st.text(alphabet=ALPHABET, max_size=60),
    st.lists(st.integers(0, 60), max_size=20),
    st.booleans(),
    st.lists(st.text(alphabet=ALPHABET, max_size=4), min_size=1, max_size=3),
    st.booleans(),
)
def test_automaton_matches_the_quadratic_reference(stops, text, cuts, include, tentatives, is_flushed_midway):
    """Every push (released text and stop), stop_str, completes_with and flush agree, over
    random stop sets and random chunkings (empty chunks included) of random text."""
    bounds = [0, *sorted(cuts), len(text)]
    chunks = [text[a:b] for a, b in zip(bounds, bounds[1:])]
    matcher, reference_matcher = StopMatcher(tuple(stops), include), QuadraticStopMatcher(stops, include)
    for k, chunk in enumerate(chunks):
        for tentative in tentatives:
            assert matcher.completes_with(tentative) == reference_matcher.completes_with(tentative)
        assert matcher.push(chunk) == reference_matcher.push(chunk)
        assert (matcher.is_stopped, matcher.stop_str) == (reference_matcher.is_stopped, reference_matcher.stop_str)
        if is_flushed_midway and k == len(chunks) // 2:
            assert matcher.flush() == reference_matcher.flush()
    assert matcher.flush() == reference_matcher.flush()
    assert matcher.push("more") == reference_matcher.push("more")


@pytest.mark.parametrize("chunk_len", [1, 7, 4096])
def test_120000_char_stop_string_takes_linear_memory(chunk_len):
    """The quadratic matcher needed ~7 GB for this stop; the automaton needs ~16 bytes a char.
    The held text (119,999 chars) is released piece by piece without being copied per push."""
    stop = "a" * 119_999 + "b"
    num_chars = 140_000
    tracemalloc.start()
    try:
        matcher = StopMatcher((stop, "ab" * 50), include_stop_str=True)
        chunk, num_released, is_any_stopped = "a" * chunk_len, 0, False
        for _ in range(num_chars // chunk_len):
            text, is_stopped = matcher.push(chunk)
            num_released += len(text)
            is_any_stopped |= is_stopped
        completes = matcher.completes_with("b")
        last = matcher.push("bb")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert not is_any_stopped and num_released == num_chars // chunk_len * chunk_len - 119_999
    assert completes and last == ("a" * 119_999 + "b", True) and matcher.stop_str == stop
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_held_text_is_the_longest_live_prefix_after_a_long_run():
    """Failure links across a long self-overlapping stop: the held text shrinks to the next
    live prefix, then to nothing."""
    stop = "ab" * 5000 + "c"
    matcher = StopMatcher((stop,), False)
    assert matcher.push("ab" * 6000) == ("ab" * 1000, False)
    assert matcher.completes_with("c") and not matcher.completes_with("b")
    assert matcher.push("a") == ("ab", False)  # "ab" * 4999 + "a" is still a prefix
    assert matcher.push("d") == ("ab" * 4999 + "ad", False)
    assert matcher.flush() == ""


def _distinct(num_strings, length):
    return [f"{k:08d}".ljust(length, "x") for k in range(num_strings)]


@pytest.mark.parametrize("stops, message", [
    (_distinct(MAX_NUM_STOPS + 1, 8), "at most 256 strings"),
    (["a" * (MAX_STOP_LEN + 1)], "at most 131072 characters each"),
    (_distinct(MAX_TOTAL_STOP_LEN // MAX_STOP_LEN + 1, MAX_STOP_LEN), "total at most 1048576 characters"),
])
def test_caps_raise_value_error_naming_stop(stops, message):
    with pytest.raises(ValueError, match=f"^stop.*{message}"):
        SamplingParams(stop=stops)
    with pytest.raises(ValueError, match=f"^stop.*{message}"):
        SamplingParams(stop=tuple(stops))
    with pytest.raises(APIError) as info:
        protocol.parse_completion({"model": "m", "prompt": "hi", "stop": stops})
    assert info.value.status == 400 and info.value.param == "stop"


def test_stops_at_the_caps_are_accepted():
    SamplingParams(stop=_distinct(MAX_NUM_STOPS, MAX_TOTAL_STOP_LEN // MAX_NUM_STOPS))
    SamplingParams(stop=["a" * MAX_STOP_LEN])
    matcher = StopMatcher(tuple(_distinct(MAX_NUM_STOPS, 8)), False)
    assert matcher.push("x00000255xx!") == ("x", True) and matcher.stop_str == "00000255"
