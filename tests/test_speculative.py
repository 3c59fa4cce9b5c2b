"""Speculative decoding (n-gram): the proposer against a brute-force scan, KV rollback against the
block manager's invariants, and engine output with speculation equal to plain decoding
(ScriptedModel scripts that copy the prompt, so proposals are accepted, cut and rejected)."""
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine.config import EngineConfig, add_engine_arguments, engine_options_from_args
from engine.core import draft, speculative
from engine.core.draft import DraftModel
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.sequence import Sequence
from engine.core.speculative import (
    FIRST_LIMIT,
    FIRST_PRIOR,
    MAX_VERIFY_ROWS,
    NEXT_PRIOR,
    STEP_ROWS_PRIOR,
    NgramProposer,
    SpecDecoder,
    SpecEntry,
    SpecState,
    StepTimes,
)
from engine.errors import InvalidParameterError
from engine.loader import default_model_path
from engine.params import SamplingParams
from engine.testing import ScriptedModel


@pytest.fixture(autouse=True)
def verify_every_proposed_id(monkeypatch):
    """These tests are about what speculation emits, so every proposed id within MAX_VERIFY_ROWS is
    verified: the verify budget (a speed policy from the machine's step times) is off here, and on
    in the tests of it."""
    monkeypatch.setattr(speculative, "VERIFY_BUDGET", False)


