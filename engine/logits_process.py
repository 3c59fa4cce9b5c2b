"""Logits processing before a token is chosen: allowed_token_ids, min_tokens, logit_bias and
the repetition / frequency / presence penalties, applied to a whole batch at once.

Each request that asks for any of these owns a ``LogitsAdjuster``: its static arrays (bias
ids and values, the ids min_tokens masks) are built once, and its token counts are kept
incrementally by ``add(token_id)``: O(1) per generated token, never a re-scan of the
history. Per tick, ``adjust(logits, rows)`` concatenates the rows' arrays and does one
gather/scatter per kind of processing over the whole batch, so the per-row Python cost is a
few slices; rows without an adjuster pay nothing.

Definitions (vLLM's order; ``l`` is a row of logits):
  allowed_token_ids   l[i] = -inf for every i not allowed
  min_tokens          l[stop ids] = -inf while fewer than min_tokens ids were generated
                      (stop ids: stop_token_ids plus EOS unless ignore_eos)
  logit_bias          l[i] += bias[i]                                          (OpenAI)
  repetition_penalty  for i in prompt + output: l[i] /= p if l[i] > 0 else l[i] *= p   (HF/vLLM)
  frequency_penalty   l[i] -= f * count[i]        count over generated ids     (OpenAI)
  presence_penalty    l[i] -= r * (count[i] > 0)                               (OpenAI)
"""
from __future__ import annotations

import numpy as np

from .params import SamplingParams

class LogitsAdjuster:
    """One request's logits processing and the token counts it needs."""

    __slots__ = (
        "min_tokens", "min_token_ids", "bias_ids", "bias_values", "allowed_ids",
        "repetition_penalty", "frequency_penalty", "presence_penalty", "num_generated",
        "out_slot", "out_ids", "out_counts", "num_out", "is_seen", "seen_ids", "num_seen",
    )

    def __init__(self, params: SamplingParams, prompt_ids, stop_ids, vocab_size: int, max_tokens: int):
        self.num_generated = 0
        self.min_tokens = params.min_tokens
        self.min_token_ids = np.array(sorted(stop_ids), dtype=np.int64) if params.min_tokens and stop_ids else None
        if params.logit_bias:
            self.bias_ids = np.fromiter(params.logit_bias.keys(), dtype=np.int64, count=len(params.logit_bias))
            self.bias_values = np.fromiter(params.logit_bias.values(), dtype=np.float32, count=len(params.logit_bias))
        else:
            self.bias_ids = self.bias_values = None
        allowed = params.allowed_token_ids
        self.allowed_ids = np.array(allowed, dtype=np.int64) if allowed is not None else None
        self.repetition_penalty = float(params.repetition_penalty)
        self.frequency_penalty = float(params.frequency_penalty)
        self.presence_penalty = float(params.presence_penalty)
        self.out_slot = self.out_ids = self.out_counts = None
        self.num_out = 0
        if self.frequency_penalty or self.presence_penalty:
            self.out_slot = np.zeros(vocab_size, dtype=np.int32)  # [V] 1 + index into out_ids; 0: not generated
            self.out_ids = np.empty(max_tokens, dtype=np.int64)  # distinct generated ids, first-seen order
            self.out_counts = np.zeros(max_tokens, dtype=np.float32)  # their counts
        self.is_seen = self.seen_ids = None
        self.num_seen = 0
        if self.repetition_penalty != 1.0:
            unique_prompt = np.unique(np.asarray(prompt_ids, dtype=np.int64))
            self.is_seen = np.zeros(vocab_size, dtype=np.bool_)  # [V] in prompt or output
            self.is_seen[unique_prompt] = True
            self.seen_ids = np.empty(unique_prompt.size + max_tokens, dtype=np.int64)
            self.seen_ids[: unique_prompt.size] = unique_prompt
            self.num_seen = int(unique_prompt.size)

    @classmethod
    def for_request(cls, params: SamplingParams, prompt_ids, stop_ids, vocab_size: int,
                    max_tokens: int) -> LogitsAdjuster | None:
        """An adjuster when the params ask for processing, else None (the sampler's fast path)."""
        if not params.has_logits_processing:
            return None
        if (not params.presence_penalty and not params.frequency_penalty and params.repetition_penalty == 1.0
                and not params.logit_bias and params.allowed_token_ids is None and not stop_ids):
            return None  # min_tokens alone with nothing to mask
        return cls(params, prompt_ids, stop_ids, vocab_size, max_tokens)

    def add(self, token_id: int) -> None:
        """Count one generated id: O(1)."""
        self.num_generated += 1
        if self.out_slot is not None:
            slot = self.out_slot[token_id]
            if slot:
                self.out_counts[slot - 1] += 1
            else:
                k = self.num_out
                self.out_ids[k] = token_id
                self.out_counts[k] = 1
                self.out_slot[token_id] = k + 1
                self.num_out = k + 1
        if self.is_seen is not None and not self.is_seen[token_id]:
            self.is_seen[token_id] = True
            self.seen_ids[self.num_seen] = token_id
            self.num_seen += 1


