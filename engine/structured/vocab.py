"""The bridge from an engine Tokenizer to llguidance's ``LLTokenizer``.

llguidance needs, per token id, the token's raw bytes (what the id appends to the output),
which ids are special, the EOS id and a way to encode text. The bytes come from OUR
detokenizer's table (``engine.tokenizer.token_bytes.TokenPieces``), so every vocabulary the
engine loads works, GGUF ones included (byte-level BPE "Ġhi" -> b" hi", SentencePiece "▁hi" ->
b" hi", a byte-fallback "<0xE4>" -> b"\\xe4"). Ids past the tokenizer's table up to the model's
(padded) vocabulary are empty: llguidance never allows an empty token.

Building one costs ~0.1-0.5 s for a 50k-150k vocabulary; it is cached per (tokenizer,
vocab_size) for the tokenizer's lifetime.
"""
from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

from ..tokenizer.token_bytes import TokenPieces


class _Wrapper:
    """The duck type ``llguidance.LLTokenizer`` reads (see llguidance.TokenizerWrapper)."""

    def __init__(self, tokenizer, vocab_size: int):
        pieces = TokenPieces(tokenizer)
        num_ids = min(vocab_size, pieces.num_ids)
        tokens = [pieces.bytes_of(i) for i in range(num_ids)]
        special_ids = sorted(i for i in pieces.special_token_ids if i < vocab_size)
        for i in special_ids:  # a special token's text, as decode(skip_special_tokens=False) writes it
            tokens[i] = (tokenizer.id_to_token(i) or "").encode("utf-8")
        tokens.extend(b"" for _ in range(vocab_size - num_ids))
        eos_ids = [i for i in tokenizer.eos_token_ids if i < vocab_size]
        self.tokens = tokens
        self.special_token_ids = special_ids
        self.eos_token_id = eos_ids[0] if eos_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        self.is_tokenizer_wrapper = True
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


if TYPE_CHECKING:
    import llguidance


def llguidance_module():
    """llguidance, imported on first use: a server that never constrains a request never loads it
    (2.4 MB resident and ~5 ms of import beside torch)."""
    import llguidance

    return llguidance


_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def ll_tokenizer(tokenizer, vocab_size: int) -> llguidance.LLTokenizer:
    """The LLTokenizer of ``tokenizer`` over ``vocab_size`` ids (the model's logits width), cached."""
    with _lock:
        by_size = _cache.setdefault(tokenizer, {})
        cached = by_size.get(vocab_size)
        if cached is None:
            wrapper = _Wrapper(tokenizer, vocab_size)
            eos_ids = [i for i in tokenizer.eos_token_ids if i < vocab_size] or None
            cached = llguidance_module().LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos_ids)
            by_size[vocab_size] = cached
        return cached


__all__ = ["ll_tokenizer"]