def reference_proposal(ids: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Longest suffix (n = hi..lo) found ending earlier (latest occurrence): the ids after it."""
    num = len(ids)
    for n in range(min(hi, num - 1), lo - 1, -1):
        suffix = ids[num - n :]
        for end in range(num - 2, n - 2, -1):
            if ids[end - n + 1 : end + 1] == suffix:
                return ids[end + 1 : min(end + 1 + k, num)]
    return []


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=60), st.integers(1, 5), st.integers(1, 3),
       st.integers(0, 3))
def test_ngram_proposer_matches_a_scan_incrementally(ids, k, lo, extra):
    hi = lo + extra
    proposer = NgramProposer(k, lo, hi)
    for num in range(1, len(ids) + 1):
        tokens = np.asarray(ids[:num], dtype=np.int32)
        assert proposer.propose(tokens) == reference_proposal(ids[:num], k, lo, hi)


def test_ngram_proposer_long_context_large_vocabulary():
    # 5,000 ids over a large vocabulary with copied stretches: the table grows many times over.
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 150_000, 2000).tolist()
    ids = ids + ids[300:1300] + rng.integers(0, 3, 1000).tolist() + ids[:1000]
    tokens = np.asarray(ids, dtype=np.int32)
    proposer = NgramProposer(5, 2, 4)
    checked = 0
    for num in range(1, len(ids) + 1):
        got = proposer.propose(tokens[:num])
        if num % 97 == 0 or num > len(ids) - 30:
            assert got == reference_proposal(ids[:num], 5, 2, 4), num
            checked += bool(got)
    assert checked > 20
    assert proposer.num_entries <= 3 * len(ids)


def test_ngram_proposer_rebuilds_when_the_history_changes():
    proposer = NgramProposer(3, 1, 2)
    assert proposer.propose(np.array([1, 2, 3, 1], dtype=np.int32)) == [2, 3, 1]
    assert proposer.propose(np.array([5, 6, 5], dtype=np.int32)) == [6, 5]
    with pytest.raises(ValueError, match="ngram_min"):
        NgramProposer(3, 3, 2)


# -- KV rollback at the scheduler level --

def blocks_for(n: int, bs: int) -> int:
    return -(-n // bs)


def run_scheduler(num_blocks, k, prompts, max_tokens, draw_accept, draw_token) -> Scheduler:
    """Drive a Scheduler with speculation as EngineCore does (propose, verify, commit, roll back),
    the target's ids coming from ``draw_token`` and accept lengths from ``draw_accept(k)``; checks
    the block manager's invariants after every tick."""
    bs = 4
    cfg = SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=24, num_blocks=num_blocks, max_model_len=64,
                          block_size=bs, target_tick_seconds=None)
    sched = Scheduler(cfg)
    spec = SpecDecoder("ngram", k)
    sched.spec = spec
    bm, state = sched.block_manager, sched.state
    for i, (prompt, m) in enumerate(zip(prompts, max_tokens)):
        seq = Sequence(f"r{i}", prompt, m)
        seq.spec = spec.make_state()
        sched.add(seq)
    for _tick in range(300):
        out = sched.schedule()
        if out is None:
            break
        entries = {k: entry for entry, k, _first in out.spec_entries}
        token_ids, emitted = [], {}
        for k in range(len(out.sample_seqs)):
            entry = entries.get(k)
            if entry is None:
                token_ids.append(draw_token())
                continue
            a = draw_accept(len(entry.draft))
            target = entry.draft[:a] + [draw_token() for _ in range(1 + len(entry.draft) - a)]
            emitted[k] = spec.accept(entry, target)
            token_ids.append(target[0])
            assert emitted[k] == target[: len(emitted[k])] and len(emitted[k]) >= a + 1
        sched.update(out, token_ids)
        for k, entry in entries.items():
            assert spec.rollback(state, bm, entry, emitted[k])
        sampled = {seq.request_id for seq in out.sample_seqs}
        for seq in list(sched.running):
            s = seq.slot
            n = int(state.num_tokens[s])
            if seq.request_id in sampled:  # everything but the newest id has verified KV
                assert int(state.num_computed[s]) == n - 1
                # Blocks past the length went back (the newest id's block may come with the next plan).
                assert blocks_for(n - 1, bs) <= int(state.num_blocks[s]) <= blocks_for(n, bs)
            if seq.num_generated >= seq.max_tokens:
                sched.finish(seq)
        refs: dict[int, int] = {}
        for seq in sched.running:
            for b in seq.block_ids:
                refs[b] = refs.get(b, 0) + 1
        bm.check_invariants(refs)
        # Only prompt blocks are published: an unverified id never reaches the prefix cache.
        assert bm.num_cached_blocks <= sum(len(p) // bs for p in prompts)
    assert not sched.has_work()
    bm.check_invariants({})
    return sched


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_rollback_keeps_block_manager_invariants(data):
    num_seqs = data.draw(st.integers(1, 3), label="num_seqs")
    prompts = [data.draw(st.lists(st.integers(0, 2), min_size=2, max_size=12), label="prompt")
               for _ in range(num_seqs)]
    max_tokens = [data.draw(st.integers(1, 20), label="max_tokens") for _ in range(num_seqs)]
    run_scheduler(data.draw(st.integers(8, 40), label="num_blocks"), data.draw(st.integers(1, 6), label="k"),
                  prompts, max_tokens, lambda n: data.draw(st.integers(0, n), label="accepted"),
                  lambda: data.draw(st.integers(0, 2), label="token"))


def test_rollback_with_preemption_and_full_acceptance():
    # Three sequences of 8 blocks each in 10 blocks: preemption while every proposal is accepted.
    sched = run_scheduler(10, 4, [[0] * 12] * 3, [20] * 3, lambda n: n, lambda: 0)
    assert sched.num_preemptions > 0
    assert sched.spec.num_accepted_tokens == sched.spec.num_draft_tokens > 0


# -- adaptive k --

class _Seq:
    def __init__(self, spec):
        self.spec = spec


def _accept(spec: SpecDecoder, state, draft: list[int], target: list[int]) -> list[int]:
    return spec.accept(SpecEntry(_Seq(state), 0, 0, 10, draft), target)


def test_adaptive_k_doubles_on_whole_proposals_and_falls_to_what_was_accepted():
    spec = SpecDecoder("ngram", 8)
    state = spec.make_state()
    assert state.limit == FIRST_LIMIT == 4
    assert _accept(spec, state, [1, 2, 3, 4], [1, 2, 3, 4, 9]) == [1, 2, 3, 4, 9]
    assert state.limit == 8  # doubled
    _accept(spec, state, list(range(8)), list(range(8)) + [9])
    assert state.limit == 8  # never past k
    assert _accept(spec, state, list(range(8)), [0, 1, 7]) == [0, 1, 7]
    assert state.limit == 3  # two accepted: the next proposal may have three
    _accept(spec, state, [5, 6, 7], [9])
    assert state.limit == 1 and state.num_failures == 1
    _accept(spec, state, [5], [5, 6])  # a short proposal accepted whole grows from its length
    assert state.limit == 2
    assert SpecDecoder("ngram", 2).make_state().limit == 2  # k below the first limit


def test_prompt_lookup_and_the_draft_model_keep_their_own_k_gate_and_chances():
    """With a draft model each source adapts to its own proposals: the draft model's failures
    shorten and gate only its proposals, the lookup's whole runs lengthen only the lookup's."""
    draft = DraftModel(ScriptedModel([7, 8, 9], 64), 64, 4, 4, 128)
    spec = SpecDecoder("draft", 8, draft=draft)
    state = spec.make_state()
    model = state.model
    assert model is not None and model.proposer is None and state.proposer is not None
    for _ in range(3):  # the draft model's proposals fail
        spec.accept(SpecEntry(_Seq(state), 0, 0, 10, [5, 6, 7, 8], by_model=True), [9])
    assert model.limit == 1 and model.num_failures == 3 and model.wait > 0
    assert model.chances(1)[0] < FIRST_PRIOR[0] / FIRST_PRIOR[1]
    assert (state.limit, state.num_failures, state.wait) == (FIRST_LIMIT, 0, 0)
    assert state.chances(2) == SpecDecoder("ngram", 8).make_state().chances(2)
    _accept(spec, state, [1, 2, 3, 4], [1, 2, 3, 4, 9])  # the lookup's whole proposal
    assert state.limit == 8 and model.limit == 1
    assert spec.num_model_draft_tokens == 12 and spec.num_model_accepted_tokens == 0
    assert spec.num_draft_tokens == 16 and spec.num_accepted_tokens == 4


def test_fixed_k_keeps_every_proposal_at_k():
    spec = SpecDecoder("ngram", 6, adaptive=False)
    state = spec.make_state()
    assert state.limit == 6
    _accept(spec, state, [1, 2, 3], [4])
    assert state.limit == 6


def test_a_proposal_is_cut_to_its_sequence_limit():
    """The scheduler asks for at most the sequence's limit: a prompt that repeats itself offers more."""
    cfg = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, num_blocks=32, max_model_len=128,
                          block_size=4, target_tick_seconds=None)
    sched = Scheduler(cfg)
    spec = sched.spec = SpecDecoder("ngram", 8)
    seq = Sequence("r0", [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [1, 2, 3], 40)
    seq.spec = spec.make_state()
    sched.add(seq)
    out = sched.schedule()  # the prompt
    sched.update(out, [4])
    for limit in (2, 8, 1):
        seq.spec.limit = limit
        out = sched.schedule()
        (entry, _k, _first), = out.spec_entries
        assert len(entry.draft) == limit
        emitted = spec.accept(entry, entry.draft + [entry.draft[-1] % 9 + 1])  # the pattern goes on
        sched.update(out, emitted[:1])
        assert spec.rollback(sched.state, sched.block_manager, entry, emitted)


def second_tick(spec: SpecDecoder, prompt: list[int], num_seqs: int):
    """A scheduler with ``spec`` and num_seqs copies of prompt (each allowed 8 proposed ids):
    the prompts' tick, then the first decode tick's plan."""
    cfg = SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=1024, num_blocks=512, max_model_len=128,
                          block_size=4, target_tick_seconds=None)
    sched = Scheduler(cfg)
    sched.spec = spec
    for i in range(num_seqs):
        seq = Sequence(f"r{i}", prompt, 40)
        seq.spec = spec.make_state()
        seq.spec.limit = 8
        if seq.spec.model is not None:
            seq.spec.model.limit = 8
        sched.add(seq)
    out = sched.schedule()  # the prompts, in one tick
    sched.update(out, [4] * num_seqs)
    return sched.schedule()


