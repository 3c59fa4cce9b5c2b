"""Continuous batching over a paged KV cache.

Each tick (``schedule``) takes every running decode first (one token each), then fills
the rest of ``max_num_batched_tokens`` with prefill chunks: partially prefilled sequences
first (each at most half the prefill budget while a request waits for a slot), then
waiting ones admitted FIFO while ``num_running < max_num_seqs`` and the blocks for all
their tokens are free; budget still left goes back to the chunks that were cut. A long
prompt is so spread over many ticks. With ``target_tick_seconds`` the prefill tokens of a
tick follow a running estimate of their cost so that a tick takes about that long. When
a decode needs a block and none is free (after evicting unreferenced prefix-cache blocks,
least recently used first), the newest running sequence is preempted: its blocks are
freed and it waits at the head of the queue to recompute prompt + generated tokens.

With a sliding window (``sliding_window``, the model's sliding layers), a running sequence gives
up its window reference on each block its next query can no longer see (``window_slack`` tokens
of margin for speculative rows that may be rolled back); ``on_window_dropped`` receives the blocks
whose sliding K/V nobody needs any more, so a long context holds the window, not the whole
context, in those layers (engine.core.block_manager).

The per-sequence loops run in Cython (``cext.tick``); this file holds the Python-level
decisions that happen once per admission, preemption or new block. The decode-only steady
state (nothing waits, every running sequence decodes one token, no speculation) takes
``_schedule_decodes``: three Cython calls a tick and, while the running set is the same, the
same SchedulerOutput and ForwardBatch objects over the same arrays; it plans exactly what the
general path would (tests/test_scheduler.py holds both to tests/sched_reference.py).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch

from cext.tick import TickState
from engine.batch import ForwardBatch, window_blocks
from engine.core.block_manager import BlockManager, prefix_block_hashes
from engine.core.sequence import Sequence, SequenceStatus
from engine.core.tick_cost import DEFAULT_TARGET_TICK_SECONDS, TickCostModel
from engine.errors import SchedulerRefused


@dataclass(kw_only=True)
class SchedulerConfig:
    """The scheduler's view of a resolved EngineConfig (engine/config.py validates the options)."""
    max_num_seqs: int
    max_num_batched_tokens: int
    num_blocks: int
    max_model_len: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Adapt the prefill tokens of a tick so that a tick (forward + sampling) takes about this
    # long, within max_num_batched_tokens; None: always fill max_num_batched_tokens. It bounds the
    # decode streams' inter-token gap and the wait of a new request while a long prompt prefills.
    target_tick_seconds: float | None = DEFAULT_TARGET_TICK_SECONDS
    # The model's sliding-window length (None: no sliding layers): blocks a sequence's next query
    # is past in those layers are released (see the module docstring); window_slack tokens of
    # margin (speculative rows may be rolled back that far).
    sliding_window: int | None = None
    window_slack: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    batch: ForwardBatch
    seqs: list[Sequence]  # batch order: decodes first (batch.num_decode_seqs), then prefill chunks
    sample_seqs: list[Sequence]  # sequences that get a new token this tick
    sample_logit_index: list[int]  # row of forward()'s logits for each of sample_seqs
    prompt_logprob_spans: list[tuple[Sequence, int, int, int]]  # (seq, first logit, count, first position)
    preempted: list[Sequence]
    num_new_tokens: np.ndarray = field(repr=False)  # [B] int32, query tokens per seq
    slots: np.ndarray = field(repr=False)  # [B] int32
    epochs: np.ndarray = field(repr=False)  # [B] int64
    sample_entries: np.ndarray = field(repr=False)  # [S] int32, index into seqs of each sample_seqs
    # Speculative rows (engine.core.speculative): (SpecEntry, index into sample_seqs, first logit row).
    spec_entries: list = field(default_factory=list, repr=False)
    # A decode-only steady-state tick (Scheduler._schedule_decodes): reused while the running set
    # stays; its TickState.finish_codes hold each entry's verdict after update().
    is_decode_only: bool = False


