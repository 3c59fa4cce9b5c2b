"""ScriptedModel: the engine's model interface with no compute, for tests and host-cost benchmarks."""
from __future__ import annotations

import time

import numpy as np
import torch

from cext.cpu import busy_wait

from .batch import ForwardBatch

_MAX_REUSED_ROWS = 256  # rows of the reused logits buffer (50 MB at a 49k vocabulary)


class ScriptedModel:
    """At generated position i of every request, the highest logit is on token_ids[i].

    Once the script is exhausted the last id repeats, so greedy decoding emits the script
    and then its last token. Prompt rows (asked for by prompt_logprobs) get a flat row.
    Logits are 0 everywhere except ``peak`` on the scripted id and ``peak / 2`` on the
    next id in the script (so top-2 logprobs are distinct and deterministic). The logits
    returned are valid until the next forward (one buffer, reused).

    ``step_seconds``: a forward lasts at least this long: it waits what its own work left
    of it, with the GIL released (as the real kernels run), so the double stands in for a
    model of a given speed at any batch size (1/650: 650 tok/s per stream); it writes its logits after the wait,
    as a model's last product does. The wait spins on
    its core, as a kernel computes: a sleep lets the virtual CPU halt, wakes ~0.1 ms late (at
    times milliseconds) and leaves the engine thread's caches cold (its tick took 2-3x as long
    after a 1.5 ms sleep as after a 1.5 ms spin; measured on this VM, a 650 tok/s double ran at
    ~600 sleeping, ~640 spinning).
    """

    def __init__(self, token_ids: list[int], vocab_size: int, peak: float = 20.0, step_seconds: float = 0.0):
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        bad = [t for t in token_ids if not (0 <= t < vocab_size)]
        if bad:
            raise ValueError(f"token_ids contains ids outside [0, {vocab_size}): {bad[:5]}")
        if not step_seconds >= 0:
            raise ValueError(f"step_seconds must be >= 0, got {step_seconds!r}")
        self.step_seconds = float(step_seconds)
        self._work_seconds = 0.0  # the last forward's own work: the next one waits the rest of its step
        self.vocab_size = vocab_size
        self.max_model_len = None
        self._script = np.array(list(token_ids) + [token_ids[-1]], dtype=np.int64)
        self._peak = peak
        # Reused across forwards, as a real model's output buffer is: fresh np.zeros pages are
        # mapped lazily, so the sampler's first read of each row page-faulted ~48 times (at a
        # 49k vocabulary), a cost of this double that no real model's written logits have.
        self._logits = np.zeros((0, vocab_size), dtype=np.float32)  # [capacity, V]

    def make_kv_cache(self, num_blocks: int, block_size: int) -> None:
        return None

    def forward(self, batch: ForwardBatch, kv_cache: object) -> torch.Tensor:
        if self.step_seconds:  # the wait first: a model's logits are its last product, hot when it returns
            left = self.step_seconds - self._work_seconds
            if left > 0:
                busy_wait(left)  # holds the core, the GIL released: as a kernel runs
        start = time.perf_counter()
        # numpy throughout: tiny arrays cost ~1 us an op there (and never wake torch's thread
        # pool), so the host-cost benchmarks measure the engine rather than this double.
        rows = batch.array("logit_rows")  # [S]
        num_rows = rows.shape[0]
        if num_rows > _MAX_REUSED_ROWS:  # many prompt-logprob rows: not kept past this forward
            logits = np.zeros((num_rows, self.vocab_size), dtype=np.float32)
        else:
            if self._logits.shape[0] < num_rows:
                self._logits = np.zeros((min(_MAX_REUSED_ROWS, max(num_rows, 2 * self._logits.shape[0])),
                                         self.vocab_size), dtype=np.float32)
            logits = self._logits[:num_rows]
            logits.fill(0.0)  # the engine processes the rows in place
        if num_rows:
            seq_of_row = np.searchsorted(batch.array("query_starts")[1:], rows, side="right")  # [S]
            generated_pos = batch.array("positions")[rows] + 1 - batch.array("prompt_lens")[seq_of_row]  # [S]
            index = np.minimum(np.maximum(generated_pos, 0), self._script.shape[0] - 2)
            peak = np.where(generated_pos >= 0, self._peak, 0.0).astype(np.float32)
            arange = np.arange(num_rows)
            logits[arange, self._script[index + 1]] = peak / 2
            logits[arange, self._script[index]] = peak
        self._work_seconds = time.perf_counter() - start
        return torch.from_numpy(logits)