@pytest.mark.parametrize("num_seqs", [1, 4, 12, 15, 16, 20])
def test_a_tick_verifies_at_most_max_verify_rows(num_seqs):
    """Proposals are cut so that a tick's rows (one per decoding sequence plus every proposed id)
    stay within MAX_VERIFY_ROWS; from that many sequences on, the tick decodes plainly."""
    out = second_tick(SpecDecoder("ngram", 8), [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [1, 2, 3], num_seqs)
    proposed = sum(len(entry.draft) for entry, _k, _first in out.spec_entries)
    if num_seqs >= MAX_VERIFY_ROWS:
        assert proposed == 0
    else:  # every sequence's prompt repeats: the rows left are all used, and no more
        assert proposed == min(8 * num_seqs, MAX_VERIFY_ROWS - num_seqs)
        assert num_seqs + proposed <= MAX_VERIFY_ROWS


def test_a_tick_nobody_proposes_in_takes_the_steady_decode_plan():
    """With speculation on, a decode tick without a proposal is planned as plain decoding's steady
    state (one Cython plan, the one-call output path: SchedulerOutput.is_decode_only); a tick with
    one takes the general plan, its proposals verified."""
    quiet = second_tick(SpecDecoder("ngram", 8), [11, 12, 13, 14, 15], 3)  # nothing repeats: no proposal
    assert quiet.is_decode_only and not quiet.spec_entries and quiet.batch.num_tokens == 3
    copying = second_tick(SpecDecoder("ngram", 8), [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [1, 2, 3], 3)
    assert not copying.is_decode_only and copying.spec_entries and copying.batch.num_tokens > 3


@pytest.mark.parametrize("num_seqs", [1, 3, 12, 15, 16])
def test_the_draft_model_is_asked_for_no_more_ids_than_a_tick_verifies(num_seqs):
    """A draft id costs a row of every draft forward: the draft is asked for at most the rows a
    tick has left (MAX_VERIFY_ROWS less one per decoding sequence), first come first served, and
    the tick verifies all it proposed."""
    draft = DraftModel(ScriptedModel([7, 8, 9], 64), 512, 4, 24, 128)
    asked = []
    propose = draft.propose
    draft.propose = lambda state, wants: asked.append(list(wants)) or propose(state, wants)
    out = second_tick(SpecDecoder("draft", 8, draft=draft), [1, 2, 3, 4, 5], num_seqs)
    proposed = sum(len(entry.draft) for entry, _k, _first in out.spec_entries)
    rows_left = max(0, MAX_VERIFY_ROWS - num_seqs)
    wanted = sum(k for _slot, _n, k, _p in asked[0]) if asked else 0
    assert wanted == proposed == min(8 * num_seqs, rows_left)
    assert [k for _slot, _n, k, _p in asked[0]] == [min(8, rows_left - 8 * i) for i in range(len(asked[0]))] \
        if asked else rows_left == 0


def test_with_a_draft_model_prompt_lookup_proposes_first():
    """A sequence whose context repeats gets prompt lookup's proposal (free); the draft model is
    asked only for the sequences where the lookup found nothing."""
    draft = DraftModel(ScriptedModel([7, 8, 9], 64), 512, 4, 24, 128)
    asked = []
    propose = draft.propose
    draft.propose = lambda state, wants: asked.append([slot for slot, _n, _k, _p in wants]) or propose(state, wants)
    spec = SpecDecoder("draft", 8, draft=draft)
    cfg = SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=1024, num_blocks=512, max_model_len=128,
                          block_size=4, target_tick_seconds=None)
    sched = Scheduler(cfg)
    sched.spec = spec
    prompts = {"copies": [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [1, 2, 3], "new": [11, 12, 13, 14, 15]}
    seqs = {}
    for name, prompt in prompts.items():
        seqs[name] = seq = Sequence(name, prompt, 40)
        seq.spec = spec.make_state()
        seq.spec.limit = seq.spec.model.limit = 4
        sched.add(seq)
    sched.update(sched.schedule(), [4, 4])  # the prompts; each samples 4
    out = sched.schedule()
    by_name = {entry.seq.request_id: entry for entry, _k, _first in out.spec_entries}
    assert by_name["copies"].draft == [5, 6, 7, 8] and not by_name["copies"].by_model  # 3, 4 came before
    assert by_name["new"].by_model and len(by_name["new"].draft) == 4  # the scripted draft proposed
    assert asked == [[seqs["new"].slot]]


# -- the verify budget --

def test_step_times_estimate_timed_interpolated_and_scaled_rows():
    times = StepTimes(max_rows=32)
    assert times.estimate(5) / times.estimate(1) == pytest.approx((5 + STEP_ROWS_PRIOR) / (1 + STEP_ROWS_PRIOR))
    times.observe(2, 0.010)
    times.observe(6, 0.030)
    assert times.estimate(2) == 0.010 and times.estimate(4) == pytest.approx(0.020)  # timed; between
    assert times.estimate(1) == pytest.approx(0.010 * (1 + STEP_ROWS_PRIOR) / (2 + STEP_ROWS_PRIOR))
    assert times.estimate(10) == pytest.approx(0.030 * (10 + STEP_ROWS_PRIOR) / (6 + STEP_ROWS_PRIOR))
    times.observe(2, 0.020)  # a running average: the newest tick moves it part of the way
    assert 0.010 < times.estimate(2) < 0.020
    times.observe(0, 1.0)
    times.observe(33, 1.0)
    times.observe(3, 0.0)  # out of range or not a time: ignored
    assert times.estimate(3) == pytest.approx((times.estimate(2) + 0.030) / 2, rel=0.5)


def budget_reference(num_decodes: int, chances: list[list[float]], seconds) -> list[int]:
    """Every way to give each sequence a prefix of its offered ids within MAX_VERIFY_ROWS: the one
    of the highest expected rate (decoding sequences + expected accepted ids) / seconds(rows)."""
    import itertools

    best, best_take = num_decodes / seconds(num_decodes), [0] * len(chances)
    for take in itertools.product(*(range(len(c) + 1) for c in chances)):
        rows = num_decodes + sum(take)
        if rows > MAX_VERIFY_ROWS:
            continue
        value = (num_decodes + sum(sum(c[:k]) for c, k in zip(chances, take))) / seconds(rows)
        if value > best + 1e-12:
            best, best_take = value, list(take)
    return best_take


def _running(slot: int, first: float, after: float):
    seq = type("Running", (), {})()
    seq.slot = slot
    seq.spec = SpecState(None, first_ok=first, first_tried=1.0, next_ok=after, next_tried=1.0,
                         model=SpecState(None, first_ok=first, first_tried=1.0, next_ok=after, next_tried=1.0))
    return seq


@pytest.mark.parametrize("shape", ["flat", "linear", "prior", "concave"])
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.05, 0.97), st.floats(0.05, 0.99), st.integers(0, 5)), min_size=1,
                max_size=5),
       st.integers(0, 6))
