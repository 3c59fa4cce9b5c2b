"""Sampling from a batch of logits rows, with logprobs from one log-softmax per row.

Greedy rows take an argmax and never pay for a softmax unless they want logprobs.
Rows whose request asks for logits processing (penalties, logit_bias, ...: an
engine.logits_process.LogitsAdjuster) are adjusted first, for the whole batch at once, and
both the greedy argmax and the draw use the adjusted logits.
Random rows scale the log-softmax by 1/temperature, mask by min-p, top-k and top-p, and draw
with the request's own torch.Generator (the exponential-race form of a categorical
draw), so a seeded request gives the same tokens whatever else is in the batch.
Logprobs always describe the model's raw distribution (before temperature and masks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .logits_process import LogitsAdjuster, adjust
from .params import SamplingParams


@dataclass(slots=True)
class RowLogprobs:
    """Logprob of the chosen token and the top-k alternatives of one row."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def _mask_top_k_top_p(scaled: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    # scaled: [V] log-probabilities / temperature
    if top_k and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_vals, sorted_idx = torch.sort(scaled, descending=True)
        probs = torch.softmax(sorted_vals, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        cum_before = torch.cumsum(probs, dim=-1) - probs
        drop = cum_before >= top_p
        sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(0, sorted_idx, sorted_vals)
    return scaled


def mask_min_p(scaled: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens with p < min_p * p_max (scaled: [V] log-probabilities after temperature, any shift):
    in log space, log p < log p_max + log min_p."""
    return scaled.masked_fill(scaled < scaled.max() + math.log(min_p), float("-inf"))


def sample_row(logprobs_row: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one token id from a [V] row of log-probabilities."""
    scaled = logprobs_row / params.temperature
    if params.min_p > 0.0:
        scaled = mask_min_p(scaled, params.min_p)
    scaled = _mask_top_k_top_p(scaled, params.top_k, params.top_p)
    # argmax(p / E) with E ~ Exp(1) is a draw from p; in log space: scaled - log(E).
    noise = torch.empty_like(scaled).exponential_(generator=generator)
    return int(torch.argmax(scaled - torch.log(noise)))


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    adjusters: list[LogitsAdjuster | None] | None = None,
) -> tuple[list[int], list[RowLogprobs | None]]:
    """Sample one token per row of logits [S, V]; returns ids and per-row logprobs (or None).

    ``adjusters``: per row, the request's LogitsAdjuster or None; None for the whole batch
    when no row has one (the fast path). The rows of ``logits`` are adjusted in place.
    """
    num_rows = logits.shape[0]
    if num_rows == 0:
        return [], []
    if logits.dtype != torch.float32:
        logits = logits.float()
    raw_logprobs = None  # [S, V] the model's own distribution, for logprobs
    if adjusters is not None:
        if any(p.logprobs for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        adjust(logits.numpy(), adjusters)
    is_random = [not p.is_greedy for p in params]
    need_softmax = any(is_random) or (raw_logprobs is None and any(p.logprobs for p in params))
    logprobs = torch.log_softmax(logits, dim=-1) if need_softmax else None  # [S, V]
    if raw_logprobs is None:
        raw_logprobs = logprobs
    # numpy's single-threaded argmax: torch's wakes its thread pool, which costs ~10x on a busy CPU.
    token_ids = logits.numpy().argmax(axis=1).tolist()
    for row, p in enumerate(params):
        if is_random[row]:
            token_ids[row] = sample_row(logprobs[row], p, generators[row])
    row_logprobs: list[RowLogprobs | None] = [None] * num_rows
    lp_rows = [row for row, p in enumerate(params) if p.logprobs]
    if lp_rows:
        index = torch.tensor(lp_rows, dtype=torch.int64)
        chosen = torch.tensor([token_ids[r] for r in lp_rows], dtype=torch.int64)
        sub = raw_logprobs if len(lp_rows) == num_rows else raw_logprobs.index_select(0, index)  # [L, V]
        chosen_lp = sub.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
        max_k = max(params[r].top_logprobs for r in lp_rows)
        if max_k:
            top = torch.topk(sub, max_k, dim=-1)
            top_vals, top_ids = top.values.tolist(), top.indices.tolist()
        for j, row in enumerate(lp_rows):
            k = params[row].top_logprobs
            row_logprobs[row] = RowLogprobs(
                logprob=chosen_lp[j],
                top_ids=top_ids[j][:k] if k else [],
                top_logprobs=top_vals[j][:k] if k else [],
            )
    return token_ids, row_logprobs


def prompt_logprobs(
    logits: torch.Tensor, target_ids: list[int], k: int
) -> list[RowLogprobs]:
    """Logprobs of target_ids[i] under logits row i [N, V], with the top k of each row."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
    targets = torch.tensor(target_ids, dtype=torch.int64).unsqueeze(1)
    chosen = lp.gather(1, targets).squeeze(1).tolist()
    if k:
        top = torch.topk(lp, k, dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    else:
        top_vals = top_ids = [[] for _ in target_ids]
    return [RowLogprobs(chosen[i], top_ids[i], top_vals[i]) for i in range(len(target_ids))]
