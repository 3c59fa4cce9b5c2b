"""GGUF "llama" vocabularies: SentencePiece BPE as llama.cpp runs it (`llm_tokenizer_spm`).

llama.cpp replaces spaces with U+2581, prefixes a space to every text fragment that starts the
input or follows a special token (`add_space_prefix`), splits into UTF-8 characters and then keeps
merging the adjacent pair whose concatenation is the vocabulary token of highest score. Characters
no merge covers and that are not tokens come out as byte tokens `<0xNN>`.

The vocabulary is an `SpmBackend`: the `tokenizers.Tokenizer` methods the engine calls, over
cext.spm.SpmEncoder's tables (the tokens' bytes, one hash table, the scores: ~9 MB for Gemma 3's
262,144 tokens). As a `tokenizers` BPE model (`reference_backend`, which the tests compare it
with) the same vocabulary kept ~115 MB (its merges: every (left, right) split of a token into two
tokens, ranked by the merged token's score) and took ~1 s to build; without merges, for decoding
only, still ~53 MB. Decoding renders as that model's decoders do (Replace "▁" -> " ",
ByteFallback, Fuse, Strip one leading space with add_space_prefix), through the detokenizer's
per-id table (engine.tokenizer.token_bytes), which the tests hold byte-exact with them.
"""
from __future__ import annotations

import operator

import numpy as np
from tokenizers import AddedToken, decoders, models, normalizers
from tokenizers import Tokenizer as HFTokenizer

from cext.gguf_strings import pairs_in_order, two_token_splits  # the GGUF reader needs cext built anyway
from cext.spm import SpmEncoder

from .gguf_special import ADDED_TYPES, TokenType, text_ids

SPACE_MARKER = "\u2581"


def spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, ordered by the merged token's score, best first.

    Ties keep the lower token id first, then the earlier split. Byte tokens `<0xNN>` are never
    merge results. The splits come from one C loop (cext.gguf_strings).
    """
    skip = (np.asarray(types, dtype=np.int64) == TokenType.BYTE).astype(np.uint8)
    lefts, rights, ids, _ = two_token_splits(tokens, skip)
    if not len(ids):
        return []
    # The splits come in (id, split) order, so a stable sort by score alone keeps that order for ties.
    order = np.argsort(-np.asarray(scores, dtype=np.float64)[ids], kind="stable")
    return pairs_in_order(tokens, lefts, rights, order)


def _decoder(add_space_prefix: bool):
    steps = [decoders.Replace(SPACE_MARKER, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    return decoders.Sequence(steps)


def _add_space_prefix(metadata: dict) -> bool:
    add_space_prefix = metadata.get("tokenizer.ggml.add_space_prefix")
    return True if add_space_prefix is None else bool(add_space_prefix)


def _scores(metadata: dict, num_tokens: int) -> list[float]:
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        return [0.0] * num_tokens
    if len(scores) < num_tokens:
        raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for {num_tokens} tokens")
    return scores[:num_tokens]


def _unk_id(metadata: dict, num_tokens: int) -> int | None:
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    return int(unk_id) if unk_id is not None and 0 <= int(unk_id) < num_tokens else None


class SpmEncoding:
    """What the engine reads of a `tokenizers.Encoding`: ``ids`` (and ``tokens``)."""

    __slots__ = ("ids", "_backend")

    def __init__(self, ids: list[int], backend: SpmBackend):
        self.ids = ids
        self._backend = backend

    @property
    def tokens(self) -> list[str]:
        return [self._backend.id_to_token(i) for i in self.ids]


class SpmBackend:
    """A GGUF SentencePiece vocabulary behind the `tokenizers.Tokenizer` methods the engine calls:
    encode, encode_batch(_fast), decode(_batch), id_to_token, token_to_id, get_vocab_size,
    get_added_tokens_decoder, and ``decoder`` (a `tokenizers` decoder object, read by the per-id
    table). Encoding runs in C with the GIL released; ``add_special_tokens`` adds nothing, as in a
    `tokenizers` backend without a post-processor (the engine's Tokenizer adds BOS itself)."""

    post_processor = None

    def __init__(self, encoder: SpmEncoder, added: dict[int, AddedToken], decoder):
        self.encoder = encoder
        self.decoder = decoder
        self._added = added

    def encode(self, text: str, add_special_tokens: bool = True) -> SpmEncoding:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return SpmEncoding(self.encoder.encode(text), self)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[SpmEncoding]:
        return [SpmEncoding(ids, self) for ids in self.encoder.encode_batch(list(texts))]

    encode_batch_fast = encode_batch

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """The text of ``ids``; ids outside the vocabulary render as nothing. A negative id raises
        OverflowError and a non-integer TypeError, as in `tokenizers`."""
        from ..text.detokenizer import IncrementalDetokenizer  # the table's module imports this package

        ids = [operator.index(i) for i in ids]
        if ids and min(ids) < 0:
            raise OverflowError("can't convert negative int to unsigned")
        detokenizer = IncrementalDetokenizer(self, skip_special_tokens)
        return "".join([detokenizer.add(i) for i in ids]) + detokenizer.finish()

    def decode_batch(self, sequences, skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def id_to_token(self, token_id: int) -> str | None:
        return self.encoder.token_text(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.encoder.token_id(token)

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.encoder.num_tokens

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        return dict(self._added)

    @property
    def token_texts(self) -> list[str]:
        """Every id's text, a new list."""
        return self.encoder.token_texts()

    def token_blob(self) -> tuple[bytes, np.ndarray]:
        """(every id's text as UTF-8, concatenated; int64 offsets [num_ids + 1]): what the per-id
        table (engine.tokenizer.token_bytes) is built from without one Python object per id."""
        return self.encoder.token_blob()


def build_spm_backend(metadata: dict, tokens: list[str], types: list[int],
                      ids: dict[str, int] | None = None) -> SpmBackend:
    """``ids``: text_ids(tokens), when the caller has it. Control, unknown and user-defined tokens
    (ADDED_TYPES) are parsed in text before the merges, as `tokenizers` added tokens would be; the
    control and unknown ones are special (dropped by decode(skip_special_tokens=True))."""
    vocab = text_ids(tokens) if ids is None else ids
    kinds = np.asarray(types, dtype=np.int64)
    special_ids = np.flatnonzero(np.isin(kinds, ADDED_TYPES))
    added = {i: AddedToken(tokens[i], special=int(kinds[i]) != TokenType.USER_DEFINED, normalized=False)
             for i in special_ids.tolist()}
    unk_id = _unk_id(metadata, len(tokens))
    unk_id = -1 if unk_id is None else unk_id
    # llama.cpp's byte_to_token: "<0xNN>", else the byte's own one-character token (ASCII).
    byte_ids = [vocab.get(f"<0x{b:02X}>", vocab.get(chr(b), unk_id) if b < 0x80 else unk_id) for b in range(256)]
    add_space_prefix = _add_space_prefix(metadata)
    encoder = SpmEncoder(tokens, np.asarray(_scores(metadata, len(tokens)), dtype=np.float32), special_ids,
                         np.asarray(byte_ids, dtype=np.int32), add_space_prefix)
    return SpmBackend(encoder, added, _decoder(add_space_prefix))


def reference_backend(metadata: dict, tokens: list[str], types: list[int]) -> HFTokenizer:
    """The same vocabulary as a `tokenizers` BPE model with merges (spm_merges) and the normalizers
    Prepend "▁" (per fragment between added tokens: llama.cpp's rule) and Replace " " -> "▁":
    an implementation independent of cext.spm, for the tests. Added tokens are not registered."""
    unk_id = _unk_id(metadata, len(tokens))
    model = models.BPE(vocab=text_ids(tokens), merges=spm_merges(tokens, _scores(metadata, len(tokens)), types),
                       unk_token=None if unk_id is None else tokens[unk_id], fuse_unk=False, byte_fallback=True)
    backend = HFTokenizer(model)
    add_space_prefix = _add_space_prefix(metadata)
    replace = normalizers.Replace(" ", SPACE_MARKER)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARKER), replace]) if add_space_prefix \
        else replace
    backend.decoder = _decoder(add_space_prefix)
    return backend
