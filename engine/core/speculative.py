"""Speculative decoding: proposers, and the verify/rollback step of the scheduler tick.

A running decode gets a proposal of at most k ids before the tick is planned. The ids are
appended to its token row as if they were prompt tokens, so the tick runs the sequence's last
real token and its k proposals as one causal chunk of 1 + k query rows over its paged KV (the
same path as a prefill chunk); every one of those rows gets logits. After the forward, each
row is sampled as plain decoding would sample that position, and a proposal is accepted while
the target's sample equals it; the first disagreeing sample (or the sample after the last
proposal) is the target's own next token. The rejected rows are rolled back: the sequence's
length is cut to what was accepted, its computed count to the KV rows that hold verified
tokens, and blocks past the new length go back to the block manager. Decode blocks are never
published to the prefix cache, so an unverified token never reaches it.

The acceptance rule for sampling. An n-gram proposal is deterministic (its q is one-hot), so
the speculative sampling rule (accept x with probability min(1, p(x) / q(x)), else draw from
the normalised residual max(0, p - q)) reads: accept x with probability p(x), else draw from
p with x removed. Drawing y from p with the position's own uniform (inverse CDF, as the
sampler does) and accepting iff y == x is exactly that rule, and it makes the same token the
plain decode would make with that uniform: a seeded request's output is the same with and
without speculation, whatever the batch. Verification draws ahead over the k rows, then
rewinds the request's stream to one draw per emitted token. ``accept_from_draft`` is the
rule for a proposal drawn from a real draft distribution q.

Exact per position: the sampler processes row j with the request's logits processing as of
position j (temperature, top-k/top-p/min-p, penalties with the counts of the ids before it,
logit_bias, min_tokens, bad words) and the grammar's mask after the ids before it. Requests
without a logits adjuster or grammar verify all rows in one sampler call; the others are
verified in order as the run is emitted (``SpecRun.rows``), a row sampled only once the ids
before it are counted, so a proposal the grammar rejects ends the run.

Speculation runs only on ticks where it cannot disturb the plan: no request waits, no
running sequence is mid-prefill, fewer than MAX_VERIFY_ROWS sequences decode, and every
proposal fits the tick's token budget, the free blocks and MAX_VERIFY_ROWS rows in all
(proposals are cut to fit). A sequence whose proposals keep failing stops proposing for a
while (the adaptive gate), so open-ended text costs almost nothing extra.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np
import torch

from cext.ngram import NgramIndex

from ..sampling import sampler
from ..structured import mask_rows
from .draft import DraftModel

SPECULATIVE_METHODS = ("ngram", "draft")  # "auto" is in the contract and not built yet
DEFAULT_NUM_SPECULATIVE_TOKENS = 4
NGRAM_MIN = 2
NGRAM_MAX = 4
# The adaptive gate: after this many proposals in a row with nothing accepted, a sequence
# waits 2**(failures - GATE_FAILURES + 1) decode steps (at most GATE_MAX_WAIT) before proposing again.
GATE_FAILURES = 2
GATE_MAX_WAIT = 64
# Adaptive k: a sequence's proposals are at most its own limit, which starts at FIRST_LIMIT (or k,
# if smaller), doubles (up to k) when a whole proposal is accepted and falls to one more than the
# accepted ids when one is not. Each verified row costs a share of a step (the products' work per
# row; a 5-row verification took 2.0x a one-row step on Qwen2.5-0.5B, AVX-512, benchmarks/row_routes.py),
# so long proposals pay only inside a run the output copies, short ones everywhere else.
FIRST_LIMIT = 4
# Rows a speculative tick may verify in all (its decoding sequences' own rows and every proposed
# id). Past a few rows a step's products are bound by arithmetic, so a proposed id costs nearly a
# row's share of the step while it yields less than one id on average: at 16 streams on
# Qwen2.5-0.5B, uncapped speculation ran 0.91-0.95x plain decoding (benchmarks/speculative.py
# --streams 16). 16 is also how far a step keeps the one-row route (routes.same_route_up_to).
MAX_VERIFY_ROWS = 16
# Within that cap a tick verifies the proposed ids that give it the highest expected rate:
# (decoding sequences + expected accepted ids) / seconds of a tick of that many rows
# (SpecDecoder.verify_budget). A sequence's chances come from its own proposals so far (SpecState),
# the seconds of an r-row step from the engine's own decode ticks (StepTimes). Measured before the
# budget: at 4 streams of open-ended text (acceptance ~0.55) n-gram speculation ran 0.91-0.93x plain
# decoding on Qwen2.5-0.5B, a verified row costing more than the ~0.55 of an id it returned.
STEP_ROWS_PRIOR = 3.0  # an untimed r-row step: seconds ~ r + 3 (a 5-row step ~2x a one-row step)
FIRST_PRIOR = (1.0, 2.0)  # (accepted, tried) of a proposal's first id before any proposal: 0.5
# and of the ids after an accepted one: 0.9. Hopeful on purpose: copying goes on once it starts,
# and a budget that never verifies a long proposal never learns what one returns.
NEXT_PRIOR = (0.9, 1.0)
RATE_SMOOTHING = 0.3  # weight of the newest proposal in a sequence's chances
RATE_RECOVERY = 0.02  # per tick the budget cuts a sequence's offer, its chances move this far back to the priors
STEP_SMOOTHING = 0.2  # weight of the newest tick in StepTimes
VERIFY_BUDGET = True  # SpecDecoder.budgeted's default (tests of exactness turn it off: every id verified)


class Proposer(abc.ABC):
    """``propose(tokens) -> list[int]``: at most ``k`` ids that may follow ``tokens``."""

    k: int

    def propose(self, tokens: np.ndarray) -> list[int]:
        raise NotImplementedError


# Prompt lookup over one sequence (cext/ngram.pyx): the longest suffix (n from ngram_max down to
# ngram_min) that occurred earlier proposes the up to k ids that followed its latest earlier
# occurrence; an incremental hash of n-grams, O(ngram_max**2) per proposal at any context length.
NgramProposer = NgramIndex
Proposer.register(NgramIndex)


@dataclass(slots=True)
class SpecState:
    """One sequence's proposer, its adaptive k (``limit``), its adaptive gate and how its proposals
    fare: the chance its first proposed id is accepted, and the chance an id after an accepted one
    is (running averages of accepted / tried ids). Copied text is accepted in runs: once a
    proposal's first id holds, the next ones mostly do too."""

    proposer: Proposer | None  # prompt lookup over the sequence (None: the draft model's state)
    limit: int = FIRST_LIMIT  # most ids the next proposal may have (adaptive k, <= the engine's k)
    num_failures: int = 0  # proposals in a row with nothing accepted
    wait: int = 0  # decode steps to skip before the next proposal
    first_ok: float = FIRST_PRIOR[0]
    first_tried: float = FIRST_PRIOR[1]
    next_ok: float = NEXT_PRIOR[0]
    next_tried: float = NEXT_PRIOR[1]
    # With a draft model: the same for its proposals (it proposes where the lookup finds nothing,
    # and fares differently: each source keeps its own k, gate and chances)
    model: SpecState | None = None

    def chances(self, num_ids: int) -> list[float]:
        """The chance that each of the first num_ids ids of a proposal is accepted (with all
        before it)."""
        chance, first, after = 1.0, self.first_ok / self.first_tried, self.next_ok / self.next_tried
        out = []
        for i in range(num_ids):
            chance *= first if i == 0 else after
            out.append(chance)
        return out

    def observe(self, num_accepted: int, num_proposed: int) -> None:
        """A proposal of num_proposed ids with its first num_accepted accepted."""
        a = RATE_SMOOTHING
        self.first_ok += a * ((num_accepted > 0) - self.first_ok)
        self.first_tried += a * (1 - self.first_tried)
        if num_accepted > 0:  # the ids after the first: a - 1 passed, one more failed unless all passed
            self.next_ok += a * (num_accepted - 1 - self.next_ok)
            self.next_tried += a * (num_accepted - 1 + (num_accepted < num_proposed) - self.next_tried)

    def recover(self) -> None:
        """A tick the budget cut this sequence's offer: its chances drift back to the priors, so a
        sequence whose text turns repetitive later is tried again, and at length."""
        r = RATE_RECOVERY
        self.first_ok += r * (FIRST_PRIOR[0] - self.first_ok)
        self.first_tried += r * (FIRST_PRIOR[1] - self.first_tried)
        self.next_ok += r * (NEXT_PRIOR[0] - self.next_ok)
        self.next_tried += r * (NEXT_PRIOR[1] - self.next_tried)


