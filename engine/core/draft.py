"""Draft-model speculation: a second, smaller model proposes the next k ids of every speculating
sequence whose prompt lookup found nothing this tick (a lookup's proposal costs nothing, a draft
id a draft forward), k forwards per tick on the same kernels as the target.

The draft keeps its own KV cache in blocks of the target's size, from its own pool, with its
own block table per slot. Per slot it counts the ids whose draft K/V is cached
(``num_computed``) and remembers the ids it fed past the verified length last tick: at the
next proposal the cached rows are those whose ids the target then accepted (the K/V of a
position depends only on the ids up to it), so rollback needs no hook. A tick's first draft
forward catches each sequence up (the prompt on its first proposal, at most
``MAX_CATCH_UP`` ids a tick; the accepted ids after that), the next k - 1 forwards feed one
draft id each. The draft proposes greedily (its argmax): q is one-hot, so verification's
acceptance rule (engine/core/speculative.py) keeps every request's output exact.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..batch import ForwardBatch
from ..errors import InvalidParameterError

MAX_CATCH_UP = 512  # draft ids computed per sequence per tick before it proposes
STEP_SMOOTHING = 0.2  # weight of the newest one-id forward in step_seconds


def _refuse(what: str) -> None:
    raise InvalidParameterError(f"draft_model does not match the model: {what}", "draft_model")


def check_draft_tokenizer(target, draft) -> None:
    """The draft's tokenizer must be the target's: the same ids for the same bytes, the same
    special ids; else one line naming the first difference (InvalidParameterError)."""
    if target.vocab_size != draft.vocab_size:
        _refuse(f"its tokenizer has {draft.vocab_size} ids, the model's {target.vocab_size}")
    if target.bos_token_id != draft.bos_token_id:
        _refuse(f"its bos id is {draft.bos_token_id}, the model's {target.bos_token_id}")
    if sorted(target.eos_token_ids) != sorted(draft.eos_token_ids):
        _refuse(f"its eos ids are {sorted(draft.eos_token_ids)}, the model's {sorted(target.eos_token_ids)}")
    from ..tokenizer.token_bytes import TokenPieces

    a, b = TokenPieces(target), TokenPieces(draft)
    for i in range(target.vocab_size):
        if a.bytes_of(i) != b.bytes_of(i):
            _refuse(f"its id {i} is {bytes(b.bytes_of(i))!r}, the model's {bytes(a.bytes_of(i))!r}")


def check_draft_width(target_model, draft_model) -> None:
    """Both models' logits cover the same ids."""
    if target_model.vocab_size != draft_model.vocab_size:
        _refuse(f"its logits have {draft_model.vocab_size} ids, the model's {target_model.vocab_size}")
    if not getattr(draft_model, "can_generate", True):
        _refuse("it is an embedding model")