def adjust(logits: np.ndarray, adjusters: list[LogitsAdjuster | None]) -> None:
    """Apply each row's adjuster to ``logits`` [S, V] (float32, in place); None rows are untouched."""
    mask_rows, mask_ids = [], []
    bias_rows, bias_ids, bias_values = [], [], []
    rep_rows, rep_ids, rep_penalties = [], [], []
    pen_rows, pen_ids, pen_counts, pen_freq, pen_pres = [], [], [], [], []
    for row, a in enumerate(adjusters):
        if a is None:
            continue
        if a.allowed_ids is not None:  # rare: a per-row O(V) mask
            kept = logits[row, a.allowed_ids]
            logits[row] = -np.inf
            logits[row, a.allowed_ids] = kept
        if a.min_token_ids is not None and a.num_generated < a.min_tokens:
            mask_ids.append(a.min_token_ids)
            mask_rows.append(np.full(a.min_token_ids.size, row, dtype=np.int64))
        if a.bias_ids is not None:
            bias_ids.append(a.bias_ids)
            bias_values.append(a.bias_values)
            bias_rows.append(np.full(a.bias_ids.size, row, dtype=np.int64))
        if a.num_seen:
            rep_ids.append(a.seen_ids[: a.num_seen])
            rep_rows.append(np.full(a.num_seen, row, dtype=np.int64))
            rep_penalties.append(a.repetition_penalty)
        if a.num_out:
            k = a.num_out
            pen_ids.append(a.out_ids[:k])
            pen_counts.append(a.out_counts[:k])
            pen_rows.append(np.full(k, row, dtype=np.int64))
            pen_freq.append(a.frequency_penalty)
            pen_pres.append(a.presence_penalty)
    if mask_ids:
        logits[np.concatenate(mask_rows), np.concatenate(mask_ids)] = -np.inf
    if bias_ids:  # ids within a row are distinct: += is a plain scatter
        logits[np.concatenate(bias_rows), np.concatenate(bias_ids)] += np.concatenate(bias_values)
    if rep_ids:
        rows, ids = np.concatenate(rep_rows), np.concatenate(rep_ids)
        penalty = np.repeat(np.array(rep_penalties, dtype=np.float32), [r.size for r in rep_rows])
        values = logits[rows, ids]
        logits[rows, ids] = np.where(values > 0, values / penalty, values * penalty)
    if pen_ids:
        sizes = [r.size for r in pen_rows]
        counts = np.concatenate(pen_counts)
        freq = np.repeat(np.array(pen_freq, dtype=np.float32), sizes)
        pres = np.repeat(np.array(pen_pres, dtype=np.float32), sizes)
        logits[np.concatenate(pen_rows), np.concatenate(pen_ids)] -= freq * counts + pres


__all__ = ["LogitsAdjuster", "adjust"]