def test_the_verify_budget_takes_the_ids_that_raise_the_expected_rate(shape, seqs, plain_seqs):
    """Against every allocation: the budget's rows give the best expected (tokens / step seconds),
    with the step times flat (every id pays), linear in the rows (no id yielding less than one
    token pays), the prior's, or a step whose rows cost less as they grow."""
    seconds = {"flat": lambda r: 1.0, "linear": lambda r: float(r), "prior": lambda r: r + STEP_ROWS_PRIOR,
               "concave": lambda r: r ** 0.5 + 2}[shape]
    spec = SpecDecoder("ngram", 8, budgeted=True)
    for rows in range(1, MAX_VERIFY_ROWS + 1):
        spec.observe_step(rows, seconds(rows))
    running = [_running(slot, first, after) for slot, (first, after, _n) in enumerate(seqs)]
    running += [_running(len(seqs) + i, 0.5, 0.5) for i in range(plain_seqs)]
    offers = [n for _first, _after, n in seqs] + [0] * plain_seqs
    chances = [seq.spec.chances(n) for seq, n in zip(running, offers)]
    got = spec.verify_budget(running, {slot: n for slot, n in enumerate(offers) if n})
    take = [got.get(slot, 0) for slot in range(len(running))]
    assert all(0 < k <= n for k, n in zip(take, offers) if k) and len(running) + sum(take) <= MAX_VERIFY_ROWS

    def value(t):
        return (len(running) + sum(sum(c[:k]) for c, k in zip(chances, t))) / seconds(len(running) + sum(t))
    assert value(take) == pytest.approx(value(budget_reference(len(running), chances, seconds)))
    if shape == "flat":
        assert sum(take) == min(sum(offers), MAX_VERIFY_ROWS - len(running))
    if shape == "linear":
        assert not got


