"""Per-token bytes of a tokenizer, read off its decoder: the table behind fast detokenization.

`tokenizers`' ``decode(ids, skip_special_tokens)`` maps every id to its token string (an
added or special token to its content, a special one dropped when skipping), then runs
the decoder over the whole list at once. For the decoders below that rendering is a
concatenation of per-token pieces, so one table built per tokenizer is enough:

- ``ByteLevel`` (byte-level BPE): each token's chars map back to bytes (a token with a
  char outside the byte alphabet keeps its UTF-8 bytes); the bytes of all tokens are
  decoded together like ``errors="replace"``.                       -> MODE_BYTES
- ``Sequence`` of ``Replace`` (string patterns), then ``ByteFallback``, ``Fuse``,
  ``Strip(" ", n, 0)`` (SentencePiece): a ``<0xNN>`` token is one byte of a byte run,
  any other token is its replaced text; ``Strip`` removes leading spaces of the whole
  output.                                                            -> MODE_PIECES
- ``Metaspace``: "▁" becomes a space, except in the first token, where it is dropped
  (prepend_scheme "first"/"always").                                 -> MODE_PIECES

Any other decoder (or none) takes the generic path: re-decoding a short window.

Logprob pieces. ``TokenPieces.bytes_of(id)`` is the token's raw bytes as the decoder
produces them (a byte-fallback ``<0xE4>`` is ``b"\\xe4"``, byte-level ``Ġhi`` is ``b" hi"``,
SentencePiece ``▁hi`` is ``b" hi"``; leading-space stripping of the whole output is not
applied to a piece). ``text_of(id)`` renders those bytes with
``bytes.decode("utf-8", errors="replace")``: a piece that is not valid UTF-8 on its own
(part of a multi-byte character) shows U+FFFD for each maximal invalid subpart, e.g.
``b"\\xe4\\xbd"`` -> ``"\\ufffd"``, while ``TokenLogprob.bytes`` keeps the raw bytes so a client
can join them. A generic-path tokenizer has no raw table: its piece is ``decode([id])``.
"""
from __future__ import annotations

import json
import re
import weakref
from dataclasses import dataclass

import numpy as np

from cext.utf8 import DecodeMode, TokenKind, TokenTable, token_pieces


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes -> printable chars map, inverted: char -> byte."""
    byte_values = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = list(byte_values)
    num_extra = 0
    for b in range(256):
        if b not in byte_values:
            byte_values.append(b)
            chars.append(256 + num_extra)
            num_extra += 1
    return {chr(c): b for b, c in zip(byte_values, chars)}


_BYTE_LEVEL = _byte_level_alphabet()
_TO_LATIN1 = str.maketrans({c: chr(b) for c, b in _BYTE_LEVEL.items()})
_NOT_BYTE_LEVEL = re.compile("[^" + re.escape("".join(_BYTE_LEVEL)) + "]")


def byte_level_bytes(token: str) -> bytes:
    """Bytes of a token under the ByteLevel decoder."""
    if _NOT_BYTE_LEVEL.search(token):
        return token.encode("utf-8")
    return token.translate(_TO_LATIN1).encode("latin-1")


@dataclass(frozen=True, slots=True)
class DecoderPlan:
    """How a decoder renders a token list; ``mode`` is None for the generic path."""

    mode: DecodeMode | None = None       # None: the generic path
    replaces: tuple = ()                 # (pattern, content) applied to every token, in order
    is_byte_fallback: bool = False
    num_strip: int = 0                   # leading spaces removed from the whole output
    first_token_drops: str | None = None  # Metaspace: the char dropped from the first token


def plan_decoder(decoder_json: dict | None) -> DecoderPlan:
    """Read a decoder's serialized form; anything not known to concatenate goes generic."""
    if decoder_json is None:
        return DecoderPlan()
    kind = decoder_json.get("type")
    if kind == "ByteLevel":
        return DecoderPlan(DecodeMode.MODE_BYTES)
    if kind == "Metaspace":
        replacement = decoder_json.get("replacement", "\u2581")
        scheme = decoder_json.get("prepend_scheme", "always" if decoder_json.get("add_prefix_space", True) else "never")
        if len(replacement) != 1 or scheme not in ("always", "first", "never"):
            return DecoderPlan()
        return DecoderPlan(DecodeMode.MODE_PIECES, ((replacement, " "),),
                           first_token_drops=None if scheme == "never" else replacement)
    if kind != "Sequence":
        return DecoderPlan()
    steps = _flatten(decoder_json)
    if [s.get("type") for s in steps] == ["ByteLevel"]:
        return DecoderPlan(DecodeMode.MODE_BYTES)
    replaces, is_byte_fallback, is_fused, num_strip = [], False, False, 0
    for step in steps:
        kind = step.get("type")
        pattern = step.get("pattern") or {}
        if kind == "Replace" and not is_byte_fallback and not is_fused and "String" in pattern:
            if pattern["String"] == "":
                return DecoderPlan()
            replaces.append((pattern["String"], step.get("content", "")))
        elif kind == "ByteFallback" and not is_byte_fallback and not is_fused:
            is_byte_fallback = True
        elif kind == "Fuse" and not num_strip:
            is_fused = True
        elif kind == "Strip" and is_fused and not num_strip and step.get("content") == " " and step.get("stop") == 0:
            num_strip = int(step.get("start", 0))
        else:
            return DecoderPlan()
    return DecoderPlan(DecodeMode.MODE_PIECES, tuple(replaces), is_byte_fallback, num_strip)


