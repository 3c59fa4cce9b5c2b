"""Embedding and scoring jobs, run on the engine thread between scheduler ticks.

A job holds one call's encoded inputs, sorted by length, and runs them a packed chunk per
``step``: at most ``busy_tokens`` (the tick budget) while generation streams run beside it, so a
stream waits for no more than one tick's worth of prefill; up to ``idle_tokens`` otherwise.
Nothing is kept between chunks: an encoder has no KV cache, and a decoder's chunk writes its
K/V into a scratch cache that the next chunk overwrites. Results go to a
``concurrent.futures.Future`` ([N, D] float32 in input order, or [N, num_labels] scores).
"""

from __future__ import annotations

import concurrent.futures

import numpy as np
import torch

from ..batch import ForwardBatch
from .inputs import EncodedInputs
from .pooling import pool, pooled_rows

IDLE_TOKENS = 4096  # tokens per chunk when no generation runs (a packed forward of this size)


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


class DecoderRunner:
    """A generation model of the engine's interface with ``forward_hidden`` (engine.models.llama):
    prefill-only forwards with the causal mask, pooled over the final-normed hidden states."""

    BLOCK_SIZE = 16

    def __init__(self, model):
        self.model = model
        self.size = model.config.hidden_size
        self._cache = None
        self._num_blocks = 0

    def _scratch(self, num_blocks: int):
        if num_blocks > self._num_blocks:
            self._cache = self.model.make_kv_cache(num_blocks, self.BLOCK_SIZE)
            self._num_blocks = num_blocks
        return self._cache

    def embed(self, ids: list[list[int]], type_ids, pooling: str) -> torch.Tensor:
        bs = self.BLOCK_SIZE
        lens = [len(seq) for seq in ids]
        starts, block_starts = [0], [0]
        for n in lens:
            starts.append(starts[-1] + n)
            block_starts.append(block_starts[-1] + -(-n // bs))
        max_blocks = max(b - a for a, b in zip(block_starts, block_starts[1:]))
        tables = torch.full((len(ids), max_blocks), -1, dtype=torch.int64)
        for b, (a, z) in enumerate(zip(block_starts, block_starts[1:])):
            tables[b, : z - a] = torch.arange(a, z)
        positions = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])  # [T]
        seq_base = torch.repeat_interleave(
            torch.tensor(block_starts[:-1], dtype=torch.int64) * bs, torch.tensor(lens)
        )
        rows = pooled_rows(pooling, starts)
        logit_rows = torch.arange(starts[-1]) if rows is None else torch.tensor(rows, dtype=torch.int64)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        batch = ForwardBatch(
            input_ids=torch.tensor([t for seq in ids for t in seq], dtype=torch.int64),
            positions=positions,
            slot_mapping=seq_base + positions,
            query_starts=torch.tensor(starts, dtype=torch.int64),
            context_lens=lens_t,
            block_tables=tables,
            logit_rows=logit_rows,
            prompt_lens=lens_t,
            query_starts_list=starts,
            context_lens_list=lens,
            num_decode_seqs=0,
            block_size=bs,
        )
        hidden = self.model.forward_hidden(batch, self._scratch(block_starts[-1]))  # [S, E]
        return pool(hidden, starts, pooling)

    def score(self, ids, type_ids) -> torch.Tensor:
        raise TypeError("a decoder has no classification head: scores come from embeddings")


class EmbedJob:
    """One embed or score call. ``step(is_busy)`` runs the next chunk and returns True when done."""

    def __init__(
        self,
        runner,
        inputs: EncodedInputs,
        pooling: str | None,
        busy_tokens: int,
        idle_tokens: int | None = None,
    ):
        self.runner = runner
        self.inputs = inputs
        self.pooling = pooling  # None: score with the classification head
        self.busy_tokens = busy_tokens
        self.idle_tokens = max(IDLE_TOKENS if idle_tokens is None else idle_tokens, busy_tokens)
        self.order = sorted(range(len(inputs.ids)), key=lambda i: len(inputs.ids[i]))
        self.next = 0
        self.out: np.ndarray | None = None
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.future.set_running_or_notify_cancel()
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True  # the engine thread drops the job at its next step

    def step(self, is_busy: bool) -> bool:
        if self.cancelled:
            self.fail(concurrent.futures.CancelledError())
            return True
        budget = self.busy_tokens if is_busy else self.idle_tokens
        ids = self.inputs.ids
        chunk, num_tokens = [], 0
        while self.next < len(self.order):
            i = self.order[self.next]
            if chunk and num_tokens + len(ids[i]) > budget:
                break
            chunk.append(i)
            num_tokens += len(ids[i])
            self.next += 1
        types = self.inputs.type_ids
        chunk_ids = [ids[i] for i in chunk]
        chunk_types = None if types is None else [types[i] for i in chunk]
        if self.pooling is None:
            values = self.runner.score(chunk_ids, chunk_types)  # [b, num_labels]
        else:
            values = self.runner.embed(chunk_ids, chunk_types, self.pooling)  # [b, E]
        values = values.numpy()
        if self.out is None:
            self.out = np.empty((len(ids), values.shape[1]), dtype=np.float32)
        self.out[chunk] = values
        if self.next < len(self.order):
            return False
        self.future.set_result(self.out)
        return True

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)
