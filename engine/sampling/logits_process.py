"""Logits processing before a token is chosen: allowed_token_ids, min_tokens, logit_bias and
the repetition / frequency / presence penalties, applied to a whole batch at once.

Each request that asks for any of these owns a ``LogitsAdjuster``. Bias and penalties touch
only a few ids per row (the biased ones, the prompt's and the output's), so the adjuster
keeps those ids in one array with, per id, what happens to its logit: ``bias`` (added),
``scale`` (the repetition penalty, 1 for an id not yet seen) and ``sub`` (frequency * count +
presence). ``add(token_id)`` updates them in O(1) per generated token: never a re-scan of
the history. Per tick the sampler kernel (cext/sampler.pyx) reads those arrays, with
``allowed_ids`` and ``masked_ids_now()``, and applies ``l = rep(l + bias) - sub`` to the
touched ids of each row; ``adjust(logits, adjusters)`` is the same in NumPy for a whole batch
(the reference the tests compare the kernel with). Rows without an adjuster pay nothing.

Definitions (vLLM's order; ``l`` is a row of logits):
  allowed_token_ids   l[i] = -inf for every i not allowed
  bad_words           l[last] = -inf for each banned id sequence whose other ids end the output
                      (vLLM: each word encoded as is and with a leading space; one-token words always)
  min_tokens          l[stop ids] = -inf while fewer than min_tokens ids were generated
                      (stop ids: stop_token_ids plus EOS unless ignore_eos)
  logit_bias          l[i] += bias[i]                                          (OpenAI)
  repetition_penalty  for i in prompt + output: l[i] /= p if l[i] > 0 else l[i] *= p   (HF/vLLM)
  frequency_penalty   l[i] -= f * count[i]        count over generated ids     (OpenAI)
  presence_penalty    l[i] -= r * (count[i] > 0)                               (OpenAI)
"""
from __future__ import annotations

import numpy as np

from cext.sampler import TouchedIds

from ..params import SamplingParams