class StepTimes:
    """Seconds of the engine's ticks without prefill (schedule, forward, output), by their rows (running averages),
    and an estimate for any row count: the timed value, else linear between the nearest timed
    counts, else scaled from the nearest timed count as r + STEP_ROWS_PRIOR (relative to
    1 + STEP_ROWS_PRIOR seconds when none is timed: the budget compares ratios only)."""

    def __init__(self, max_rows: int = 4 * MAX_VERIFY_ROWS):
        self.seconds = np.zeros(max_rows + 1, dtype=np.float64)  # [rows]; 0: not timed

    def observe(self, num_rows: int, seconds: float) -> None:
        if not 0 < num_rows < len(self.seconds) or not seconds > 0:
            return
        old = self.seconds[num_rows]
        self.seconds[num_rows] = seconds if old == 0 else old + STEP_SMOOTHING * (seconds - old)

    def estimate(self, num_rows: int) -> float:
        return float(self.estimates(num_rows)[num_rows])

    def estimates(self, max_rows: int) -> np.ndarray:
        """[max_rows + 1] the estimate for 0..max_rows rows, in one pass (the budget reads up to
        MAX_VERIFY_ROWS of them a tick)."""
        rows = np.arange(max_rows + 1, dtype=np.float64)
        timed = self.seconds
        known = np.flatnonzero(timed)
        if not len(known):
            return rows + STEP_ROWS_PRIOR
        lo, hi = int(known[0]), int(known[-1])
        out = np.interp(rows, known, timed[known])  # the timed values, linear between them
        out[rows < lo] = timed[lo] * (rows[rows < lo] + STEP_ROWS_PRIOR) / (lo + STEP_ROWS_PRIOR)
        out[rows > hi] = timed[hi] * (rows[rows > hi] + STEP_ROWS_PRIOR) / (hi + STEP_ROWS_PRIOR)
        return out


