"""Speculative decoding: proposers, and the verify/rollback step of the scheduler tick.

A running decode whose request allows it (``SpecDecoder.is_eligible``: greedy, no logprobs,
no logits processing, no grammar, one choice) gets a proposal of at most k ids before the
tick is planned. The ids are appended to its token row as if they were prompt tokens, so the
tick runs the sequence's last real token and its k proposals as one causal chunk of 1 + k
query rows over its paged KV (the same path as a prefill chunk); every one of those rows
gets logits. After sampling, the target's greedy choice at each row is compared with the
proposal: the longest agreeing prefix and the target's own next token are emitted, and the
rejected rows are rolled back: the sequence's length is cut to what was accepted, its
computed count to the KV rows that hold verified tokens, and blocks past the new length go
back to the block manager. Decode blocks are never published to the prefix cache, so an
unverified token never reaches it.

Speculation runs only on ticks where it cannot disturb the plan: no request waits, no
running sequence is mid-prefill, every proposal fits the tick's token budget and the free
blocks (proposals are cut to fit). A sequence whose proposals keep failing stops proposing
for a while (the adaptive gate), so open-ended text costs almost nothing extra.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SPECULATIVE_METHODS = ("ngram",)  # "draft" and "auto" are in the contract and not built yet
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
NGRAM_MIN = 2
NGRAM_MAX = 4
# The adaptive gate: after this many proposals in a row with nothing accepted, a sequence
# waits 2**(failures - GATE_FAILURES + 1) decode steps (at most GATE_MAX_WAIT) before proposing again.
GATE_FAILURES = 2
GATE_MAX_WAIT = 64


class Proposer:
    """``propose(tokens) -> list[int]``: at most ``k`` ids that may follow ``tokens``."""

    k: int

    def propose(self, tokens: np.ndarray) -> list[int]:
        raise NotImplementedError


class NgramProposer(Proposer):
    """Prompt lookup over one sequence: the longest suffix (n from ngram_max down to ngram_min)
    that occurred earlier proposes the up to k ids that followed its latest earlier occurrence.

    The index maps each n-gram (as a tuple) to the last position it ended at and is brought up
    to date incrementally, so a proposal costs O(ngram_max**2) whatever the context length. It
    indexes every n-gram that ends before the last token (the suffix must not find itself).
    """

    __slots__ = ("k", "ngram_min", "ngram_max", "_ids", "_index", "_num_indexed")

    def __init__(self, k: int, ngram_min: int = NGRAM_MIN, ngram_max: int = NGRAM_MAX) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.k = k
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._ids: list[int] = []  # copy of the sequence's ids seen so far
        self._index: dict[tuple[int, ...], int] = {}
        self._num_indexed = 0  # n-grams ending at positions < this are in the index

    def propose(self, tokens: np.ndarray) -> list[int]:
        ids = self._ids
        num = len(tokens)
        if num < len(ids) or (ids and ids[-1] != int(tokens[len(ids) - 1])):  # history changed: rebuild
            ids.clear()
            self._index.clear()
            self._num_indexed = 0
        if num > len(ids):
            ids.extend(tokens[len(ids):num].tolist())
        index = self._index
        lo, hi = self.ngram_min, self.ngram_max
        for end in range(self._num_indexed, num - 1):  # index n-grams ending at end (< num - 1)
            for n in range(lo, min(hi, end + 1) + 1):
                index[tuple(ids[end - n + 1 : end + 1])] = end
        self._num_indexed = max(self._num_indexed, num - 1)
        for n in range(min(hi, num - 1), lo - 1, -1):
            end = index.get(tuple(ids[num - n :]))
            if end is not None:
                return ids[end + 1 : min(end + 1 + self.k, num)]
        return []


@dataclass(slots=True)
class SpecState:
    """One sequence's proposer and adaptive gate."""

    proposer: Proposer
    num_failures: int = 0  # proposals in a row with nothing accepted
    wait: int = 0  # decode steps to skip before the next proposal


@dataclass(slots=True)
class SpecEntry:
    """A sequence that carries a proposal in this tick."""

    seq: object
    slot: int
    epoch: int
    num_tokens: int  # L: the sequence's length without the proposal
    draft: list[int]


