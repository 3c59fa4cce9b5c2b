"""Incremental detokenization: token ids in, final text out, byte-exact with ``decode``.

Invariant 1 (docs/architecture.md, "Invariants"): for every id sequence ``ids``

    "".join(d.add(i) for i in ids) + d.finish() == tok.decode(ids, skip_special_tokens=s)

and text once returned is never retracted. ``add`` returns only text that no later token
can change, and everything else at once: with a byte-level BPE only an incomplete last
character is held; with SentencePiece byte fallback, a run of ``<0xNN>`` tokens is held
until it ends (a later invalid byte turns every byte of the run into U+FFFD).

Two paths, chosen per tokenizer from its decoder (see engine/tokenizer/token_bytes.py):

- fast: ``add`` is one call into `cext.utf8.Utf8Tracker` with a per-id byte table; the
  cost per token is constant;
- generic (any other decoder): re-decode a window of the last few ids (prefix/read
  offsets, as vLLM and `tokenizers.decoders.DecodeStream` do); O(window) per token.

Token pieces for logprobs: ``TokenPieces(tokenizer)`` (built once per tokenizer, cached).
``bytes_of(id)`` is the token's raw bytes as the decoder produces them (``TokenLogprob.bytes``);
``text_of(id)`` (``TokenLogprob.token``) renders them with ``errors="replace"``, so a piece
that is not valid UTF-8 on its own (part of a multi-byte character, a byte-fallback
``<0xE4>``) shows U+FFFD for each maximal invalid subpart: ``b"\\xe4\\xbd"`` -> ``"\\ufffd"``.
Clients join ``bytes`` to recover the character. Details in engine/tokenizer/token_bytes.py.
"""
from __future__ import annotations

from cext.utf8 import Utf8Tracker
from engine.tokenizer.token_bytes import TokenPieces

__all__ = ["IncrementalDetokenizer", "TokenPieces"]

# Generic path: past this many unreleased ids, release even text ending in U+FFFD.
MAX_WINDOW_IDS = 32


class IncrementalDetokenizer:
    """Detokenizes one request's generated ids, one at a time.

    ``tokenizer`` is an engine Tokenizer or a raw ``tokenizers.Tokenizer``. ``add(id)``
    returns the text that became final with this id; ``finish()`` returns what is still
    held, rendered exactly as ``decode`` renders the end of the output. On the fast path
    ``add`` is bound per instance straight to the Cython tracker (no Python frame).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        if not isinstance(skip_special_tokens, bool):
            raise ValueError(f"skip_special_tokens must be a boolean, got {skip_special_tokens!r}")
        self.skip_special_tokens = skip_special_tokens
        self.pieces = pieces = TokenPieces(tokenizer)
        self._has_first = False
        if pieces.is_fast:
            plan = pieces.plan
            self._impl = Utf8Tracker(pieces.table, plan.mode, skip_special_tokens, plan.num_strip)
            self.add = self._add_first if plan.first_token_drops else self._impl.add
        else:
            self._impl = _WindowDecoder(pieces.backend, skip_special_tokens)
            self.add = self._impl.add
        self.finish = self._impl.finish
        self.peek = self._impl.peek

    @property
    def is_fast(self) -> bool:
        return isinstance(self._impl, Utf8Tracker)

    def add(self, token_id: int) -> str:  # replaced per instance in __init__
        return self._impl.add(token_id)

    def finish(self) -> str:  # replaced per instance in __init__
        return self._impl.finish()

    def peek(self) -> str:  # replaced per instance in __init__
        """What finish() would return now, without changing state ("" when nothing is held)."""
        return self._impl.peek()

    def _add_first(self, token_id: int) -> str:
        # Metaspace renders the first kept token without its space marker.
        if self._has_first:
            return self._impl.add(token_id)  # a caller kept the bound method from before the first token
        if self.pieces.is_dropped(token_id, self.skip_special_tokens):
            return ""
        self._has_first = True
        self.add = self._impl.add
        return self._impl.push(self.pieces.first_piece(token_id))


class _WindowDecoder:
    """Generic path: ``decode`` of a short tail window, released as the diff to its prefix.

    ``ids[:num_prefix]`` were released already and render ``prefix_text`` on their own;
    the text of ``ids`` beyond ``prefix_text`` is released when it grew and does not end in
    U+FFFD (an incomplete character). Starting the window a few ids back lets decoders
    that treat the first token specially (Metaspace, WordPiece) render the new ids right.
    """

    __slots__ = ("_decode", "_skip", "_ids", "_num_prefix", "_prefix_text")

    def __init__(self, backend, skip_special_tokens: bool):
        self._decode = backend.decode
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._num_prefix = 0
        self._prefix_text = ""

    def add(self, token_id: int) -> str:
        ids = self._ids
        ids.append(token_id)
        text = self._decode(ids, skip_special_tokens=self._skip)
        prefix_text = self._prefix_text
        is_final = len(text) > len(prefix_text) and text.startswith(prefix_text) and not text.endswith("\ufffd")
        if not is_final and len(ids) - self._num_prefix <= MAX_WINDOW_IDS:
            return ""
        new_text = text[len(prefix_text):]
        self._slide()
        return new_text

    def _slide(self) -> None:
        # The unreleased ids become the new prefix window.
        del self._ids[: self._num_prefix]
        self._num_prefix = len(self._ids)
        self._prefix_text = self._decode(self._ids, skip_special_tokens=self._skip)

    def finish(self) -> str:
        new_text = self.peek()
        self._slide()
        return new_text

    def peek(self) -> str:
        if len(self._ids) == self._num_prefix:
            return ""
        return self._decode(self._ids, skip_special_tokens=self._skip)[len(self._prefix_text):]
