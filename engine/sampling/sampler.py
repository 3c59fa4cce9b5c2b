"""Sampling from a batch of logits rows: one call of the sampler kernel (cext.sampler).

Per row, with the GIL released: the request's logits processing (its
engine.sampling.logits_process.LogitsAdjuster: allowed ids, masks, logit_bias, penalties over the few
ids they touch), then the choice (greedy argmax, or softmax(logits / temperature) under the
min-p, top-k and top-p masks by partial selection, drawn by inverting the CDF in id order at
one uniform from the request's own ``RandomStream``, so a seeded request gives the same tokens
whatever else is in the batch), then, if asked, the logprob, rank and top logprobs.
Logprobs always describe the model's raw distribution (before processing, temperature, masks).
tests/sampling_reference.py holds the same definitions in plain NumPy (the tests' reference).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np
import torch

from cext.sampler import RandomStream, logprob_rows, sample_rows

from ..params import SamplingParams
from .logits_process import LogitsAdjuster


@dataclass(slots=True)
class RowLogprobs:
    """Logprob and rank of the chosen token and the top-k alternatives of one row."""

    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]
    rank: int | None = None  # 1 + number of other ids at least as likely (vLLM's rank)


def random_stream(seed: int | None) -> RandomStream:
    """A request's stream: the same uniforms as torch.Generator().manual_seed(seed) (its low 32 bits)."""
    return RandomStream(seed % (1 << 64) if seed is not None else secrets.randbits(63))


def _as_array(logits: torch.Tensor) -> np.ndarray:
    if logits.dtype != torch.float32:
        logits = logits.float()
    if not logits.is_contiguous():
        logits = logits.contiguous()
    return logits.numpy()  # a view: processed in place


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[RandomStream | None],
    adjusters: list[LogitsAdjuster | None] | None = None,
) -> tuple[list[int], list[RowLogprobs | None]]:
    """Sample one token per row of logits [S, V]; returns ids and per-row logprobs (or None).

    ``generators``: per row the request's RandomStream (None for greedy rows). ``adjusters``:
    per row the request's LogitsAdjuster or None; None for the whole batch when no row has
    one. The rows of ``logits`` are processed in place.
    """
    if logits.shape[0] == 0:
        return [], []
    token_ids, rows = sample_rows(_as_array(logits), params, generators, adjusters)
    if rows.count(None) == len(rows):  # no row asked for logprobs
        return token_ids, rows
    row_logprobs = [None if r is None else RowLogprobs(r[0], r[2], r[3], r[1]) for r in rows]
    return token_ids, row_logprobs


def process(logits: torch.Tensor | np.ndarray, adjusters: list[LogitsAdjuster | None]) -> None:
    """Only the logits processing of ``sample``, in place (for tests against the NumPy reference)."""
    array = logits if isinstance(logits, np.ndarray) else _as_array(logits)
    greedy = SamplingParams(temperature=0)
    sample_rows(array, [greedy] * array.shape[0], [None] * array.shape[0], adjusters, process_only=True)


def prompt_logprobs(logits: torch.Tensor, target_ids: list[int], k: int) -> list[RowLogprobs]:
    """Logprobs (and ranks) of target_ids[i] under logits row i [N, V], with the top k of each row."""
    lp, ranks, top_ids, top_vals = logprob_rows(_as_array(logits), np.asarray(target_ids, dtype=np.int64), k)
    top_ids, top_vals = top_ids.tolist(), top_vals.tolist()
    return [RowLogprobs(float(lp[i]), top_ids[i], top_vals[i], int(ranks[i])) for i in range(len(target_ids))]
