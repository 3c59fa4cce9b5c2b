"""StopMatcher: invariant 3 on its own and composed with the detokenizer."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.stops import StopMatcher
from tests import vocabs


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
    with pytest.raises(ValueError, match="stop"):
        StopMatcher(("ok", ""), False)
    with pytest.raises(ValueError, match="stop"):
        StopMatcher("abc", False)


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
    ids = backend.encode("The answer is 42. The End of the story continues", add_special_tokens=False).ids
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
        ids = backend.encode("x", add_special_tokens=False).ids + [backend.token_to_id(f"<0x{b:02X}>") for b in "🙂".encode()]
    else:
        ids = backend.encode("x", add_special_tokens=False).ids + [backend.token_to_id(vocabs.byte_level_str(bytes([b]))) for b in "🙂".encode()]
    tail = backend.encode("after", add_special_tokens=False).ids
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