class LogitsAdjuster:
    """One request's logits processing and the token counts it needs."""

    __slots__ = (
        "min_tokens", "min_token_ids", "allowed_ids", "num_generated", "touched",
        "banned_ids", "bad_sequences", "recent_ids", "num_recent",
    )

    def __init__(self, params: SamplingParams, prompt_ids, stop_ids, max_tokens: int,
                 bad_words_ids: list[list[int]] = ()):
        self.num_generated = 0
        singles = sorted({ids[0] for ids in bad_words_ids if len(ids) == 1})
        self.banned_ids = np.array(singles, dtype=np.int64) if singles else None  # always -inf
        self.bad_sequences = [(tuple(ids[:-1]), ids[-1]) for ids in bad_words_ids if len(ids) > 1]
        self.num_recent = max((len(p) for p, _ in self.bad_sequences), default=0)
        self.recent_ids: list[int] = []  # the last num_recent generated ids
        self.min_tokens = params.min_tokens
        self.min_token_ids = np.array(sorted(stop_ids), dtype=np.int64) if params.min_tokens and stop_ids else None
        allowed = params.allowed_token_ids
        self.allowed_ids = np.array(allowed, dtype=np.int64) if allowed is not None else None
        bias = params.logit_bias or {}
        seen = set(prompt_ids) if params.repetition_penalty != 1.0 else set()
        touched = list(bias) + [t for t in seen if t not in bias]
        self.touched = TouchedIds(touched, list(bias.values()), seen, len(touched) + max_tokens,
                                  params.repetition_penalty, params.frequency_penalty, params.presence_penalty)

    @property
    def num_ids(self) -> int:
        return self.touched.num_ids

    @property
    def ids(self) -> np.ndarray:
        """[capacity] int64: the touched ids (the first num_ids)."""
        return self.touched.ids

    @property
    def bias(self) -> np.ndarray:
        """[capacity] float32, added first."""
        return self.touched.bias

    @property
    def scale(self) -> np.ndarray:
        """[capacity] float32, then l / scale if l > 0 else l * scale (1: not seen)."""
        return self.touched.scale

    @property
    def sub(self) -> np.ndarray:
        """[capacity] float32, then subtracted: frequency * count + presence."""
        return self.touched.sub

    @classmethod
    def for_request(cls, params: SamplingParams, prompt_ids, stop_ids, max_tokens: int,
                    bad_words_ids: list[list[int]] = ()) -> LogitsAdjuster | None:
        """An adjuster when the params ask for processing, else None (the sampler's fast path)."""
        if not params.has_logits_processing:
            return None
        if (not params.presence_penalty and not params.frequency_penalty and params.repetition_penalty == 1.0
                and not params.logit_bias and params.allowed_token_ids is None and not bad_words_ids
                and not stop_ids):
            return None  # min_tokens alone with nothing to mask
        return cls(params, prompt_ids, stop_ids, max_tokens, bad_words_ids)

    def banned_now(self) -> list[int]:
        """Last ids of the bad sequences whose other ids end the output (O(number of sequences))."""
        recent = self.recent_ids
        return [last for prefix, last in self.bad_sequences
                if len(prefix) <= len(recent) and tuple(recent[len(recent) - len(prefix):]) == prefix]

    def masked_ids_now(self) -> np.ndarray | None:
        """The ids set to -inf at this step (min_tokens stop ids, bad words), int64, or None."""
        parts = []
        if self.min_token_ids is not None and self.num_generated < self.min_tokens:
            parts.append(self.min_token_ids)
        if self.banned_ids is not None:
            parts.append(self.banned_ids)
        if self.bad_sequences:
            banned = self.banned_now()
            if banned:
                parts.append(np.array(banned, dtype=np.int64))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def add(self, token_id: int) -> None:
        """Count one generated id: O(1)."""
        self.num_generated += 1
        if self.num_recent:
            self.recent_ids.append(token_id)
            if len(self.recent_ids) > self.num_recent:
                del self.recent_ids[0]
        self.touched.add(token_id)


def adjust(logits: np.ndarray, adjusters: list[LogitsAdjuster | None]) -> None:
    """Apply each row's adjuster to ``logits`` [S, V] (float32, C-contiguous, in place); None rows
    are untouched. Per row only slices are collected; the arithmetic is one pass for the batch.

    The NumPy reference of the processing: the engine's sampler does the same per row in the
    kernel (cext.sampler, through engine.sampling.sampler.process); tests compare the two."""
    if not logits.flags.c_contiguous:
        raise ValueError("adjust needs C-contiguous logits (it scatters through a flat view)")
    vocab_size = logits.shape[1]
    flat_logits = logits.reshape(-1)  # [S * V] a view
    mask_index = []
    offsets, sizes, ids, bias, scale, sub = [], [], [], [], [], []
    for row, a in enumerate(adjusters):
        if a is None:
            continue
        if a.allowed_ids is not None:  # rare: a per-row O(V) mask
            kept = logits[row, a.allowed_ids]
            logits[row] = -np.inf
            logits[row, a.allowed_ids] = kept
        masked = a.masked_ids_now()
        if masked is not None:
            mask_index.append(masked + row * vocab_size)
        k = a.num_ids
        if k:
            offsets.append(row * vocab_size)
            sizes.append(k)
            ids.append(a.ids[:k])
            bias.append(a.bias[:k])
            scale.append(a.scale[:k])
            sub.append(a.sub[:k])
    if mask_index:
        flat_logits[np.concatenate(mask_index)] = -np.inf
    if offsets:
        index = np.repeat(np.array(offsets, dtype=np.int64), sizes) + np.concatenate(ids)  # ids distinct per row
        values = flat_logits[index] + np.concatenate(bias)
        scales = np.concatenate(scale)
        values = np.where(values > 0, values / scales, values * scales)
        values -= np.concatenate(sub)
        flat_logits[index] = values


__all__ = ["LogitsAdjuster", "adjust"]