def test_the_verify_budget_counts_the_draft_models_forwards():
    """Ids still to be drafted cost a draft forward each (as many as the most one sequence gets):
    free, every offered id is verified under flat step times; at a step's cost per forward none
    pays for a sequence whose ids hold 0.9 of the time; in between, fewer. Prompt lookup's ids
    (not in model_slots) stay free."""
    spec = SpecDecoder("draft", 8, budgeted=True)
    for rows in range(1, MAX_VERIFY_ROWS + 1):
        spec.observe_step(rows, 1.0)
    def budget(offers, model_slots, model_seconds):
        running = [_running(0, 0.9, 0.9), _running(1, 0.9, 0.9)]  # fresh: a refused one drifts (recover)
        return spec.verify_budget(running, offers, model_slots, model_seconds)

    assert budget({0: 6}, {0}, 0.0) == {0: 6}
    assert budget({0: 6}, {0}, 1.0) == {}
    some = budget({0: 6}, {0}, 0.3)
    assert 0 < some[0] < 6
    # one forward drafts for both sequences: two drafting sequences take more ids than one
    assert sum(budget({0: 6, 1: 6}, {0, 1}, 0.3).values()) > some[0]
    assert budget({0: 6, 1: 6}, {1}, 1.0) == {0: 6}  # the lookup's ids are free, and go first


