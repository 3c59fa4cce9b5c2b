"""A decoder's embedding rows inside the generation tick's own forward.

An embedding request is a prefill-only request: its texts' rows join the tick's batch after the
generation rows (packed back to back, no padding: the attention takes per-sequence spans), write
their K/V into blocks taken from the engine's block manager for as long as the text is in flight,
and are pooled from the final-normed hidden states; nothing is sampled and the blocks are freed
as soon as a text is pooled. A text longer than a tick's share is prefilled in chunks over several
ticks (its pooling accumulates: a sum for mean, a running max, the first row for cls, the last
for last), like a long prompt.

The share of the tick's token budget (``TickRows.budget``):
- no generation work: the whole budget (``max_num_batched_tokens``);
- generation prefill but no running stream: half of it;
- running streams: a share of their time, not of every tick's rows. Any prefill rows move a
  decode tick's products onto the prefill routes (engine/models/routes.py), so even a few rows
  cost about a prefill forward; a tick with embedding rows therefore takes a full prefill chunk
  (the scheduler's time-target budget, engine/core/tick_cost.py) and such ticks are spaced out
  by a time credit: every tick earns EMBED_TIME_SHARE of the measured time of a tick without
  embedding rows, and a tick with them (and the one after it, whose caches it left cold) spends
  what it took beyond that. A stream keeps about
  1 / (1 + EMBED_TIME_SHARE) of its solo rate on average, whatever the rows cost.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..batch import ForwardBatch
from ..errors import EngineDead
from .runner import EmbedJob

EMBED_TIME_SHARE = 0.3  # a stream beside embeddings keeps ~1 / 1.3 = 0.77 of its solo tok/s
MIN_EMBED_TOKENS = 16  # embedding rows of a tick that has them, at least
TIMING_SMOOTHING = 0.3  # weight of the newest tick in the estimate of a tick without embedding rows


@dataclass(slots=True)
class _Text:
    """One input of a job in flight: its rows prefilled so far, its KV blocks, its pooled state."""

    job: EmbedJob
    index: int
    ids: list[int]
    num_done: int = 0
    block_ids: list[int] = field(default_factory=list)
    pooled: torch.Tensor | None = None  # [E] float32: sum (mean), max, first row (cls), last row (last)


@dataclass(slots=True)
class TickPart:
    """The embedding rows of one tick: (text, first row in the merged batch, row count) per chunk."""

    chunks: list[tuple[_Text, int, int]]
    hidden_rows: torch.Tensor  # [R] int64 rows of the merged batch whose hidden states pooling reads
    pooling: str
    num_tokens: int


class TickRows:
    """The decoder's embedding queue on the engine thread (EngineCore.set_tick_rows)."""

    def __init__(self, core, block_size: int, clock=time.perf_counter):
        self.core = core
        self.block_size = block_size
        self.clock = clock
        self.credit = 0.0  # seconds of stream time the embedding rows may still take
        self.plain_tick_seconds: float | None = None  # a streaming tick without embedding rows
        self._last_kind: str | None = None  # the last tick: "plain" | "mixed" | None (no stream ran)
        self._last_start = 0.0
        self._lock = threading.Lock()
        self._jobs: collections.deque[EmbedJob] = collections.deque()  # FIFO, oldest first
        self._texts: list[_Text] = []  # partially prefilled texts, continued first
        self.num_tokens = 0  # embedding rows computed (stats)
        self.num_mixed_ticks = 0  # ticks whose forward held generation and embedding rows

    # ----- caller side -----
    def submit(self, job: EmbedJob) -> None:
        if job.pooling is None:
            raise TypeError("a decoder has no classification head: scores come from embeddings")
        with self._lock:
            if not self.core.is_alive():
                raise EngineDead(self.core.dead_message)
            self._jobs.append(job)
        self.core.wake()

    # ----- engine thread -----
    def has_work(self) -> bool:
        return bool(self._jobs or self._texts)

    def budget(self, scheduler) -> int:
        """Tokens this tick's embedding rows may take (the module docstring's split)."""
        now = self.clock()
        elapsed, last = now - self._last_start, self._last_kind
        self._last_start, self._last_kind = now, None
        hard = scheduler.config.max_num_batched_tokens
        if not scheduler.has_work():
            return hard
        num_running = scheduler.num_running
        if num_running == 0:
            return hard // 2
        plain = self.plain_tick_seconds
        if last == "plain":
            plain = elapsed if plain is None else plain + TIMING_SMOOTHING * (elapsed - plain)
            self.plain_tick_seconds = plain
        elif last in ("mixed", "after") and plain is not None:
            self.credit -= max(0.0, elapsed - plain)
        # (take() makes it "mixed" when it adds rows.) The tick after a mixed one pays for what the
        # mixed one left behind (its caches are cold): charged like it, not learned from.
        self._last_kind = "after" if last == "mixed" else "plain"
        if plain is None:  # time a tick without embedding rows first
            return 0
        self.credit = min(self.credit + EMBED_TIME_SHARE * plain, EMBED_TIME_SHARE * plain)
        if self.credit <= 0.0:
            return 0
        return max(0, min(hard - num_running, max(MIN_EMBED_TOKENS, scheduler.prefill_budget())))

    def take(self, num_tokens: int, block_manager) -> TickPart | None:
        """The chunks of this tick, at most ``num_tokens`` rows, their KV blocks allocated."""
        self._drop_cancelled()
        if num_tokens <= 0:
            return None
        bs = self.block_size
        chunks, left = [], num_tokens
        texts = list(self._texts)
        pooling = texts[0].job.pooling if texts else None
        jobs = iter(list(self._jobs))
        job, order = None, iter(())
        while left > 0:
            text = texts.pop(0) if texts else None
            if text is None:
                i = next(order, None)
                while i is None:
                    job = next(jobs, None)
                    if job is None:
                        break
                    if pooling is not None and job.pooling != pooling:  # one pooling per tick
                        continue
                    pooling = job.pooling
                    order = self._fresh(job)
                    i = next(order, None)
                if i is None:
                    break
                text = _Text(job, i, job.inputs.ids[i])
                self._texts.append(text)
            count = min(len(text.ids) - text.num_done, left)
            num_new = -(-(text.num_done + count) // bs) - len(text.block_ids)
            if num_new > block_manager.num_free_blocks:  # the KV cache is full: wait for generation
                count = min(count, (len(text.block_ids) + block_manager.num_free_blocks) * bs - text.num_done)
                num_new = -(-(text.num_done + count) // bs) - len(text.block_ids) if count > 0 else 0
                if count <= 0:
                    if text.num_done == 0 and not text.block_ids:
                        self._texts.remove(text)
                        text.job.next -= 1  # put it back: taken again next tick
                    break
            if num_new:
                text.block_ids.extend(block_manager.allocate(num_new))
            chunks.append((text, text.num_done, count))
            left -= count
        if not chunks:
            return None
        if self._last_kind is not None:
            self._last_kind = "mixed"
        return TickPart(chunks, torch.empty(0, dtype=torch.int64), pooling, num_tokens - left)

    def _fresh(self, job: EmbedJob):
        """The job's next inputs, shortest first (EmbedJob.order), one at a time."""
        while job.next < len(job.order):
            job.next += 1
            yield job.order[job.next - 1]

    def merge(self, batch: ForwardBatch | None, part: TickPart) -> ForwardBatch:
        """The generation batch (or none) with the part's chunks appended as prefill sequences;
        sets ``part.hidden_rows`` (in chunk order: what ``put`` reads)."""
        bs = self.block_size
        base = 0 if batch is None else batch.num_tokens
        ids, positions, slots, starts, ctx, tables, rows = [], [], [], [], [], [], []
        row = base
        for text, first, count in part.chunks:
            pos = np.arange(first, first + count, dtype=np.int64)
            table = np.asarray(text.block_ids, dtype=np.int64)
            ids.append(np.asarray(text.ids[first : first + count], dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            ctx.append(first + count)
            tables.append(table)
            pooling = part.pooling
            if pooling in ("mean", "max"):
                rows.append(np.arange(row, row + count, dtype=np.int64))
            elif pooling == "cls" and first == 0:
                rows.append(np.array([row], dtype=np.int64))
            elif pooling == "last" and first + count == len(text.ids):
                rows.append(np.array([row + count - 1], dtype=np.int64))
            starts.append(row + count)
            row += count
        part.hidden_rows = torch.from_numpy(np.concatenate(rows)) if rows else torch.empty(0, dtype=torch.int64)
        width = max(len(t) for t in tables)
        if batch is not None:
            width = max(width, batch.array("block_tables").shape[1])
        grid = np.full((len(tables), width), -1, dtype=np.int64)
        for b, table in enumerate(tables):
            grid[b, : len(table)] = table
        new = dict(
            input_ids=np.concatenate(ids), positions=np.concatenate(positions),
            slot_mapping=np.concatenate(slots), context_lens=np.asarray(ctx, dtype=np.int64),
            block_tables=grid, prompt_lens=np.asarray([len(t.ids) for t, _, _ in part.chunks], dtype=np.int64),
        )
        if batch is None:
            return ForwardBatch(
                query_starts=np.asarray([0, *starts], dtype=np.int64), logit_rows=np.empty(0, dtype=np.int64),
                query_starts_list=[0, *starts], context_lens_list=ctx, num_decode_seqs=0, block_size=bs,
                generation_end=0, **new,
            )
        old_tables = batch.array("block_tables")
        if old_tables.shape[1] < width:
            old_tables = np.pad(old_tables, ((0, 0), (0, width - old_tables.shape[1])), constant_values=-1)
        joined = {name: np.concatenate([batch.array(name).astype(np.int64, copy=False), value])
                  for name, value in new.items() if name != "block_tables"}
        return ForwardBatch(
            query_starts=np.concatenate([batch.array("query_starts"), np.asarray(starts, dtype=np.int64)]),
            block_tables=np.concatenate([old_tables, grid]), logit_rows=batch.array("logit_rows"),
            query_starts_list=batch.query_starts_list + starts,
            context_lens_list=batch.context_lens_list + ctx,
            num_decode_seqs=batch.num_decode_seqs, block_size=bs, gen_rows=batch.gen_rows,
            gen_seqs=batch.gen_seqs, generation_end=batch.num_tokens, **joined,
        )

    def put(self, part: TickPart, hidden: torch.Tensor, block_manager) -> None:
        """hidden [R, E]: the part's ``hidden_rows``; pool them, hand finished texts to their jobs."""
        hidden = hidden.float()
        pooling = part.pooling
        self.num_tokens += part.num_tokens
        k = 0
        done: dict[int, tuple[EmbedJob, list[int], list[torch.Tensor]]] = {}
        for text, first, count in part.chunks:
            is_last = first + count == len(text.ids)
            if pooling in ("mean", "max"):
                rows = hidden[k : k + count]
                k += count
                value = rows.sum(0) if pooling == "mean" else rows.amax(0)
                if text.pooled is None:
                    text.pooled = value
                elif pooling == "mean":
                    text.pooled += value
                else:
                    torch.maximum(text.pooled, value, out=text.pooled)
            elif (pooling == "cls" and first == 0) or (pooling == "last" and is_last):
                text.pooled = hidden[k].clone()
                k += 1
            text.num_done = first + count
            if is_last:
                vector = text.pooled / len(text.ids) if pooling == "mean" else text.pooled
                self._release(text, block_manager)
                entry = done.setdefault(id(text.job), (text.job, [], []))
                entry[1].append(text.index)
                entry[2].append(vector)
        for job, indices, vectors in done.values():
            if not job.cancelled:
                job.put(indices, torch.stack(vectors).numpy())
        with self._lock:
            self._jobs = collections.deque(j for j in self._jobs if not j.future.done())

    def fail_part(self, part: TickPart, exc: BaseException, block_manager) -> None:
        """The forward failed: the part's jobs fail (their texts in flight are dropped), others go on."""
        for job in {id(t.job): t.job for t, _, _ in part.chunks}.values():
            job.fail(exc)
        self._drop_finished(block_manager)

    def _release(self, text: _Text, block_manager) -> None:
        if text.block_ids:
            block_manager.free(text.block_ids)
            text.block_ids = []
        if text in self._texts:
            self._texts.remove(text)

    def _drop_cancelled(self) -> None:
        with self._lock:
            cancelled = [j for j in self._jobs if j.cancelled]
        for job in cancelled:
            job.fail(concurrent.futures.CancelledError())
        if cancelled:
            self._drop_finished(self.core.scheduler.block_manager)

    def _drop_finished(self, block_manager) -> None:
        """Forget jobs whose future is set (failed, cancelled) and free their texts' blocks."""
        for text in [t for t in self._texts if t.job.future.done()]:
            self._release(text, block_manager)
        with self._lock:
            self._jobs = collections.deque(j for j in self._jobs if not j.future.done())

    def fail(self, exc: BaseException) -> None:
        """The engine stops: every waiting job fails (the blocks go with the engine)."""
        with self._lock:
            jobs, self._jobs = list(self._jobs), collections.deque()
        self._texts = []
        for job in jobs:
            job.fail(exc)
