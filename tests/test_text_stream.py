"""TextStream: one request's detokenizer + stop strings, one trip per token."""
import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.text.text_stream import TextStream
from tests import vocabs


def _emoji_ids(name):
    tok = getattr(vocabs, name)()
    backend = vocabs.backend_of(tok)
    if name == "llama_spm":
        emoji = [backend.token_to_id(f"<0x{b:02X}>") for b in "🙂".encode()]
    else:
        emoji = [backend.token_to_id(vocabs.byte_level_str(bytes([b]))) for b in "🙂".encode()]
    ids = (vocabs.encode_ids(tok, "x") + emoji
           + vocabs.encode_ids(tok, "after"))
    return tok, backend, ids


@pytest.mark.parametrize("name", ["smollm2", "qwen", "llama_spm"])
def test_stops_at_the_token_that_completes_the_stop(name):
    """Even while a byte-fallback run holds the text, generation stops at the completing token."""
    tok, backend, ids = _emoji_ids(name)
    completing = next(k for k in range(1, len(ids) + 1) if "x🙂" in backend.decode(ids[:k]))
    for include in (False, True):
        stream = TextStream(tok, stop=("x🙂",), include_stop_str_in_output=include)
        released, num_tokens = "", 0
        for token_id in ids:
            num_tokens += 1
            text, is_stopped = stream.add(token_id)
            released += text
            if is_stopped:
                break
        assert num_tokens == completing
        assert released == ("x🙂" if include else "")
        assert stream.stop_str == "x🙂"
        assert stream.add(ids[-1]) == ("", True) and stream.finish() == ("", True)


@pytest.mark.parametrize("name", ["smollm2", "qwen", "llama_spm"])
@pytest.mark.parametrize("stop", [(), ("zzz",), ("aft",)])
def test_add_then_finish_is_decode_cut_at_the_stop(name, stop):
    tok, backend, ids = _emoji_ids(name)
    for cut in range(len(ids) + 1):  # the request ends after `cut` ids, mid-character included
        stream = TextStream(tok, stop=stop)
        pieces, is_stopped = [], False
        for token_id in ids[:cut]:
            text, is_stopped = stream.add(token_id)
            pieces.append(text)
            if is_stopped:
                break
        if not is_stopped:
            text, is_stopped = stream.finish()
            pieces.append(text)
        full = tok.decode(ids[:cut])
        expected = full.split(stop[0])[0] if stop and stop[0] in full else full
        assert "".join(pieces) == expected
        assert is_stopped == bool(stop and stop[0] in full)


def test_without_stops_it_is_the_detokenizer():
    tok, _, ids = _emoji_ids("smollm2")
    stream, detok = TextStream(tok), IncrementalDetokenizer(tok)
    for token_id in ids:
        assert stream.add(token_id) == (detok.add(token_id), False)
    assert stream.finish() == (detok.finish(), False)
