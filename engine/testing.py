"""ScriptedModel: the engine's model interface with no compute, for tests and host-cost benchmarks."""
from __future__ import annotations

import numpy as np
import torch

from .batch import ForwardBatch


class ScriptedModel:
    """At generated position i of every request, the highest logit is on token_ids[i].

    Once the script is exhausted the last id repeats, so greedy decoding emits the script
    and then its last token. Prompt rows (asked for by prompt_logprobs) get a flat row.
    Logits are 0 everywhere except ``peak`` on the scripted id and ``peak / 2`` on the
    next id in the script (so top-2 logprobs are distinct and deterministic).
    """

    def __init__(self, token_ids: list[int], vocab_size: int, peak: float = 20.0):
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        bad = [t for t in token_ids if not (0 <= t < vocab_size)]
        if bad:
            raise ValueError(f"token_ids contains ids outside [0, {vocab_size}): {bad[:5]}")
        self.vocab_size = vocab_size
        self.max_model_len = None
        self._script = np.array(list(token_ids) + [token_ids[-1]], dtype=np.int64)
        self._peak = peak

    def make_kv_cache(self, num_blocks: int, block_size: int) -> None:
        return None

    def forward(self, batch: ForwardBatch, kv_cache: object) -> torch.Tensor:
        # numpy throughout: tiny arrays cost ~1 us an op there (and never wake torch's thread
        # pool), so the host-cost benchmarks measure the engine rather than this double.
        rows = batch.logit_rows.numpy()  # [S]
        num_rows = rows.shape[0]
        logits = np.zeros((num_rows, self.vocab_size), dtype=np.float32)
        if num_rows:
            seq_of_row = np.searchsorted(batch.query_starts.numpy()[1:], rows, side="right")  # [S]
            generated_pos = batch.positions.numpy()[rows] + 1 - batch.prompt_lens.numpy()[seq_of_row]  # [S]
            index = np.minimum(np.maximum(generated_pos, 0), self._script.shape[0] - 2)
            peak = np.where(generated_pos >= 0, self._peak, 0.0).astype(np.float32)
            arange = np.arange(num_rows)
            logits[arange, self._script[index + 1]] = peak / 2
            logits[arange, self._script[index]] = peak
        return torch.from_numpy(logits)
