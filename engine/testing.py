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
        self._script = torch.tensor(list(token_ids) + [token_ids[-1]], dtype=torch.int64)
        self._peak = peak

    def make_kv_cache(self, num_blocks: int, block_size: int) -> None:
        return None

    def forward(self, batch: ForwardBatch, kv_cache: object) -> torch.Tensor:
        rows = batch.logit_rows  # [S]
        num_rows = rows.shape[0]
        # numpy allocates without waking torch's thread pool: this model measures host cost.
        logits = torch.from_numpy(np.zeros((num_rows, self.vocab_size), dtype=np.float32))
        if num_rows == 0:
            return logits
        seq_of_row = torch.searchsorted(batch.query_starts[1:], rows, right=True)  # [S]
        generated_pos = batch.positions[rows] + 1 - batch.prompt_lens[seq_of_row]  # [S]
        last = self._script.shape[0] - 2
        is_generated = generated_pos >= 0
        index = generated_pos.clamp(0, last)
        target = self._script[index]
        runner_up = self._script[index + 1]
        arange = torch.arange(num_rows)
        peak = torch.where(is_generated, self._peak, 0.0)
        logits[arange, runner_up] = peak / 2
        logits[arange, target] = peak
        return logits
