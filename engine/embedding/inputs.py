"""Embedding and scoring inputs -> token ids, on the caller's thread (the tokenizer releases the GIL).

Texts get the tokenizer's special tokens: an encoder's post-processor ([CLS] text [SEP], with
token types), a decoder's BOS where its tokenizer adds one. Token-id lists are taken as they are
(their special tokens are the caller's). Truncation keeps the start of an input (the right side
goes, as sentence-transformers and transformers truncate); over the limit without it is a
ContextLengthError naming the input.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import ContextLengthError, InvalidParameterError


@dataclass(slots=True)
class EncodedInputs:
    ids: list[list[int]]
    type_ids: list[list[int]] | None  # None: all zero (decoders, id inputs)

    @property
    def num_tokens(self) -> int:
        return sum(len(seq) for seq in self.ids)


def truncate_limit(truncate, max_len: int, param: str = "truncate") -> int | None:
    """``truncate``: False/None (over-length inputs are errors), True or -1 (to ``max_len``
    tokens), or k in 1..max_len (to k tokens) -> the token limit to cut at, or None."""
    if truncate is None or truncate is False:
        return None
    if truncate is True or (isinstance(truncate, int) and truncate == -1):
        return max_len
    if not isinstance(truncate, int) or isinstance(truncate, bool) or not 1 <= truncate <= max_len:
        raise InvalidParameterError(
            f"{param} must be a boolean, -1 or a token count in 1..{max_len} (the model's limit), "
            f"got {truncate!r}",
            param,
        )
    return truncate


def split_inputs(inputs, param: str = "input") -> list[str | list[int]]:
    """A string, a list of strings, a list of ids or a list of id lists -> a list of inputs."""
    if isinstance(inputs, str):
        return [inputs]
    if not isinstance(inputs, Sequence) or isinstance(inputs, (bytes, bytearray)) or not inputs:
        raise InvalidParameterError(
            f"{param} must be a string, a non-empty list of strings, a list of token ids "
            "or a list of token-id lists",
            param,
        )
    if all(_is_id(t) for t in inputs):
        return [list(inputs)]
    items = list(inputs)
    for i, item in enumerate(items):
        if isinstance(item, str):
            continue
        if isinstance(item, Sequence) and item and all(_is_id(t) for t in item):
            items[i] = list(item)
            continue
        raise InvalidParameterError(
            f"{param}[{i}] must be a string or a non-empty list of token ids", f"{param}[{i}]"
        )
    return items


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


class InputEncoder:
    """Tokenizes embedding inputs for one model: ``is_encoder`` models get the backend's
    post-processor (special tokens, token types), decoders the Tokenizer's own encode."""

    def __init__(self, tokenizer, vocab_size: int, max_len: int, is_encoder: bool):
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend
        self.vocab_size = vocab_size
        self.max_len = max_len
        self.is_encoder = is_encoder and self.backend.post_processor is not None
        self.num_special = self.backend.num_special_tokens_to_add(False) if self.is_encoder else 0
        self.num_special_pair = self.backend.num_special_tokens_to_add(True) if self.is_encoder else 0

    def encode(self, items: list[str | list[int]], limit: int | None, param: str = "input") -> EncodedInputs:
        texts = [(i, item) for i, item in enumerate(items) if isinstance(item, str)]
        ids: list[list[int] | None] = [None if isinstance(item, str) else item for item in items]
        type_ids: list[list[int]] | None = None
        if self.is_encoder and texts:
            type_ids = [[0] * len(seq) if seq is not None else None for seq in ids]
            encodings = self.backend.encode_batch_fast([t for _, t in texts], add_special_tokens=False)
            cut = None if limit is None else max(limit - self.num_special, 0)
            for (i, _), enc in zip(texts, encodings):
                if cut is not None and len(enc.ids) > cut:
                    enc.truncate(cut)
                done = self.backend.post_process(enc, None, True)
                ids[i], type_ids[i] = done.ids, done.type_ids
        elif texts:
            for (i, _), seq in zip(texts, self.tokenizer.encode_batch([t for _, t in texts])):
                ids[i] = seq
        for i, seq in enumerate(ids):
            if not seq:
                raise InvalidParameterError(
                    f"{param}[{i}] has no tokens", f"{param}[{i}]" if len(ids) > 1 else param
                )
            if limit is not None and len(seq) > limit:
                ids[i] = seq[:limit]
                if type_ids is not None:
                    type_ids[i] = type_ids[i][:limit]
            self._check(ids[i], i, len(ids), param)
        return EncodedInputs(ids, type_ids)

    def encode_pairs(self, query: str, documents: list[str], param: str = "documents") -> EncodedInputs:
        """[CLS] query [SEP] document [SEP] per document, cut longest-first to the model's length
        (as transformers truncates pairs)."""
        if not isinstance(query, str):
            raise InvalidParameterError("query must be a string", "query")
        if not isinstance(documents, Sequence) or isinstance(documents, str) or not documents:
            raise InvalidParameterError(f"{param} must be a non-empty list of strings", param)
        for i, doc in enumerate(documents):
            if not isinstance(doc, str):
                raise InvalidParameterError(f"{param}[{i}] must be a string", f"{param}[{i}]")
        if not self.is_encoder:
            raise InvalidParameterError(
                "scoring pairs needs a cross-encoder (BertForSequenceClassification)", "model"
            )
        (q,) = self.backend.encode_batch_fast([query], add_special_tokens=False)
        encodings = self.backend.encode_batch_fast(list(documents), add_special_tokens=False)
        budget = self.max_len - self.num_special_pair
        ids, type_ids = [], []
        for i, d in enumerate(encodings):
            num_q, num_d = _longest_first(len(q.ids), len(d.ids), budget)
            if num_q < 1:
                raise ContextLengthError(
                    f"query has no room beside {param}[{i}] in the model's {self.max_len} tokens",
                    "query",
                    max_model_len=self.max_len,
                )
            qi = _copy_truncated(self.backend, query, q, num_q)
            if num_d < len(d.ids):
                d.truncate(num_d)
            done = self.backend.post_process(qi, d, True)
            ids.append(done.ids)
            type_ids.append(done.type_ids)
        return EncodedInputs(ids, type_ids)

    def _check(self, seq: list[int], i: int, num_inputs: int, param: str) -> None:
        name = f"{param}[{i}]" if num_inputs > 1 else param
        if len(seq) > self.max_len:
            raise ContextLengthError(
                f"{name} has {len(seq)} tokens, more than the model's limit of {self.max_len}; "
                f"truncate it (truncate / truncate_prompt_tokens) or shorten it",
                param,
                max_model_len=self.max_len,
            )
        for t in seq:
            if not 0 <= t < self.vocab_size:
                raise InvalidParameterError(
                    f"{name} holds token id {t}, outside the vocabulary (0..{self.vocab_size - 1})", name
                )


def _longest_first(num_a: int, num_b: int, budget: int) -> tuple[int, int]:
    """transformers' "longest_first": drop a token from the longer side until both fit."""
    excess = num_a + num_b - budget
    if excess <= 0:
        return num_a, num_b
    if num_a > num_b:
        cut = min(excess, num_a - num_b)
        num_a, excess = num_a - cut, excess - cut
    elif num_b > num_a:
        cut = min(excess, num_b - num_a)
        num_b, excess = num_b - cut, excess - cut
    # equal lengths now: alternate (the first side loses the odd one)
    return num_a - (excess + 1) // 2, num_b - excess // 2


def _copy_truncated(backend, text: str, encoding, num_tokens: int):
    if num_tokens >= len(encoding.ids):
        return encoding
    (copy,) = backend.encode_batch_fast([text], add_special_tokens=False)
    copy.truncate(num_tokens)
    return copy