class DraftModel:
    """The draft model, its KV cache and per-slot paging."""

    def __init__(self, model, num_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int):
        self.model = model
        self.block_size = block_size
        self.max_blocks = -(-(max_model_len + block_size) // block_size)
        self.kv_cache = model.make_kv_cache(num_blocks, block_size)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # a stack
        self.tables: list[list[int]] = [[] for _ in range(max_num_seqs)]
        self.num_computed = [0] * max_num_seqs  # ids whose draft K/V is cached
        self.epochs = [-1] * max_num_seqs  # the slot's epoch the cache belongs to
        self.fed: list[tuple[int, list[int]]] = [(0, [])] * max_num_seqs  # (position, ids) fed past it
        self.num_forwards = 0
        self.seconds = 0.0  # in all its forwards (the engine's tick times leave them out: see _tick)
        self.step_seconds = 0.0  # a forward of one id per sequence (running average; 0: not timed)
        self.row_seconds = 0.0  # per id beyond one per sequence in a forward that catches up (average)

    def _release(self, s: int) -> None:
        self.free_blocks.extend(self.tables[s])
        self.tables[s] = []
        self.num_computed[s] = 0
        self.fed[s] = (0, [])

    def sync(self, state, live_slots: set[int]) -> None:
        """Free the cache of slots whose sequence left or was replaced (finished, preempted)."""
        epochs = state.epochs
        for s, table in enumerate(self.tables):
            if table and (s not in live_slots or self.epochs[s] != int(epochs[s])):
                self._release(s)

    def _cover(self, s: int, num_positions: int) -> bool:
        """Blocks for positions < num_positions; False when the pool is out of blocks."""
        table = self.tables[s]
        need = -(-num_positions // self.block_size) - len(table)
        if need > len(self.free_blocks):
            return False
        for _ in range(need):
            table.append(self.free_blocks.pop())
        return True

    def _verified(self, s: int, tokens: np.ndarray, n: int) -> int:
        """Cached draft rows still valid: those before the ids fed last tick, and the fed ids the
        sequence now holds."""
        pos, ids = self.fed[s]
        c = min(self.num_computed[s], pos)
        j = 0
        while j < len(ids) and pos + j < n and int(tokens[pos + j]) == ids[j]:
            j += 1
        return min(c + j if c == pos else c, n - 1)  # the last id is always fed: its logits propose

    def catch_up_seconds(self, state, s: int, n: int) -> float:
        """What slot ``s`` (length ``n``) must feed before its first draft id, beyond that id's own
        row: the ids its draft cache lacks (all of them for a sequence it has not seen; at most
        MAX_CATCH_UP) at the catch-up forwards' measured seconds per extra id (0 until timed)."""
        cached = self._verified(s, state.tokens[s], n) if self.epochs[s] == int(state.epochs[s]) else 0
        return (min(n - cached, MAX_CATCH_UP) - 1) * self.row_seconds

    def propose(self, state, wants: list[tuple[int, int, int, int]]) -> dict[int, list[int]]:
        """``wants``: (slot, length n, most ids k, prompt length) of each sequence to propose for
        -> {slot: draft ids}. Sequences still catching up (or out of draft blocks) get none."""
        rows = []  # (slot, first position, n, k, prompt length)
        for s, n, k, num_prompt in wants:
            if self.epochs[s] != int(state.epochs[s]):
                self._release(s)
                self.epochs[s] = int(state.epochs[s])
            c = self._verified(s, state.tokens[s], n)
            self.num_computed[s] = c
            stop = min(n, c + MAX_CATCH_UP)
            if not self._cover(s, stop + k):
                continue
            rows.append((s, c, stop, k if stop == n else 0, num_prompt))
        if not rows:
            return {}
        rows.sort(key=lambda r: r[2] - r[1] != 1)  # one-row sequences first (num_decode_seqs)
        ids = [[] for _ in rows]
        inputs = [state.tokens[s, c:stop].astype(np.int64) for s, c, stop, _k, _p in rows]
        starts = [c for _s, c, _stop, _k, _p in rows]
        active = list(range(len(rows)))
        for _step in range(max((r[3] for r in rows), default=0) or 1):
            logits = self._forward([rows[i] for i in active], [inputs[i] for i in active],
                                   [starts[i] for i in active])
            picked = torch.argmax(logits, dim=-1).tolist()  # [B]
            still = []
            for i, token in zip(active, picked):
                s, _c, stop, k, _p = rows[i]
                self.num_computed[s] = starts[i] + len(inputs[i])
                if len(ids[i]) < k:
                    ids[i].append(token)
                if len(ids[i]) < k:
                    starts[i] += len(inputs[i])
                    inputs[i] = np.array([token], dtype=np.int64)
                    still.append(i)
            active = still
            if not active:
                break
        out = {}
        for (s, _c, stop, _k, _p), draft in zip(rows, ids):
            self.fed[s] = (stop, draft[:-1] if draft else [])
            if draft:
                out[s] = draft
        return out

    def _forward(self, rows, inputs: list[np.ndarray], starts: list[int]) -> torch.Tensor:
        """One draft forward over each row's ids from its start position -> logits [B, V]."""
        bs = self.block_size
        lens = [len(x) for x in inputs]
        query_starts = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lens, out=query_starts[1:])
        positions = np.concatenate([np.arange(p, p + m, dtype=np.int64) for p, m in zip(starts, lens)])
        tables = np.full((len(rows), self.max_blocks), -1, dtype=np.int64)
        slot_mapping = np.empty_like(positions)
        for b, row in enumerate(rows):
            table = self.tables[row[0]]
            tables[b, : len(table)] = table
            pos = positions[query_starts[b] : query_starts[b + 1]]
            slot_mapping[query_starts[b] : query_starts[b + 1]] = tables[b, pos // bs] * bs + pos % bs
        context_lens = np.asarray([p + m for p, m in zip(starts, lens)], dtype=np.int64)
        batch = ForwardBatch(
            input_ids=np.concatenate(inputs), positions=positions, slot_mapping=slot_mapping,
            query_starts=query_starts, context_lens=context_lens, block_tables=tables,
            logit_rows=query_starts[1:] - 1, prompt_lens=np.asarray([r[4] for r in rows], dtype=np.int64),
            query_starts_list=query_starts.tolist(), context_lens_list=context_lens.tolist(),
            num_decode_seqs=sum(1 for m in lens if m == 1) if lens[0] == 1 else 0, block_size=bs)
        self.num_forwards += 1
        start = time.perf_counter()
        logits = self.model.forward(batch, self.kv_cache)
        seconds = time.perf_counter() - start
        self.seconds += seconds
        if len(positions) == len(rows):  # one id each: the cost of a draft id (the verify budget's)
            old = self.step_seconds
            self.step_seconds = seconds if old == 0 else old + STEP_SMOOTHING * (seconds - old)
        else:  # catching up: what each id beyond one per sequence added (the budget's catch_up_seconds)
            extra = seconds - self.step_seconds if self.step_seconds else seconds
            per_id, old = max(0.0, extra) / (len(positions) - len(rows)), self.row_seconds
            self.row_seconds = per_id if old == 0 else old + STEP_SMOOTHING * (per_id - old)
        return logits
