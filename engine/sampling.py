"""Sampling from a batch of logits rows, with logprobs from one log-softmax per row.

Greedy rows take an argmax and never pay for a softmax unless they want logprobs.
Rows whose request asks for logits processing (penalties, logit_bias, ...: an
engine.logits_process.LogitsAdjuster) are adjusted first, for the whole batch at once, and
both the greedy argmax and the draw use the adjusted logits.
Random rows take softmax(logits / temperature) in NumPy, mask by min-p, top-k and top-p,
and invert the CDF at one uniform drawn from the request's own torch.Generator, so a
seeded request gives the same tokens whatever else is in the batch (and one random number
per token instead of one per vocabulary entry).
Logprobs always describe the model's raw distribution (before temperature and masks).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .logits_process import LogitsAdjuster, adjust
from .params import SamplingParams


@dataclass(slots=True)
class RowLogprobs:
    """Logprob of the chosen token and the top-k alternatives of one row."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


def mask_min_p(probs: np.ndarray, min_p: float) -> None:
    """Zero tokens with p < min_p * p_max (probs: [V] unnormalized, after temperature), in place."""
    probs[probs < min_p * probs.max()] = 0.0


def _mask_top_k(probs: np.ndarray, top_k: int) -> None:
    if top_k and top_k < probs.shape[0]:
        kth = np.partition(probs, -top_k)[-top_k]
        probs[probs < kth] = 0.0


def _mask_top_p(probs: np.ndarray, top_p: float) -> None:
    """Keep the smallest prefix (by probability) whose mass reaches top_p; the first token always stays."""
    order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order]
    cum_before = np.cumsum(sorted_probs) - sorted_probs
    probs[order[cum_before >= top_p * sorted_probs.sum()]] = 0.0


def sample_row(logits_row: np.ndarray, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Draw one token id from a [V] row of logits: softmax(logits / temperature) under the
    min-p, top-k and top-p masks, by inverting its CDF at one uniform from the request's generator
    (one random number per token, whatever the vocabulary)."""
    scaled = logits_row * np.float32(1.0 / params.temperature)  # [V] float32: half the cost of float64
    probs = np.exp(scaled - scaled.max())  # [V] unnormalized, max 1
    if params.min_p > 0.0:
        mask_min_p(probs, params.min_p)
    _mask_top_k(probs, params.top_k)
    if params.top_p < 1.0:
        _mask_top_p(probs, params.top_p)
    cdf = np.cumsum(probs)  # [V]
    u = float(torch.rand((), dtype=torch.float64, generator=generator))
    token_id = int(np.searchsorted(cdf, u * float(cdf[-1]), side="right"))
    while token_id > 0 and (token_id >= probs.shape[0] or probs[token_id] == 0.0):
        token_id -= 1  # float32 rounding at the very end of the CDF: step back onto a kept token
    return token_id


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
    # Logprobs describe the model's own distribution: taken before any processing.
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs for p in params) else None  # [S, V]
    if adjusters is not None and not logits.is_contiguous():
        logits = logits.contiguous()
    array = logits.numpy()  # [S, V] a view: adjusted in place
    if adjusters is not None:
        adjust(array, adjusters)
    # numpy's single-threaded argmax: torch's wakes its thread pool, which costs ~10x on a busy CPU.
    token_ids = array.argmax(axis=1).tolist()
    for row, p in enumerate(params):
        if not p.is_greedy:
            token_ids[row] = sample_row(array[row], p, generators[row])
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