@dataclass(slots=True)
class SpecEntry:
    """A sequence that carries a proposal in this tick."""

    seq: object
    slot: int
    epoch: int
    num_tokens: int  # L: the sequence's length without the proposal
    draft: list[int]
    by_model: bool = False  # proposed by the draft model (else by prompt lookup)


@dataclass(slots=True)
class SpecRun:
    """What one proposal emits: ids (and their logprob rows) verified so far."""

    entry: SpecEntry
    ids: list[int]
    logprobs: list
    rows: torch.Tensor | None = None  # [k, V] the draft rows' logits, for a run verified in order
    is_counted: bool = False


def accept_from_draft(p: np.ndarray, q: np.ndarray, x: int, stream) -> tuple[int, bool]:
    """The speculative sampling rule for a proposal ``x`` drawn from a draft distribution ``q``
    [V] against the target's ``p`` [V] (both normalised, float64): accept with probability
    min(1, p(x) / q(x)), else draw from the normalised residual max(0, p - q). Two uniforms of
    ``stream`` at most. Returns (id, is_accepted); the id is distributed as p."""
    if stream.random() * q[x] < p[x]:
        return x, True
    residual = np.maximum(p - q, 0.0)
    cdf = np.cumsum(residual)
    if not cdf[-1] > 0:  # p == q: never rejected (up to rounding); draw from p
        cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, stream.random() * cdf[-1], side="right"))
    return min(i, len(p) - 1), False