def kept_windows_bound(config: SchedulerConfig) -> int | None:
    """Finished windows whose sliding K/V the block manager keeps for prefix matches: the last
    window of each of max_num_seqs sequences (None: no sliding layers)."""
    if config.sliding_window is None:
        return None
    return config.max_num_seqs * window_blocks(config.sliding_window, config.block_size)


class Scheduler:
    def __init__(self, config: SchedulerConfig, clock=time.perf_counter) -> None:
        self.config = config
        self.cost = TickCostModel(config.target_tick_seconds, config.max_num_batched_tokens, clock)
        self.block_size = config.block_size
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                          config.sliding_window, kept_windows_bound(config))
        # Per slot: leading blocks whose window reference the running sequence gave up.
        self._window_released = np.zeros(config.max_num_seqs, dtype=np.int64)
        self.on_window_dropped = None  # callable(list of block ids) (the KV cache's), or None
        self.state = TickState(config.max_num_seqs, config.max_model_len, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order, oldest first
        self._running_slots = np.zeros(config.max_num_seqs, dtype=np.int32)  # slots of self.running
        self._free_slots = list(range(config.max_num_seqs - 1, -1, -1))
        self._slot_seqs: list[Sequence | None] = [None] * config.max_num_seqs
        self._seqs: dict[str, Sequence] = {}
        self._unpublished: list[Sequence] = []  # running seqs with prompt blocks not yet in the prefix cache
        self.num_preemptions = 0
        self.num_ending = 0  # entries of the last decode-only update whose verdict ends them
        self.num_prefix_cache_hit_tokens = 0  # prompt tokens taken from the prefix cache at admission
        self.num_prefix_cache_query_tokens = 0  # tokens looked up in the prefix cache at admission
        self.num_prefix_cache_disk_hit_tokens = 0  # of the hits, tokens read from the disk tier
        self.disk = None  # engine.core.prefix_disk.PrefixDiskCache when prefix_cache_dir is set
        self.spec = None  # engine.core.speculative.SpecDecoder when speculative decoding is on
        self.num_decode_ticks = 0  # ticks the steady-state path planned
        self._num_running_changes = 0  # bumped whenever self.running changes (admit, release)
        self._decode_out: SchedulerOutput | None = None
        self._decode_key: tuple = ()

    # -- queries --

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    def kv_usage(self) -> float:
        return self.block_manager.num_used_blocks / self.block_manager.num_blocks

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # -- requests --

    def add(self, seq: Sequence) -> None:
        """Queue a waiting sequence. Its ids and its length against the model's context were checked
        where the request entered (engine/core/request.py); the scheduler refuses (SchedulerRefused)
        only what its own buffers cannot hold: a sequence longer than a TickState row or than the
        KV cache, or an id it already schedules."""
        cfg = self.config
        total = seq.num_prompt_tokens + seq.max_tokens
        num_blocks = -(-total // self.block_size)
        if total > cfg.max_model_len or num_blocks > cfg.num_blocks:
            raise SchedulerRefused(
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.max_tokens}) = {total} tokens "
                f"in {num_blocks} KV blocks: more than the scheduler holds (max_model_len="
                f"{cfg.max_model_len} tokens, {cfg.num_blocks} KV blocks: kv_cache_tokens="
                f"{cfg.num_blocks * self.block_size})", "max_tokens")
        if seq.request_id in self._seqs:
            raise SchedulerRefused(f"request_id {seq.request_id!r} is already scheduled", "request_id")
        if seq.status is not SequenceStatus.WAITING:
            raise SchedulerRefused(f"sequence {seq.request_id!r} is {seq.status.name}, not WAITING")
        self._seqs[seq.request_id] = seq
        self.waiting.append(seq)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        if seq.status is SequenceStatus.RUNNING:
            self._release(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self._drop_disk_blocks(seq)
        del self._seqs[request_id]
        return seq

    def finish(self, seq: Sequence) -> None:
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self._release(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self._drop_disk_blocks(seq)
        self._seqs.pop(seq.request_id, None)

    # -- the tick --

    def schedule(self, num_reserved_tokens: int = 0) -> SchedulerOutput | None:
        """The next tick; ``num_reserved_tokens`` of max_num_batched_tokens are kept for rows the
        caller adds to the batch (a decoder's embedding rows, engine/embedding/tick_rows.py)."""
        if not self.running and not self.waiting:
            return None
        state = self.state
        bm = self.block_manager
        cfg = self.config
        hard = cfg.max_num_batched_tokens - num_reserved_tokens
        prefill_budget = None
        spec = self.spec
        if spec is not None:
            spec.entries = []
            if not self.waiting:
                prefill_budget = min(self.prefill_budget(), hard)
                spec.propose(state, self.running, bm, hard, prefill_budget, cfg.max_model_len)
        if not self.waiting and num_reserved_tokens == 0 and (spec is None or not spec.entries):
            # the steady state (with speculation on: a tick nobody proposes in) in one Cython plan
            out = self._schedule_decodes()
            if out is not None:
                self.cost.start()
                return out
        if prefill_budget is None:
            prefill_budget = min(self.prefill_budget(), hard)
        preempted: list[Sequence] = []
        while True:
            max_chunk = prefill_budget
            if self.waiting and len(self.running) < cfg.max_num_seqs:
                # Leave room for a waiting request: a short one then starts within a tick.
                max_chunk = max(1, min(prefill_budget, hard - len(self.running)) // 2)
            plan = state.plan(self._running_slots, len(self.running), hard, prefill_budget, max_chunk)
            if plan.num_decodes == 0 and prefill_budget < hard:
                prefill_budget = hard  # no stream to keep pace for: fill the tick
                continue
            if plan.num_new_blocks <= bm.num_free_blocks:
                break
            if spec is not None and spec.entries:  # (proposals are cut to the free blocks: defensive)
                spec.withdraw(state)
                continue
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
        if plan.num_new_blocks:  # about one decode in block_size needs a block each tick
            state.grow(np.array(bm.allocate(plan.num_new_blocks), dtype=np.int32))
        num_decodes, left = plan.num_decodes, plan.prefill_tokens_left
        num_planned = state.num_entries
        if not preempted:
            left = self._admit(left, hard)
        if left > 0 and num_planned > num_decodes:
            state.top_up(num_decodes, num_planned, left)
        if state.num_entries == 0:
            return None
        out = self._build_output(num_decodes, preempted)
        self.cost.start()
        return out

    def prefill_budget(self) -> int:
        """Prefill tokens for the next tick (engine.core.tick_cost)."""
        return self.cost.prefill_budget()

    def update(self, out: SchedulerOutput, sampled_token_ids) -> None:
        if out.is_decode_only:
            self.cost.observe(0)
            self.num_ending = self.state.decode_commit(np.asarray(sampled_token_ids, dtype=np.int64))
            if self._unpublished:
                self._publish_blocks()
            if self.config.sliding_window is not None and self.running:
                self._release_windows()
            return
        self.cost.observe(out.batch.num_tokens - out.batch.num_decode_seqs)
        if isinstance(sampled_token_ids, torch.Tensor):
            ids = sampled_token_ids.numpy().astype(np.int64, copy=False).reshape(-1)
        else:
            ids = np.asarray(sampled_token_ids, dtype=np.int64).reshape(-1)
        self.state.commit(out.slots, out.num_new_tokens, out.epochs, out.sample_entries, ids)
        running = SequenceStatus.RUNNING
        for seq, _first, count, pos in out.prompt_logprob_spans:
            if seq.status is running:
                nxt = pos + count
                seq.next_prompt_logprob_pos = nxt if nxt < seq.num_prompt_tokens - 1 else -1
                self.state.next_logprob_pos[seq.slot] = seq.next_prompt_logprob_pos
        if self._unpublished:
            self._publish_blocks()
        if self.config.sliding_window is not None and self.running:
            self._release_windows()

    # -- internals --

    def _layout_batch(self, layout, logit_rows, query_starts_list: list[int], num_decodes: int) -> ForwardBatch:
        """The tick's ForwardBatch over numpy views of the Cython layout (tensors only for what the model reads)."""
        return ForwardBatch(
            input_ids=layout.input_ids,
            positions=layout.positions,
            slot_mapping=layout.slot_mapping,
            query_starts=layout.query_starts,
            context_lens=layout.context_lens,
            block_tables=layout.block_tables,
            logit_rows=logit_rows,
            prompt_lens=layout.prompt_lens,
            query_starts_list=query_starts_list,
            context_lens_list=layout.context_lens.tolist(),
            num_decode_seqs=num_decodes,
            block_size=self.block_size,
        )

    def _schedule_decodes(self) -> SchedulerOutput | None:
        """The steady state: every running sequence decodes one token (cext.tick decode_plan /
        decode_build), or None (nothing planned) when the state is not steady or its decodes need
        more blocks than are free (the general path then preempts)."""
        state = self.state
        num_new_blocks = state.decode_plan(self._running_slots, len(self.running))
        if num_new_blocks < 0:
            return None
        if num_new_blocks:  # about one decode in block_size needs a block each tick
            bm = self.block_manager
            if num_new_blocks > bm.num_free_blocks:
                return None
            state.grow(np.array(bm.allocate(num_new_blocks), dtype=np.int32))
        layout = state.decode_build()
        self.num_decode_ticks += 1
        key = (layout, self._num_running_changes)
        out = self._decode_out
        if key == self._decode_key:  # same sequences, same arrays: only the context lengths moved
            out.batch.context_lens_list = layout.context_lens.tolist()
            return out
        B = layout.num_seqs
        seqs = list(self.running)
        slots = state.entry_slots[:B].copy()
        batch = self._layout_batch(layout, layout.logit_rows, list(range(B + 1)), B)
        out = SchedulerOutput(
            batch=batch,
            seqs=seqs,
            sample_seqs=seqs,
            sample_logit_index=list(range(B)),
            prompt_logprob_spans=[],
            preempted=[],
            num_new_tokens=np.ones(B, dtype=np.int32),
            slots=slots,
            epochs=state.epochs[slots],
            sample_entries=np.arange(B, dtype=np.int32),
            is_decode_only=True,
        )
        self._decode_out, self._decode_key = out, key
        return out

    def _admit(self, budget: int, max_batch_tokens: int) -> int:
        """Admit waiting sequences FIFO; ``budget`` is the prefill budget left (time target).

        A prompt whose remaining tokens fit the tick's hard budget (max_num_batched_tokens)
        is admitted whole even past the time target: it is done in this tick. A longer one
        gets a chunk of the prefill budget. Returns the prefill budget left.
        """
        cfg = self.config
        bm = self.block_manager
        state = self.state
        hard_left = max_batch_tokens - state.num_batch_tokens
        while self.waiting and hard_left > 0 and len(self.running) < cfg.max_num_seqs:
            seq = self.waiting[0]
            num_tokens = seq.num_tokens
            hit_ids: list[int] = []
            disk_payloads = []
            if cfg.enable_prefix_caching:
                if seq.block_hashes is None:
                    seq.block_hashes = prefix_block_hashes(
                        seq.token_array, seq.num_prompt_tokens // self.block_size, self.block_size
                    )
                if seq.next_prompt_logprob_pos < 0:  # prompt logprobs need every prompt row computed
                    max_hits = min(len(seq.block_hashes), (num_tokens - 1) // self.block_size)
                    hit_ids = bm.match_prefix(seq.block_hashes[:max_hits])
                    disk_payloads = self._disk_run(seq, len(hit_ids), max_hits)
            num_new_blocks = -(-num_tokens // self.block_size) - len(hit_ids)
            remaining = num_tokens - (len(hit_ids) + len(disk_payloads)) * self.block_size
            if remaining <= hard_left:
                chunk = remaining
            elif budget > 0:
                chunk = min(remaining, budget, hard_left)
            else:
                break
            if num_new_blocks + bm.num_unreferenced(hit_ids) > bm.num_free_blocks:
                break
            self.waiting.popleft()
            bm.take(hit_ids)
            block_ids = hit_ids + bm.allocate(num_new_blocks)
            if disk_payloads:  # blocks read from disk instead of prefilled: into the cache, published
                new_ids = block_ids[len(hit_ids) : len(hit_ids) + len(disk_payloads)]
                for k, (block_id, payload) in enumerate(zip(new_ids, disk_payloads), start=len(hit_ids)):
                    self.disk.restore(block_id, payload)
                    bm.register(block_id, seq.block_hashes[k])
                hit_ids = block_ids[: len(hit_ids) + len(disk_payloads)]
                self.num_prefix_cache_disk_hit_tokens += len(disk_payloads) * self.block_size
            self._drop_disk_blocks(seq)
            slot = self._free_slots.pop()
            num_cached = len(hit_ids) * self.block_size
            seq.bind(state, slot, num_cached)
            state.epochs[slot] += 1
            state.block_tables[slot, : len(block_ids)] = block_ids
            state.num_blocks[slot] = len(block_ids)
            self._window_released[slot] = 0
            seq.num_cached_tokens = num_cached
            self.num_prefix_cache_hit_tokens += num_cached
            self.num_prefix_cache_query_tokens += num_tokens if cfg.enable_prefix_caching else 0
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.perf_counter()
            seq.status = SequenceStatus.RUNNING
            self._running_slots[len(self.running)] = slot
            self.running.append(seq)
            self._num_running_changes += 1
            self._slot_seqs[slot] = seq
            if cfg.enable_prefix_caching and len(seq.block_hashes) > len(hit_ids):
                seq.num_registered_blocks = len(hit_ids)
                self._unpublished.append(seq)
            state.add_entry(slot, chunk)
            hard_left -= chunk
            budget = max(0, budget - chunk)
        return budget

    def _build_output(self, num_decodes: int, preempted: list[Sequence]) -> SchedulerOutput:
        state = self.state
        layout = state.build()
        B, num_samples, num_spans = layout.num_seqs, layout.num_samples, layout.num_spans
        slots = state.entry_slots[:B].copy()
        if B == num_decodes == len(self.running):  # decode-only steady state: the running order
            seqs = list(self.running)
        else:
            slot_seqs = self._slot_seqs
            seqs = [slot_seqs[s] for s in slots.tolist()]
        sample_entries = state.sample_entries[:num_samples].copy()
        if num_samples == B:
            sample_seqs = seqs
        else:
            sample_seqs = [seqs[i] for i in sample_entries.tolist()]
        spans = []
        if num_spans:
            for i, first, count, pos in zip(
                state.span_entries[:num_spans].tolist(),
                state.span_firsts[:num_spans].tolist(),
                state.span_counts[:num_spans].tolist(),
                state.span_positions[:num_spans].tolist(),
            ):
                spans.append((seqs[i], first, count, pos))
        logit_rows = layout.logit_rows
        sample_logit_index = state.sample_logit_idx[:num_samples].tolist()
        spec_entries = []
        if self.spec is not None and self.spec.entries:
            logit_rows, sample_logit_index, spec_entries = self.spec.logit_rows(layout, sample_entries, slots)
        batch = self._layout_batch(layout, logit_rows, layout.query_starts.tolist(), num_decodes)
        if spec_entries:  # speculation runs only when every sequence decodes: all rows verify
            batch.gen_rows, batch.gen_seqs = batch.num_tokens, B
        return SchedulerOutput(
            batch=batch,
            seqs=seqs,
            sample_seqs=sample_seqs,
            sample_logit_index=sample_logit_index,
            prompt_logprob_spans=spans,
            preempted=preempted,
            num_new_tokens=state.entry_num_new[:B].copy(),
            slots=slots,
            epochs=state.epochs[slots],
            sample_entries=sample_entries,
            spec_entries=spec_entries,
        )

    def _publish_blocks(self) -> None:
        """Put prompt blocks whose K/V are now computed into the prefix cache."""
        bm = self.block_manager
        state = self.state
        keep = []
        for seq in self._unpublished:
            if seq.status is not SequenceStatus.RUNNING:
                continue
            slot = seq.slot
            num_done = min(int(state.num_computed[slot]), seq.num_prompt_tokens) // self.block_size
            for k in range(seq.num_registered_blocks, num_done):
                block_id = int(state.block_tables[slot, k])
                if bm.register(block_id, seq.block_hashes[k]) and self.disk is not None:
                    self.disk.save(seq.block_hashes[k], k, block_id)
            seq.num_registered_blocks = max(seq.num_registered_blocks, num_done)
            if seq.num_registered_blocks < len(seq.block_hashes):
                keep.append(seq)
        self._unpublished = keep

    def _disk_run(self, seq: Sequence, num_hits: int, max_hits: int) -> list:
        """Payloads of the prompt blocks after the ``num_hits`` found in memory that were read from
        disk ahead of admission (PrefixDiskCache.read), at most up to block ``max_hits``."""
        disk = seq.disk_blocks
        if disk is None or num_hits < disk.first:  # the memory blocks before the disk run were evicted
            return []
        return disk.payloads[num_hits - disk.first : max_hits - disk.first]

    @staticmethod
    def _drop_disk_blocks(seq: Sequence) -> None:
        if seq.disk_blocks is not None:
            seq.disk_blocks.release()
            seq.disk_blocks = None

    def _release_windows(self) -> None:
        """Give up window references on the blocks each running sequence's next query is past
        (numpy over the running slots; a Python step only per block released, one in block_size
        tokens per sequence), then hand the dropped blocks to the cache."""
        cfg, state, bm = self.config, self.state, self.block_manager
        slots = self._running_slots[: len(self.running)]
        # The next query at position p reads keys p - window + 1 .. p: blocks wholly below are unneeded.
        first_needed = state.num_computed[slots].astype(np.int64) - cfg.sliding_window - cfg.window_slack + 1
        targets = np.minimum(np.maximum(first_needed, 0) // self.block_size, state.num_blocks[slots])
        released = self._window_released[slots]
        for k in np.flatnonzero(targets > released).tolist():
            slot = int(slots[k])
            for j in range(int(released[k]), int(targets[k])):
                bm.release_window(int(state.block_tables[slot, j]))
            self._window_released[slot] = targets[k]
        dropped = bm.drain_dropped()
        if dropped and self.on_window_dropped is not None:
            self.on_window_dropped(dropped)

    def _release(self, seq: Sequence) -> None:
        """Free a running sequence's blocks and slot and copy its tokens out."""
        state = self.state
        slot = seq.slot
        nb = int(state.num_blocks[slot])
        self.block_manager.free(state.block_tables[slot, :nb].tolist(), int(self._window_released[slot]))
        self._window_released[slot] = 0
        if self.config.sliding_window is not None and self.on_window_dropped is not None:
            dropped = self.block_manager.drain_dropped()  # its unhashed blocks, kept windows past the bound
            if dropped:
                self.on_window_dropped(dropped)
        state.block_tables[slot, :nb] = -1
        state.num_blocks[slot] = 0
        state.epochs[slot] += 1
        seq.unbind()
        self.running.remove(seq)
        self._num_running_changes += 1
        n = len(self.running)
        self._running_slots[:n] = [s.slot for s in self.running]
        self._slot_seqs[slot] = None
        self._free_slots.append(slot)

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