def test_the_verify_budget_reads_the_step_times_of_its_number_of_sequences():
    """What a tick of R rows costs depends on its sequences: one sequence's cheap verifications do
    not make a proposed id cheap beside four decoding sequences. The budget reads the times of
    ticks with as many sequences as decode now, those of any number until one is timed."""
    spec = SpecDecoder("ngram", 8, budgeted=True)
    for rows in range(1, 9):
        spec.observe_step(rows, 1.0, num_seqs=1)  # one sequence: its verified rows cost nothing
    four = [_running(slot, 0.9, 0.9) for slot in range(4)]
    assert spec.verify_budget(four, {0: 4}) == {0: 4}  # four never timed: the shared (flat) times
    spec.observe_step(4, 1.0, num_seqs=4)
    spec.observe_step(5, 2.0, num_seqs=4)  # four sequences and one proposed id: twice the tick
    assert spec.verify_budget(four, {0: 4}) == {}
    assert spec.verify_budget([_running(0, 0.9, 0.9)], {0: 4}) == {0: 4}


def test_the_verify_budget_counts_what_a_draft_cache_must_catch_up():
    """A model slot's first draft id also costs its draft cache's catch-up (a new sequence's
    prompt, else the ids accepted since its last draft): free, as before; at a few steps' seconds
    none pays; counted once per slot, not per id; prompt lookup's ids never pay it."""
    spec = SpecDecoder("draft", 8, budgeted=True)
    for rows in range(1, MAX_VERIFY_ROWS + 1):
        spec.observe_step(rows, 1.0)

    def budget(offers, model_slots, catch_up):
        running = [_running(0, 0.9, 0.9), _running(1, 0.9, 0.9)]
        return spec.verify_budget(running, offers, model_slots, 0.1, catch_up)

    free = budget({0: 6}, {0}, {0: 0.0})
    assert free == budget({0: 6}, {0}, None) and free[0] > 0
    assert budget({0: 6}, {0}, {0: 5.0}) == {}
    some = budget({0: 6}, {0}, {0: 0.5})  # one id cannot repay it, several can: counted once
    assert some and some[0] >= 2
    assert budget({0: 6, 1: 6}, {1}, {1: 5.0}) == {0: 6}  # the lookup's ids pay no catch-up


def test_a_draft_model_prices_its_catch_up_by_the_ids_it_has_not_cached():
    """DraftModel.catch_up_seconds: the ids past its cached rows (all of them for a sequence it
    has not seen, at most MAX_CATCH_UP) beyond the one fed with the proposal, at the measured
    seconds per catch-up id; 0 while nothing is timed."""
    runner = DraftModel.__new__(DraftModel)
    runner.num_computed, runner.epochs, runner.fed = [0, 40], [-1, 3], [(0, []), (40, [])]
    runner.row_seconds = 0.0
    state = types.SimpleNamespace(tokens=np.zeros((2, 2048), dtype=np.int64), epochs=np.array([1, 3]))
    assert runner.catch_up_seconds(state, 0, 100) == 0.0
    runner.row_seconds = 0.01
    assert runner.catch_up_seconds(state, 0, 100) == pytest.approx(0.99)  # a new sequence: all of it
    assert runner.catch_up_seconds(state, 1, 41) == 0.0  # cached up to its last id
    assert runner.catch_up_seconds(state, 1, 50) == pytest.approx(0.09)
    assert runner.catch_up_seconds(state, 0, 2000) == pytest.approx((draft.MAX_CATCH_UP - 1) * 0.01)


