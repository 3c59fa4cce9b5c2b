"""Embedding and scoring jobs of an encoder, run on the engine thread (an encoder generates
nothing, so there are no generation ticks to join; a decoder's rows join them instead:
engine/embedding/tick_rows.py).

An EmbedJob holds one call's encoded inputs, sorted by length. The engine's EmbedBatcher runs
the waiting jobs a packed chunk per ``step``, inputs of several calls in one forward, up to
IDLE_TOKENS (or the tick budget, if larger). Nothing is kept between chunks (an encoder has no
KV cache). Results go to a ``concurrent.futures.Future`` ([N, D] float32 in input order, or
[N, num_labels] scores).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading

import numpy as np
import torch

from .inputs import EncodedInputs
from .pooling import pool

# Tokens per chunk when no generation runs. Small on purpose: on this 2-core host under load (~19)
# all-MiniLM-L6-v2 ran 28 texts/s in 256-token chunks, 12 in 1,024, 6 in 4,096 (64 texts of 10-250
# tokens, medians of 3 interleaved reps): a small chunk's activations stay in the core's cache.
IDLE_TOKENS = 256


class EncoderRunner:
    """A BERT-family model (engine.models.bert.BertModel)."""

    def __init__(self, model):
        from ..models.bert import pack_rows

        self.model = model
        self.size = model.hidden_size
        self.pack_rows = pack_rows

    def embed(self, ids: list[list[int]], type_ids: list[list[int]] | None, pooling: str) -> torch.Tensor:
        batch = self.pack_rows(ids, type_ids)
        return pool(self.model.encode(batch), batch.starts, pooling)  # [B, E]

    def score(self, ids: list[list[int]], type_ids: list[list[int]] | None) -> torch.Tensor:
        batch = self.pack_rows(ids, type_ids)
        return self.model.classify(self.model.encode(batch), batch.starts).float()  # [B, num_labels]


class EmbedJob:
    """One embed or score call: its inputs (taken shortest first) and its future."""

    def __init__(self, inputs: EncodedInputs, pooling: str | None):
        self.inputs = inputs
        self.pooling = pooling  # None: score with the classification head
        self.order = sorted(range(len(inputs.ids)), key=lambda i: len(inputs.ids[i]))
        self.next = 0
        self.num_done = 0
        self.out: np.ndarray | None = None
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.future.set_running_or_notify_cancel()
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True  # the engine thread drops the job at its next step

    @property
    def has_more(self) -> bool:
        return self.next < len(self.order)

    def take(self, num_tokens: int, may_exceed: bool) -> tuple[list[int], int]:
        """The next inputs that fit ``num_tokens`` (at least one if ``may_exceed``) -> (indices, tokens)."""
        ids = self.inputs.ids
        chunk, used = [], 0
        while self.next < len(self.order):
            i = self.order[self.next]
            if used + len(ids[i]) > num_tokens and not (may_exceed and not chunk):
                break
            chunk.append(i)
            used += len(ids[i])
            self.next += 1
        return chunk, used

    def put(self, indices: list[int], values: np.ndarray) -> None:
        if self.out is None:
            self.out = np.empty((len(self.inputs.ids), values.shape[1]), dtype=np.float32)
        self.out[indices] = values
        self.num_done += len(indices)
        if self.num_done == len(self.inputs.ids) and not self.future.done():
            self.future.set_result(self.out)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class EmbedBatcher:
    """The engine's embedding work, one job of the engine thread (EngineCore.submit_job) while any
    call waits: each ``step`` packs one chunk from the oldest calls of one kind (same pooling, or
    scores), several calls' inputs in one forward, and hands each call its rows."""

    def __init__(self, core, runner, busy_tokens: int):
        self.core = core
        self.runner = runner
        self.busy_tokens = busy_tokens
        self._lock = threading.Lock()
        self._jobs: collections.deque[EmbedJob] = collections.deque()
        self._is_scheduled = False

    def submit(self, job: EmbedJob) -> None:
        with self._lock:
            self._jobs.append(job)
            is_new = not self._is_scheduled
            self._is_scheduled = True
        if is_new:
            try:
                self.core.submit_job(self)
            except BaseException:
                with self._lock:
                    self._is_scheduled = False
                    self._jobs.remove(job)
                raise

    def step(self, is_busy: bool) -> bool:
        budget = self.busy_tokens if is_busy else max(IDLE_TOKENS, self.busy_tokens)
        with self._lock:
            for job in [j for j in self._jobs if j.cancelled]:
                self._jobs.remove(job)
                job.fail(concurrent.futures.CancelledError())
            pending = [j for j in self._jobs if j.has_more]
        if pending:
            self._run_chunk(pending, budget)
        with self._lock:
            self._jobs = collections.deque(j for j in self._jobs if not j.future.done())
            if self._jobs:
                return False
            self._is_scheduled = False
            return True

    def _run_chunk(self, pending: list[EmbedJob], budget: int) -> None:
        pooling = pending[0].pooling
        parts, num_tokens = [], 0
        for job in pending:
            if job.pooling != pooling:
                continue
            indices, used = job.take(budget - num_tokens, may_exceed=not parts)
            if indices:
                parts.append((job, indices))
                num_tokens += used
            if num_tokens >= budget:
                break
        ids = [job.inputs.ids[i] for job, indices in parts for i in indices]
        has_types = any(job.inputs.type_ids is not None for job, _ in parts)
        types = None
        if has_types:
            types = [
                job.inputs.type_ids[i] if job.inputs.type_ids is not None else [0] * len(job.inputs.ids[i])
                for job, indices in parts
                for i in indices
            ]
        try:
            if pooling is None:
                values = self.runner.score(ids, types)  # [b, num_labels]
            else:
                values = self.runner.embed(ids, types, pooling)  # [b, E]
        except Exception as exc:  # the calls in this chunk fail, the others go on
            for job, _ in parts:
                job.fail(exc)
            return
        values = values.numpy()
        row = 0
        for job, indices in parts:
            job.put(indices, values[row : row + len(indices)])
            row += len(indices)

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            jobs, self._jobs = list(self._jobs), collections.deque()
            self._is_scheduled = False
        for job in jobs:
            job.fail(exc)