@dataclass
class SpecDecoder:
    """Engine-wide: which sequences propose in a tick, and the verify/rollback step."""

    method: str
    k: int
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_proposals: int = 0
    entries: list[SpecEntry] = field(default_factory=list)  # this tick's proposals

    def is_eligible(self, params, request) -> bool:
        """Requests whose output speculation keeps token-for-token exact (greedy and plain)."""
        return (params.temperature == 0 and params.n == 1 and not params.logprobs and not params.top_logprobs
                and request.adjuster is None and request.grammar is None and not params.has_logits_processing)

    def make_state(self) -> SpecState:
        return SpecState(NgramProposer(self.k))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    # -- before the plan (Scheduler.schedule) --

    def propose(self, state, running: list, bm, budget: int, prefill_budget: int, max_model_len: int) -> None:
        """Append proposals to eligible decodes of ``running`` (all decoding, none waiting), cut so
        that the tick's plan runs each proposal whole: within the token budget, the chunk size
        and the free blocks. ``budget``: max_num_batched_tokens."""
        self.entries = []
        bs = state.block_size
        num_tokens, num_computed, num_blocks = state.num_tokens, state.num_computed, state.num_blocks
        proposals = []
        num_plain = 0
        need_blocks = 0
        for seq in running:
            if int(num_tokens[seq.slot]) - int(num_computed[seq.slot]) != 1:
                return  # a prefill is running: no speculation this tick
        for seq in running:
            s = seq.slot
            n = int(num_tokens[s])
            spec = seq.spec
            draft: list[int] = []
            if spec is not None:
                if spec.wait > 0:
                    spec.wait -= 1
                else:
                    room = min(seq.num_prompt_tokens + seq.max_tokens - n - 1, max_model_len - n - 1)
                    if room > 0:
                        draft = spec.proposer.propose(seq.token_array)[:room]
            if draft:
                proposals.append((seq, draft))
            else:
                num_plain += 1
                need_blocks += max(0, -(-n // bs) - int(num_blocks[s]))
        if not proposals:
            return
        limit = min(budget - num_plain, prefill_budget if num_plain else budget)
        free = bm.num_free_blocks - need_blocks
        epochs, tokens = state.epochs, state.tokens
        for seq, draft in proposals:
            s = seq.slot
            n = int(num_tokens[s])
            k = min(len(draft), limit - 1)
            while k > 0 and max(0, -(-(n + k) // bs) - int(num_blocks[s])) > free:
                k -= 1
            held = max(0, -(-(n + k) // bs) - int(num_blocks[s]))
            free -= held
            limit -= 1 + k
            if k <= 0:
                continue
            tokens[s, n : n + k] = draft[:k]
            num_tokens[s] = n + k
            self.entries.append(SpecEntry(seq, s, int(epochs[s]), n, draft[:k]))

    def withdraw(self, state) -> None:
        """Take this tick's proposals back out of the token rows."""
        for entry in self.entries:
            state.num_tokens[entry.slot] = entry.num_tokens
        self.entries = []

    # -- after the build (Scheduler._build_output) --

    def logit_rows(self, layout, sample_entries: np.ndarray, slots: np.ndarray):
        """Every row of each speculative entry gets logits. Returns (logit_rows [R] int64,
        sample_logit_index [S]: the first row of each sampled entry, [(SpecEntry, sample index,
        first row)]). Speculative ticks have no prompt-logprob spans (no prefill runs)."""
        if layout.num_spans:
            raise RuntimeError("a speculative tick has prompt-logprob rows")
        spec_slots = {e.slot: e for e in self.entries}
        qs = layout.query_starts
        rows: list[int] = []
        index: list[int] = []
        spec_entries = []
        for k, i in enumerate(sample_entries.tolist()):
            start, stop = int(qs[i]), int(qs[i + 1])
            index.append(len(rows))
            entry = spec_slots.get(int(slots[i]))
            if entry is None:
                rows.append(stop - 1)
            else:
                if stop - start != 1 + len(entry.draft):
                    raise RuntimeError(f"slot {entry.slot}: the plan cut a speculative chunk")
                spec_entries.append((entry, k, len(rows)))
                rows.extend(range(start, stop))
        if len(spec_entries) != len(self.entries):
            raise RuntimeError("a speculative sequence was not sampled in its tick")
        return np.asarray(rows, dtype=np.int64), index, spec_entries

    # -- after sampling (EngineCore._tick) --

    def accept(self, entry: SpecEntry, target: list[int]) -> list[int]:
        """The emitted ids for a proposal: the agreeing prefix of ``target`` (the target's greedy
        choice at each of the 1 + k rows) and the target's next id. Updates the gate and counts."""
        draft = entry.draft
        a = 0
        while a < len(draft) and draft[a] == target[a]:
            a += 1
        self.num_proposals += 1
        self.num_draft_tokens += len(draft)
        self.num_accepted_tokens += a
        spec = entry.seq.spec
        if a == 0:
            spec.num_failures += 1
            if spec.num_failures >= GATE_FAILURES:
                spec.wait = min(GATE_MAX_WAIT, 2 ** (spec.num_failures - GATE_FAILURES + 1))
        else:
            spec.num_failures = 0
        return target[: a + 1]

    def rollback(self, state, bm, entry: SpecEntry, emitted: list[int]) -> bool:
        """After ``state.commit``: the slot holds L + k proposed ids + one sampled id and counts
        L + k computed rows. Rewrite it to L + len(emitted) ids with the verified KV rows counted
        computed, and free the blocks past the new length. False if the slot was rebound."""
        s = entry.slot
        if int(state.epochs[s]) != entry.epoch:
            return False
        n = entry.num_tokens
        m = len(emitted)
        state.tokens[s, n : n + m] = emitted
        state.num_tokens[s] = n + m
        state.num_computed[s] = n + m - 1
        keep = -(-(n + m) // state.block_size)
        nb = int(state.num_blocks[s])
        if nb > keep:
            bm.free(state.block_tables[s, keep:nb].tolist())
            state.block_tables[s, keep:nb] = -1
            state.num_blocks[s] = keep
        return True


def make_spec_decoder(method: str | None, num_speculative_tokens: int) -> SpecDecoder | None:
    if method is None:
        return None
    return SpecDecoder(method, num_speculative_tokens)