def _occurrences(blob: bytes, pattern: bytes) -> np.ndarray:
    """Start offsets of ``pattern`` in ``blob`` (a UTF-8 character's bytes: never overlapping)."""
    data = np.frombuffer(blob, dtype=np.uint8)
    n, k = len(data), len(pattern)
    if k == 0 or n < k:
        return np.zeros(0, dtype=np.int64)
    found = data[: n - k + 1] == pattern[0]
    for j in range(1, k):
        found &= data[j: n - k + 1 + j] == pattern[j]
    return np.flatnonzero(found)


def _flatten(sequence: dict) -> list[dict]:
    steps = []
    for step in sequence.get("decoders") or []:
        steps.extend(_flatten(step) if step.get("type") == "Sequence" else [step])
    return steps


class TokenPieces:
    """A tokenizer's per-id pieces; ``TokenPieces(tokenizer)`` is built once per tokenizer and cached.

    ``tokenizer`` is an engine Tokenizer or a raw ``tokenizers.Tokenizer``. Adding tokens
    to the tokenizer or changing its decoder afterwards rebuilds the table.
    """

    _cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __new__(cls, tokenizer):
        backend = getattr(tokenizer, "backend", tokenizer)
        if not hasattr(backend, "decode") or not hasattr(backend, "id_to_token"):
            raise ValueError(f"tokenizer must be a Tokenizer or tokenizers.Tokenizer, got {type(tokenizer).__name__}")
        decoder_state = backend.decoder.__getstate__() if backend.decoder is not None else None
        signature = (backend.get_vocab_size(with_added_tokens=True), decoder_state)
        cached = cls._cache.get(backend)
        if cached is not None and cached._signature == signature:
            return cached
        self = super().__new__(cls)
        self._build(backend, signature, tokenizer)
        cls._cache[backend] = self
        return self

    def _build(self, backend, signature, tokenizer) -> None:
        self._backend_ref = weakref.ref(backend)  # the cache's value must not keep its key alive
        self._signature = signature
        decoder_state = signature[1]
        self.plan = plan_decoder(json.loads(decoder_state) if decoder_state is not None else None)
        added = backend.get_added_tokens_decoder()
        self._added_ids = tuple(added)
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)
        self.num_ids = max([signature[0], *(i + 1 for i in added)])
        self._generic_pieces: dict[int, bytes] = {}
        self.table = self._build_table(tokenizer) if self.plan.mode is not None else None

    @property
    def backend(self):
        return self._backend_ref()

    @property
    def is_fast(self) -> bool:
        return self.table is not None

    def _build_table(self, tokenizer) -> TokenTable:
        plan = self.plan
        kinds = np.zeros(self.num_ids, dtype=np.uint8)  # [num_ids]
        kinds[list(self.special_token_ids)] = TokenKind.KIND_SPECIAL
        table = self._table_from_blob(kinds)
        if table is not None:
            return table
        byte_level = byte_level_bytes if plan.mode == DecodeMode.MODE_BYTES else None
        tokens = self._token_texts(getattr(tokenizer, "token_texts", None))
        pieces, _, _ = token_pieces(tokens, plan.replaces, plan.is_byte_fallback, byte_level, kinds, False)
        del tokens
        offsets = np.zeros(self.num_ids + 1, dtype=np.int64)  # [num_ids + 1]
        np.cumsum(np.fromiter(map(len, pieces), dtype=np.int64, count=self.num_ids), out=offsets[1:])
        # No per-id str or bytes kept (~50 MB over Gemma 3's 262k ids): the table makes each id's
        # text on its first use, and logprob pieces are slices of its blob.
        return TokenTable(b"".join(pieces), offsets, kinds)

    def _table_from_blob(self, kinds: np.ndarray) -> TokenTable | None:
        """SentencePiece pieces over a backend that hands its tokens as one UTF-8 blob
        (gguf_spm.SpmBackend.token_blob), made with numpy over the blob: no Python object per id
        (a list of 262k str and one of 262k bytes were ~70 MB at the load's peak for Gemma 3).
        None where the generic build applies: another backend, another mode, or a replace whose
        pattern is more than one character (one character's bytes never span two tokens)."""
        plan = self.plan
        token_blob = getattr(self.backend, "token_blob", None)
        if token_blob is None or plan.mode != DecodeMode.MODE_PIECES or any(len(p) != 1 for p, _ in plan.replaces):
            return None
        blob, offsets = token_blob()  # offsets int64 [num_ids + 1]
        if len(offsets) != self.num_ids + 1:
            return None
        for pattern, content in plan.replaces:  # in order, as token_pieces applies them per token
            old, new = pattern.encode("utf-8"), content.encode("utf-8")
            hits = _occurrences(blob, old)
            if len(hits) and len(new) != len(old):
                owners = np.searchsorted(offsets, hits, side="right") - 1
                offsets = offsets.copy()
                offsets[1:] += np.cumsum(np.bincount(owners, minlength=self.num_ids) * (len(new) - len(old)))
            blob = blob.replace(old, new)
        if plan.is_byte_fallback:
            blob, offsets = self._byte_tokens(blob, offsets, kinds)
        return TokenTable(blob, offsets, kinds)

    @staticmethod
    def _byte_tokens(blob: bytes, offsets: np.ndarray, kinds: np.ndarray) -> tuple[bytes, np.ndarray]:
        """Byte-fallback tokens ("<0xNN>", as token_pieces parses them) become their one byte."""
        data = np.frombuffer(blob, dtype=np.uint8)
        starts, lengths = offsets[:-1], np.diff(offsets)
        at = np.minimum(starts, max(len(data) - 3, 0))
        candidates = np.flatnonzero((lengths >= 4) & (data[at] == ord("<")) & (data[at + 1] == ord("0"))
                                    & (data[at + 2] == ord("x"))) if len(data) >= 3 else np.zeros(0, np.int64)
        if not len(candidates):
            return blob, offsets
        texts = [blob[offsets[i]:offsets[i + 1]].decode("utf-8") for i in candidates.tolist()]
        sub_kinds = kinds[candidates].copy()
        pieces, _, _ = token_pieces(texts, (), True, None, sub_kinds, False)
        is_byte = (sub_kinds & TokenKind.KIND_BYTE) != 0
        kinds[candidates] = sub_kinds
        segments, end = [], 0
        for i, piece in zip(candidates[is_byte].tolist(), (p for p, b in zip(pieces, is_byte) if b)):
            segments += [blob[end:offsets[i]], piece]
            end = offsets[i + 1]
        segments.append(blob[end:])
        lengths = lengths.copy()
        lengths[candidates[is_byte]] = 1
        new_offsets = np.zeros_like(offsets)
        np.cumsum(lengths, out=new_offsets[1:])
        return b"".join(segments), new_offsets

    def _token_texts(self, token_texts: list[str] | None) -> list[str | None]:
        """Every id's text: ``token_texts`` (the list the loader built the vocabulary from: one
        id_to_token call per id took ~0.2 s on a 262k vocabulary) when it has one per id and
        agrees with the backend at every added token and at 1,024 ids across the range, else
        id_to_token over every id."""
        backend = self.backend
        if token_texts is not None and len(token_texts) == self.num_ids:
            checked = {*self._added_ids, *range(0, self.num_ids, max(1, self.num_ids // 1024)), self.num_ids - 1}
            if all(backend.id_to_token(i) == token_texts[i] for i in checked):
                return token_texts
        return [backend.id_to_token(i) for i in range(self.num_ids)]

    def is_dropped(self, token_id: int, skip_special_tokens: bool) -> bool:
        """Whether decode leaves this id out entirely."""
        if token_id < 0 or token_id >= self.num_ids:
            return True
        if self.table is None:
            return self.backend.id_to_token(token_id) is None or (
                skip_special_tokens and token_id in self.special_token_ids
            )
        kind = int(self.table.kinds[token_id])
        return bool(kind & TokenKind.KIND_UNKNOWN or (skip_special_tokens and kind & TokenKind.KIND_SPECIAL))

    def first_piece(self, token_id: int) -> bytes:
        """The piece of a token rendered first in the output (Metaspace drops its marker there)."""
        token = self.backend.id_to_token(token_id) or ""
        return token.replace(self.plan.first_token_drops, "").encode("utf-8")

    def bytes_of(self, token_id: int) -> bytes:
        """The token's raw bytes as the decoder produces them (b"" for an unknown id)."""
        if not 0 <= token_id < self.num_ids:
            return b""
        if self.table is not None:
            return self.table.piece(token_id)
        piece = self._generic_pieces.get(token_id)
        if piece is None:
            piece = self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")
            self._generic_pieces[token_id] = piece
        return piece

    def text_of(self, token_id: int) -> str:
        """``bytes_of(token_id).decode("utf-8", errors="replace")``."""
        return self.bytes_of(token_id).decode("utf-8", errors="replace")
