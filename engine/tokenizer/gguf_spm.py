"""GGUF "llama" vocabularies: SentencePiece BPE as llama.cpp runs it (`llm_tokenizer_spm`).

llama.cpp replaces spaces with U+2581, prefixes a space to every text fragment that starts the
input or follows a special token (`add_space_prefix`), splits into UTF-8 characters and then keeps
merging the adjacent pair whose concatenation is the vocabulary token of highest score. Characters
no merge covers and that are not tokens come out as byte tokens `<0xNN>`.

Encoding runs in C (cext/spm.pyx, `SpmEncoder`): the Tokenizer's ``encoder``. The `tokenizers`
backend beside it is for decoding (vocabulary, added tokens, decoders that undo the U+2581 and
the space prefix): a BPE model without merges, so its own `encode` splits into characters; the
engine never calls it. With merges (the form `reference_backend` builds for the tests) Gemma's
262k tokens took ~115 MB more and ~0.6 s a load. In that form the merges are every (left, right)
split of a token into two tokens, ranked by the merged token's score (best first), with
byte_fallback; normalizers Prepend "▁" (applied per fragment between added tokens, which is
llama.cpp's rule) and Replace " " -> "▁".
"""
from __future__ import annotations

import numpy as np
from cext.gguf_strings import pairs_in_order, two_token_splits  # the GGUF reader needs cext built anyway
from cext.spm import SpmEncoder
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

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


def _backend(metadata: dict, tokens: list[str], vocab: dict[str, int], merges: list[tuple[str, str]]) -> HFTokenizer:
    add_space_prefix = _add_space_prefix(metadata)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None
    model = models.BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=False, byte_fallback=True)
    backend = HFTokenizer(model)
    replace = normalizers.Replace(" ", SPACE_MARKER)
    if add_space_prefix:
        backend.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARKER), replace])
    else:
        backend.normalizer = replace
    steps = [decoders.Replace(SPACE_MARKER, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(steps)
    return backend


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


def build_spm_backend(metadata: dict, tokens: list[str], types: list[int],
                      ids: dict[str, int] | None = None) -> tuple[HFTokenizer, SpmEncoder]:
    """(the decode-only `tokenizers` backend, the encoder). ``ids``: text_ids(tokens), when the
    caller has it (the backend's vocabulary)."""
    vocab = text_ids(tokens) if ids is None else ids
    backend = _backend(metadata, tokens, vocab, [])
    special_ids = np.flatnonzero(np.isin(np.asarray(types, dtype=np.int64), ADDED_TYPES))  # add_typed_tokens' set
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk_id = int(unk_id) if unk_id is not None and 0 <= int(unk_id) < len(tokens) else -1
    # llama.cpp's byte_to_token: "<0xNN>", else the byte's own one-character token (ASCII).
    byte_ids = [vocab.get(f"<0x{b:02X}>", vocab.get(chr(b), unk_id) if b < 0x80 else unk_id) for b in range(256)]
    encoder = SpmEncoder(tokens, np.asarray(_scores(metadata, len(tokens)), dtype=np.float32), special_ids,
                         np.asarray(byte_ids, dtype=np.int32), _add_space_prefix(metadata))
    return backend, encoder


def reference_backend(metadata: dict, tokens: list[str], types: list[int]) -> HFTokenizer:
    """The same vocabulary as a `tokenizers` BPE model with merges (spm_merges), encoding included:
    an implementation of the rule independent of cext.spm, for the tests."""
    return _backend(metadata, tokens, text_ids(tokens), spm_merges(tokens, _scores(metadata, len(tokens)), types))