def test_the_verify_budget_serves_the_likelier_sequence_first_and_recovers_the_refused():
    spec = SpecDecoder("ngram", 8, budgeted=True)
    spec.observe_step(4, 1.0)  # untimed rows scale from here as r + STEP_ROWS_PRIOR
    running = [_running(0, 0.3, 0.3), _running(1, 0.95, 0.95), _running(2, 0.5, 0.5), _running(3, 0.5, 0.5)]
    got = spec.verify_budget(running, {0: 4, 1: 4})
    assert got.get(1, 0) >= 2 and 0 not in got  # a row is worth ~0.16 of a step's 4 tokens here
    refused = running[0].spec
    before = refused.chances(2)
    for _ in range(200):
        spec.verify_budget(running, {0: 4})
    after = refused.chances(2)
    first, then = FIRST_PRIOR[0] / FIRST_PRIOR[1], NEXT_PRIOR[0] / NEXT_PRIOR[1]
    assert before[0] < after[0] <= first + 1e-9 and before[1] < after[1] <= first * then + 1e-9  # tried again
    assert spec.verify_budget(running, {}) == {}


def test_a_sequence_chances_follow_its_proposals():
    state = SpecDecoder("ngram", 8).make_state()
    first, after = FIRST_PRIOR[0] / FIRST_PRIOR[1], NEXT_PRIOR[0] / NEXT_PRIOR[1]
    assert state.chances(3) == pytest.approx([first, first * after, first * after ** 2])
    for _ in range(20):
        state.observe(4, 4)  # whole proposals: every id passed
    assert min(state.chances(4)) > 0.9
    for _ in range(20):
        state.observe(1, 4)  # the first id holds, the second fails
    first, second = state.chances(2)
    assert first > 0.95 and second < 0.05
    for _ in range(20):
        state.observe(0, 4)  # the first id fails every time
    assert state.chances(1)[0] < 0.05


def test_engine_output_equals_plain_decoding_with_the_verify_budget(tok):
    """The budget only trims proposals: the default engine (budget on, step times of this run)
    emits plain decoding's ids."""
    script = copying_script(tok)
    prompt = "Rename subtotal to base:\n" + CODE
    with make_engine(tok, script) as plain, make_engine(tok, script, speculative="ngram") as fast:
        fast._core.spec.budgeted = True
        for params in PARAMS:
            assert run(fast, prompt, params) == run(plain, prompt, params), params
        batch_plain = plain.generate([prompt, "x " + prompt, CODE], PARAMS[1])
        batch_fast = fast.generate([prompt, "x " + prompt, CODE], PARAMS[1])
        assert fast._core.spec.step_times.seconds.any()  # the engine timed its steps
    assert [c.token_ids for c in batch_fast] == [c.token_ids for c in batch_plain]


# -- the engine, with and without speculation --

@pytest.fixture(scope="module")
def tok():
    return engine.load_tokenizer(default_model_path())


CODE = "def total(items, rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item\n" \
       "    return subtotal * rate\n"


def make_engine(tok, script, **options):
    """speculative=None unless given: the plain engine the speculative ones are held equal to."""
    options.setdefault("speculative", None)
    options.setdefault("max_model_len", 2048)
    options.setdefault("kv_cache_tokens", 8192)
    return engine.Engine(ScriptedModel(script, tok.vocab_size), tok, **options)


def run(eng, prompt, params):
    """Per choice: (ids, text, finish reason, logprobs)."""
    events = list(eng.stream(prompt, params))
    out = []
    for index in range(params.n):
        mine = [e for e in events if e.index == index]
        logprobs = [(lp.token_id, lp.logprob, lp.top) for e in mine for lp in (e.logprobs or [])]
        out.append(([t for e in mine for t in e.token_ids], "".join(e.text for e in mine),
                    mine[-1].finish_reason, logprobs))
    return out


def copying_script(tok):
    """A script that copies the prompt with a few edits: proposals run, get cut and fail."""
    body = tok.encode(CODE, add_special_tokens=False)
    edited = tok.encode(CODE.replace("subtotal", "base"), add_special_tokens=False)
    return body + edited + body[:7] + [tok.eos_token_ids[0]] + body


PARAMS = [
    SamplingParams(max_tokens=200, temperature=0),
    SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=37, temperature=0, ignore_eos=True),  # max_tokens inside an accepted run
    SamplingParams(max_tokens=200, temperature=0, stop=["+= item"]),  # a stop string inside a run
    SamplingParams(max_tokens=200, temperature=0, stop=["* rate\ndef"], include_stop_str_in_output=True),
    SamplingParams(max_tokens=60, temperature=0, logprobs=True, top_logprobs=2),
    SamplingParams(max_tokens=60, temperature=0.8, seed=3),
    SamplingParams(max_tokens=60, temperature=0, repetition_penalty=1.3),
    SamplingParams(max_tokens=60, temperature=0, logit_bias={5: 30.0}, min_tokens=40),
    SamplingParams(max_tokens=60, temperature=0, n=2),
]