@dataclass
class SpecDecoder:
    """Engine-wide: which sequences propose in a tick, and the verify/rollback step."""

    method: str
    k: int
    draft: DraftModel | None = None  # speculative="draft": the model that proposes
    adaptive: bool = True  # adaptive k (FIRST_LIMIT); False: every proposal may have k ids (benchmarks)
    budgeted: bool = field(default_factory=lambda: VERIFY_BUDGET)  # verify_budget; False: every id
    # within MAX_VERIFY_ROWS, first come first served
    step_times: StepTimes = field(default_factory=StepTimes)  # ticks of any number of sequences
    # and per number of decoding sequences: a tick of R rows costs more as its sequences are more
    # (their attention, their output), so one sequence's 5-row verification says little of 4
    # sequences and one proposed id
    step_times_by_seqs: dict[int, StepTimes] = field(default_factory=dict)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_proposals: int = 0
    # Of those, the draft model's proposals (the others came from prompt lookup)
    num_model_draft_tokens: int = 0
    num_model_accepted_tokens: int = 0
    entries: list[SpecEntry] = field(default_factory=list)  # this tick's proposals

    def make_state(self) -> SpecState:
        """Every sequence looks its own context up (prompt lookup); with a draft model, the draft
        proposes where the lookup finds nothing (``propose``)."""
        limit = min(self.k, FIRST_LIMIT) if self.adaptive else self.k
        return SpecState(NgramProposer(self.k, NGRAM_MIN, NGRAM_MAX), limit=limit,
                         model=None if self.draft is None else SpecState(None, limit=limit))

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
        if len(running) >= MAX_VERIFY_ROWS:
            return  # no row to spare: the tick decodes plainly
        for seq in running:
            if int(num_tokens[seq.slot]) - int(num_computed[seq.slot]) != 1:
                return  # a prefill is running: no speculation this tick
        wants, model_wants = {}, {}  # slot -> most ids prompt lookup / the draft model may propose
        for seq in running:
            n = int(num_tokens[seq.slot])
            spec = seq.spec
            if spec is None:
                continue
            room = min(seq.num_prompt_tokens + seq.max_tokens - n - 1, max_model_len - n - 1)
            for source, out in ((spec, wants), (spec.model, model_wants)):
                if source is None:
                    continue
                if source.wait > 0:
                    source.wait -= 1
                elif min(room, source.limit) > 0:
                    out[seq.slot] = min(room, source.limit)
        # Prompt lookup first: its proposals are free (often short or missing, so budgeted once made).
        drafts = {seq.slot: seq.spec.proposer.propose(seq.token_array)[: wants[seq.slot]]
                  for seq in running if seq.slot in wants}
        drafts = {s: d for s, d in drafts.items() if d}
        if self.draft is not None:
            # The draft model for the others. A draft id costs a draft forward row: ask for no more
            # than the tick will verify.
            model_slots = {s for s in model_wants if s not in drafts}
            offers = {s: len(d) for s, d in drafts.items()} | {s: model_wants[s] for s in model_slots}
            catch_up = {s: self.draft.catch_up_seconds(state, s, int(num_tokens[s])) for s in model_slots}
            verified = self.verify_budget(running, offers, model_slots, self.draft.step_seconds, catch_up)
            self.draft.sync(state, {seq.slot for seq in running})
            drafted = self.draft.propose(state, [(seq.slot, int(num_tokens[seq.slot]), verified[seq.slot],
                                                  seq.num_prompt_tokens) for seq in running
                                                 if seq.slot in verified and seq.slot not in drafts])
        else:
            verified = self.verify_budget(running, {s: len(d) for s, d in drafts.items()})
            drafted = {}
        drafts = {s: d[: verified[s]] for s, d in drafts.items() if s in verified}
        drafts.update(drafted)
        for seq in running:
            s = seq.slot
            n = int(num_tokens[s])
            draft = drafts.get(s)
            if draft:
                proposals.append((seq, draft))
            else:
                num_plain += 1
                need_blocks += max(0, -(-n // bs) - int(num_blocks[s]))
        if not proposals:
            return
        limit = min(budget - num_plain, prefill_budget if num_plain else budget)
        extra = MAX_VERIFY_ROWS - len(running)  # proposed ids the tick may add to its decode rows
        free = bm.num_free_blocks - need_blocks
        epochs, tokens = state.epochs, state.tokens
        for seq, draft in proposals:
            s = seq.slot
            n = int(num_tokens[s])
            k = min(len(draft), limit - 1, extra)
            while k > 0 and max(0, -(-(n + k) // bs) - int(num_blocks[s])) > free:
                k -= 1
            held = max(0, -(-(n + k) // bs) - int(num_blocks[s]))
            free -= held
            limit -= 1 + k
            extra -= max(k, 0)
            if k <= 0:
                continue
            tokens[s, n : n + k] = draft[:k]
            num_tokens[s] = n + k
            self.entries.append(SpecEntry(seq, s, int(epochs[s]), n, draft[:k], s in drafted))

    def verify_budget(self, running: list, offers: dict, model_slots: set | frozenset = frozenset(),
                      model_seconds: float = 0.0, catch_up_seconds: dict | None = None) -> dict:
        """``offers``: {slot: ids it may propose} -> {slot: ids the tick verifies} (none: left
        out). The likeliest ids (SpecState.chances; ties in running order), as
        many as give the tick the highest expected rate: (decoding sequences + expected accepted
        ids) / step seconds of that many rows, within MAX_VERIFY_ROWS rows in all (none when no
        count beats plain decoding). The ids of ``model_slots`` are still to be drafted: each of
        the draft's forwards (as many as the most ids one of them is given) adds ``model_seconds``
        (counted once the tick's own steps are timed, in the same seconds), and a model slot's
        first id what its draft cache must catch up before it (``catch_up_seconds``: {slot:
        seconds}; a new sequence's whole prompt, else the ids accepted since its last draft). A
        sequence given fewer ids than it offered drifts back toward the priors (SpecState.recover)."""
        num_decodes = len(running)
        if not self.budgeted:
            rows_left, out = MAX_VERIFY_ROWS - num_decodes, {}
            for seq in running:
                k = min(offers.get(seq.slot, 0), rows_left)
                if k > 0:
                    out[seq.slot] = k
                    rows_left -= k
            return out
        ids = []  # (to be drafted, -chance, running order, slot): free ids first, each kind likeliest first
        for order, seq in enumerate(running):
            k = offers.get(seq.slot, 0)
            if k > 0:
                by_model = seq.slot in model_slots
                source = seq.spec.model if by_model else seq.spec
                ids.extend((by_model, -chance, order, seq.slot) for chance in source.chances(k))
        ids.sort()
        del ids[max(0, MAX_VERIFY_ROWS - num_decodes):]
        # For e extra rows the best are the e likeliest ids (the step's time depends on its rows
        # only), and a sequence's likeliest ids are its first ones: the best e over all of them.
        # Ids still to be drafted cost a draft forward too: they come after every free one.
        times = self.step_times_by_seqs.get(num_decodes)
        if times is None or not times.seconds.any():
            times = self.step_times  # no tick of this many sequences timed yet
        seconds = times.estimates(num_decodes + len(ids)).tolist()
        catch_up = catch_up_seconds or {}
        if times is self.step_times and not times.seconds.any():
            model_seconds, catch_up = 0.0, {}  # the estimates are relative until a step is timed
        expected = float(num_decodes)
        best, best_e = expected / seconds[num_decodes], 0
        drafted: dict = {}  # model slot -> ids so far
        num_forwards = 0
        caught_up = 0.0  # the drafted slots' catch-up seconds, once each
        for e, (by_model, neg_chance, _order, slot) in enumerate(ids, 1):
            expected -= neg_chance
            if by_model:
                if slot not in drafted:
                    caught_up += catch_up.get(slot, 0.0)
                drafted[slot] = drafted.get(slot, 0) + 1
                num_forwards = max(num_forwards, drafted[slot])
            value = expected / (seconds[num_decodes + e] + num_forwards * model_seconds + caught_up)
            if value > best:
                best, best_e = value, e
        out: dict = {}
        for _by_model, _neg_chance, _order, slot in ids[:best_e]:
            out[slot] = out.get(slot, 0) + 1
        for seq in running:
            if out.get(seq.slot, 0) < offers.get(seq.slot, 0):
                (seq.spec.model if seq.slot in model_slots else seq.spec).recover()
        return out

    def observe_step(self, num_rows: int, seconds: float, num_seqs: int | None = None) -> None:
        """A tick without prefill (decode rows and proposals only) of ``num_seqs`` decoding
        sequences took ``seconds``: its schedule (proposals, the verify budget, the plan), its
        forward and the work on its output (sampling, verification, events). The budget reads the
        times of ticks of its own number of sequences, those of any number until one is timed."""
        self.step_times.observe(num_rows, seconds)
        if num_seqs is not None and 0 < num_seqs <= MAX_VERIFY_ROWS:
            times = self.step_times_by_seqs.get(num_seqs)
            if times is None:
                times = self.step_times_by_seqs[num_seqs] = StepTimes()
            times.observe(num_rows, seconds)

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

    def verify(self, spec_entries: list, logits: torch.Tensor, reqs: list, token_ids: list[int],
               row_logprobs: list) -> dict:
        """The runs of this tick's proposals -> {sample index: SpecRun}. ``token_ids[k]`` /
        ``row_logprobs[k]``: what the tick's sampler call drew at each entry's first row.

        Requests without logits processing or grammar: the k draft rows of all of them in one
        sampler call (each drawing from its own stream in row order), the run cut at the first
        disagreement and the stream rewound to one draw per emitted id. The others keep their
        draft rows for ``sample_next``, in order."""
        runs, batched = {}, []
        for entry, k, first in spec_entries:
            req = reqs[k]
            run = SpecRun(entry, [token_ids[k]], [row_logprobs[k]])
            runs[k] = run
            if req.adjuster is None and req.grammar is None:
                batched.append((run, req, first))
            else:
                run.rows = logits[first + 1 : first + 1 + len(entry.draft)].float().contiguous()  # [k, V]
        if batched:
            rows, params, streams, snapshots = [], [], [], []
            for run, req, first in batched:
                n = len(run.entry.draft)
                rows.extend(range(first + 1, first + 1 + n))
                params.extend([req.params] * n)
                streams.extend([req.generator] * n)
                snapshots.append(req.generator.snapshot() if req.generator is not None else None)
            picked = logits.index_select(0, torch.tensor(rows, dtype=torch.int64))  # [R, V] a copy
            ids, lps = sampler.sample(picked, params, streams)
            j = 0
            for (run, req, _first), snapshot in zip(batched, snapshots):
                n = len(run.entry.draft)
                run.ids = self.accept(run.entry, run.ids + ids[j : j + n])
                run.logprobs = (run.logprobs + lps[j : j + n])[: len(run.ids)]
                run.is_counted = True
                if snapshot is not None:
                    req.generator.restore(snapshot, len(run.ids) - 1)
                j += n
        return runs

    def sample_next(self, run: SpecRun, req) -> bool:
        """For a run verified in order, after its last id was counted (the request's adjuster
        and grammar are at that position): if that id was the proposal, sample the next row and
        append it. False when the run is over."""
        m = len(run.ids)
        draft = run.entry.draft
        if run.rows is None or m > len(draft) or run.ids[-1] != draft[m - 1] or run.ids[-1] in req.stop_ids:
            return False
        if req.grammar is not None and (req.grammar.is_finished or req.grammar.error is not None):
            return False
        row = run.rows[m - 1 : m]  # [1, V] the logits after draft[m - 1]
        if req.grammar is not None:
            row = mask_rows(row, [req.grammar])
        ids, lps = sampler.sample(row, [req.params], [req.generator],
                                  [req.adjuster] if req.adjuster is not None else None)
        run.ids.append(ids[0])
        run.logprobs.append(lps[0])
        return True

    def finish_run(self, run: SpecRun) -> None:
        """Count a run verified in order (the batched ones are counted in ``verify``)."""
        if not run.is_counted:
            self.accept(run.entry, run.ids)
            run.is_counted = True

    def accept(self, entry: SpecEntry, target: list[int]) -> list[int]:
        """The emitted ids for a proposal: the agreeing prefix of ``target`` (the target's choice
        at each of the 1 + k rows, or fewer) and the target's next id. Updates the gate and counts."""
        draft = entry.draft
        a = 0
        while a < len(draft) and a < len(target) and draft[a] == target[a]:
            a += 1
        self.num_proposals += 1
        self.num_draft_tokens += len(draft)
        self.num_accepted_tokens += a
        if entry.by_model:
            self.num_model_draft_tokens += len(draft)
            self.num_model_accepted_tokens += a
        spec = entry.seq.spec.model if entry.by_model else entry.seq.spec  # the source's own state
        spec.observe(a, len(draft))
        if self.adaptive:  # a whole proposal accepted: the next may be twice as long; else one past it
            spec.limit = min(self.k, 2 * max(spec.limit, len(draft))) if a == len(draft) else a + 1
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


def make_spec_decoder(method: str | None, num_speculative_tokens: int, draft: DraftModel | None = None
                      ) -> SpecDecoder | None:
    if method is None:
        return None
    return SpecDecoder(method, num_speculative_tokens, draft)
