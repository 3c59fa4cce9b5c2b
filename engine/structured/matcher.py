"""Per-request grammar state and the batched token mask.

``GrammarMatcher`` is one request's position in its grammar: ``accept(token_id)`` advances it
with each sampled token (on the engine thread), ``is_finished`` says the grammar is complete
(no token but EOS could follow), and the request then ends with finish_reason "stop".

``apply_token_masks(logits, matchers)`` masks a whole batch each tick: llguidance's executor fills
one bitmask row per constrained sequence (in parallel, without the GIL) into a reused int32 buffer
[R, ceil(V / 32)], the bits are unpacked once for the batch and every disallowed logit becomes -inf.
Rows without a matcher are untouched. The engine masks a tick's rows (``mask_rows``) before it
samples, so, as in vLLM (whose model runner applies the grammar bitmask before the sampler takes
its logprobs), a constrained request's logprobs are those of the masked distribution: banned
tokens never appear among the top logprobs and the allowed ones are renormalized among
themselves. Unconstrained rows in the same batch are untouched.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from .compiler import CompiledGrammar
from .vocab import llguidance_module

if TYPE_CHECKING:
    import llguidance

log = logging.getLogger("engine")

# llguidance's mask threads; it parallelises across rows only, so small batches use one.
NUM_MASK_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))


class GrammarMatcher:
    """One request's grammar state (owned by the engine thread once submitted)."""

    __slots__ = ("grammar", "matcher", "num_accepted")

    def __init__(self, grammar: CompiledGrammar):
        self.grammar = grammar
        self.matcher = grammar.matcher()
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (the matcher is then stopped)."""
        is_ok = self.matcher.consume_token(token_id)
        if is_ok:
            self.num_accepted += 1
        else:
            log.warning("grammar %s rejected token %d: %s", self.grammar.spec.kind, token_id, self.matcher.get_error())
        return is_ok

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a resource limit hit while computing a mask, a rejected token), or None."""
        return self.matcher.get_error() if self.matcher.is_error() else None

    @property
    def is_finished(self) -> bool:
        """Complete (only EOS may follow) or failed."""
        return self.matcher.is_stopped()


class _Masks(threading.local):
    executor: llguidance.LLExecutor | None = None
    bitmask: np.ndarray | None = None  # [R, W] int32, reused


_local = _Masks()


def _executor() -> llguidance.LLExecutor:
    if _local.executor is None:
        _local.executor = llguidance_module().LLExecutor(num_threads=NUM_MASK_THREADS)
    return _local.executor


def fill_bitmask(matchers: list[GrammarMatcher], vocab_size: int) -> np.ndarray:
    """Bitmask rows [len(matchers), ceil(V / 32)] int32, bit j of word i = token 32 * i + j allowed."""
    num_words = (vocab_size + 31) // 32
    bitmask = _local.bitmask
    if bitmask is None or bitmask.shape[0] < len(matchers) or bitmask.shape[1] != num_words:
        bitmask = np.empty((max(len(matchers), 8), num_words), dtype=np.int32)
        _local.bitmask = bitmask
    rows = bitmask[: len(matchers)]  # [R, W] a contiguous view
    _executor().unsafe_compute_mask_ptr(
        [(m.matcher, i) for i, m in enumerate(matchers)], rows.ctypes.data, num_words * 4, len(matchers))
    return rows


def mask_rows(logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> torch.Tensor:
    """The engine tick's hook: ``logits`` [S, V] with each constrained row masked, as float32 and
    contiguous (in place when it already was)."""
    if logits.dtype != torch.float32 or not logits.is_contiguous():
        logits = logits.float().contiguous()
    apply_token_masks(logits.numpy(), matchers)
    return logits


def apply_token_masks(logits: np.ndarray, matchers: list[GrammarMatcher | None]) -> None:
    """Set every token a row's grammar disallows to -inf in ``logits`` [S, V] (float32, in place)."""
    row_ids = [row for row, m in enumerate(matchers) if m is not None]
    if row_ids:
        mask_logits(logits, row_ids, fill_bitmask([matchers[r] for r in row_ids], logits.shape[1]))


def mask_logits(logits: np.ndarray, row_ids: list[int], bitmask: np.ndarray) -> None:
    """``logits[row_ids[j], t] = -inf`` where bit t of ``bitmask[j]`` is 0 (logits [S, V] float32,
    bitmask [len(row_ids), ceil(V / 32)] int32, little-endian bit order within each word)."""
    vocab_size = logits.shape[1]
    banned_words = np.invert(bitmask)  # [R, W] int32: a 1 bit is a banned token
    is_banned = np.unpackbits(banned_words.view(np.uint8), axis=1, count=vocab_size,
                              bitorder="little").view(np.bool_)  # [R, V] 0/1 bytes read as bools
    if len(row_ids) == logits.shape[0]:
        np.copyto(logits, np.float32(-np.inf), where=is_banned)
    else:
        for j, row in enumerate(row_ids):
            np.copyto(logits[row], np.float32(-np.inf), where=is_banned[j])


__all__ = ["GrammarMatcher", "apply_token_masks", "fill_bitmask", "mask_logits", "mask_rows"]
