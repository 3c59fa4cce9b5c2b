"""GGUF "llama" vocabularies: SentencePiece BPE as llama.cpp runs it (`llm_tokenizer_spm`).

llama.cpp replaces spaces with U+2581, prefixes a space to every text fragment that starts the
input or follows a special token (`add_space_prefix`), splits into UTF-8 characters and then keeps
merging the adjacent pair whose concatenation is the vocabulary token of highest score. Characters
no merge covers and that are not tokens come out as byte tokens `<0xNN>`.

In `tokenizers` terms: a BPE model whose merges are every (left, right) split of a token into two
tokens, ranked by the merged token's score (best first), with byte_fallback; normalizers Prepend
"▁" (applied per fragment between added tokens, which is llama.cpp's rule) and Replace " " -> "▁";
decoders that undo both.
"""
from __future__ import annotations

import numpy as np
from cext.gguf_strings import pairs_in_order, two_token_splits  # the GGUF reader needs cext built anyway
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from .gguf_special import TokenType, text_ids

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


def build_spm_backend(metadata: dict, tokens: list[str], types: list[int],
                      ids: dict[str, int] | None = None) -> HFTokenizer:
    """``ids``: text_ids(tokens), when the caller has it (the BPE model's vocabulary)."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        scores = [0.0] * len(tokens)
    elif len(scores) < len(tokens):
        raise ValueError(f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    add_space_prefix = metadata.get("tokenizer.ggml.add_space_prefix")
    add_space_prefix = True if add_space_prefix is None else bool(add_space_prefix)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[int(unk_id)] if unk_id is not None and 0 <= int(unk_id) < len(tokens) else None

    vocab = text_ids(tokens) if ids is None else ids
    model = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores, types), unk_token=unk_token,
                       fuse_unk=False, byte_fallback=True)
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
