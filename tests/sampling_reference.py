"""The sampler's definitions in plain NumPy, one row at a time: the reference the kernel
(cext.sampler, used by engine.sampling) is tested against, and the sampler this engine had
before the kernel. Not on the engine's path.

A random row is softmax(logits / temperature) under the min-p, top-k and top-p masks (in
that order, each over what the previous kept), drawn by inverting the CDF in id order at one
uniform ``u`` in [0, 1) from the request's stream.
"""
from __future__ import annotations

import numpy as np

from engine.params import SamplingParams


def mask_min_p(probs: np.ndarray, min_p: float) -> None:
    """Zero tokens with p < min_p * p_max (probs: [V] unnormalized, after temperature), in place."""
    probs[probs < min_p * probs.max()] = 0.0


def mask_top_k(probs: np.ndarray, top_k: int) -> None:
    """Zero every token below the k-th largest (ties with it stay), in place."""
    if top_k and top_k < probs.shape[0]:
        kth = np.partition(probs, -top_k)[-top_k]
        probs[probs < kth] = 0.0


def mask_top_p(probs: np.ndarray, top_p: float) -> None:
    """Keep the smallest prefix (by probability, ties by lower id) whose mass reaches top_p;
    the first token always stays. In place."""
    order = np.argsort(-probs, kind="stable")
    sorted_probs = probs[order]
    cum_before = np.cumsum(sorted_probs) - sorted_probs
    probs[order[cum_before >= top_p * sorted_probs.sum()]] = 0.0


def weights(logits_row: np.ndarray, params: SamplingParams) -> np.ndarray:
    """[V] float64 unnormalized probabilities a random row draws from (0: masked)."""
    scaled = logits_row.astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())  # [V], max 1
    if params.min_p > 0.0:
        mask_min_p(probs, params.min_p)
    mask_top_k(probs, params.top_k)
    if params.top_p < 1.0:
        mask_top_p(probs, params.top_p)
    return probs


def draw(probs: np.ndarray, u: float) -> int:
    """Invert the CDF of probs [V] (id order) at u * total: the first id whose running sum passes it."""
    cdf = np.cumsum(probs)  # [V] float64
    token_id = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    while token_id > 0 and (token_id >= probs.shape[0] or probs[token_id] == 0.0):
        token_id -= 1  # rounding at the very end of the CDF: step back onto a kept token
    return token_id


def sample_row(logits_row: np.ndarray, params: SamplingParams, u: float | None) -> int:
    """One token from a [V] row of (processed) logits: argmax when greedy, else a draw at u."""
    if params.is_greedy:
        return int(np.argmax(logits_row))
    return draw(weights(logits_row, params), u)


def logprob_row(raw_row: np.ndarray, token_id: int, k: int) -> tuple[float, int, list[int], list[float]]:
    """(logprob, rank, top ids, top logprobs) of token_id under log_softmax(raw_row); rank as
    vLLM's: the number of ids whose logprob is >= the token's (1 = the best); ties by lower id."""
    lp = raw_row.astype(np.float64) - raw_row.max()
    lp -= np.log(np.exp(lp).sum())
    order = np.argsort(-lp, kind="stable")[:k]
    return float(lp[token_id]), int((lp >= lp[token_id]).sum()), order.tolist(), lp[order].tolist()