@pytest.mark.parametrize("k, adaptive", [(1, True), (4, True), (7, True), (16, True), (7, False)])
def test_engine_output_equals_plain_decoding(tok, k, adaptive):
    script = copying_script(tok)
    prompt = "Rename subtotal to base:\n" + CODE
    with make_engine(tok, script) as plain, make_engine(tok, script, speculative="ngram",
                                                        num_speculative_tokens=k) as fast:
        fast._core.spec.adaptive = adaptive
        for params in PARAMS:
            assert run(fast, prompt, params) == run(plain, prompt, params), params
        stats = fast.stats()
        batch_plain = plain.generate([prompt, "x " + prompt, CODE], PARAMS[1])
        batch_fast = fast.generate([prompt, "x " + prompt, CODE], PARAMS[1])
    assert [c.token_ids for c in batch_fast] == [c.token_ids for c in batch_plain]
    assert [c.text for c in batch_fast] == [c.text for c in batch_plain]
    assert stats["spec_decode_num_accepted_tokens"] > 0
    assert 0 < stats["spec_decode_acceptance_rate"] <= 1
    assert stats["spec_decode_num_accepted_tokens"] <= stats["spec_decode_num_draft_tokens"]
    assert plain.stats()["spec_decode_num_draft_tokens"] == 0


def test_every_kind_of_request_speculates(tok):
    script = copying_script(tok)
    with make_engine(tok, script, speculative="ngram") as eng:
        for params in PARAMS[5:]:
            before = eng.stats()["spec_decode_num_accepted_tokens"]
            events = list(eng.stream("Rename subtotal to base:\n" + CODE, params))
            assert eng.stats()["spec_decode_num_accepted_tokens"] > before, params
            if params.logprobs:  # one logprob entry per id, in every event
                assert all(len(e.logprobs) == len(e.token_ids) for e in events)


def test_auto_without_a_draft_model_is_prompt_lookup(tok):
    script = copying_script(tok)
    prompt = "Rename subtotal to base:\n" + CODE
    with make_engine(tok, script) as plain, make_engine(tok, script, speculative="auto") as auto:
        assert auto.config.speculative_method == "ngram"
        for params in PARAMS[:2]:
            assert run(auto, prompt, params) == run(plain, prompt, params), params
        assert auto.stats()["spec_decode_num_accepted_tokens"] > 0


def test_abort_mid_speculation_frees_blocks(tok):
    script = copying_script(tok) * 4
    with make_engine(tok, script, speculative="ngram") as eng:
        stream = eng.stream(CODE, SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
        seen = 0
        for event in stream:
            seen += len(event.token_ids)
            if seen > 30:
                eng.abort(event.request_id)
        assert event.finish_reason == "abort"
        assert run(eng, CODE, PARAMS[2])[0][2] == "length"  # the engine goes on
        assert eng.stats()["kv_usage"] == 0.0


def test_speculative_options_are_validated():
    with pytest.raises(InvalidParameterError, match="speculative='draft' needs draft_model"):
        EngineConfig(speculative="draft")
    with pytest.raises(InvalidParameterError, match="speculative must be None or one of"):
        EngineConfig(speculative="medusa")
    with pytest.raises(InvalidParameterError, match="num_speculative_tokens"):
        EngineConfig(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(InvalidParameterError, match="draft_model"):
        EngineConfig(speculative=None, draft_model="/tmp/x.gguf")
    assert EngineConfig().speculative == "auto" and EngineConfig().speculative_method == "ngram"
    assert EngineConfig(speculative=None).speculative_method is None  # off
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative", "ngram", "--num-speculative-tokens", "6"])
    assert engine_options_from_args(args) == {"speculative": "ngram", "num_speculative_tokens": 6}
    args = parser.parse_args(["--speculative", "draft", "--draft-model", "/m/draft.gguf"])
    assert engine_options_from_args(args) == {"speculative": "draft", "draft_model": "/m/draft.gguf"}
    args = parser.parse_args(["--speculative", "off"])
    assert engine_options_from_args(args) == {"speculative": None}
    assert "speculative" not in engine_options_from_args(parser.parse_args([]))  # the default: auto
