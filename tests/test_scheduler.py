"""Scheduler tests with a fake model loop: no torch model, 'sampled' ids are a function of the tokens.

The fake model keeps a KV cache of token ids: every row writes its token at its slot and
then checks that its sequence's block table reads back exactly the sequence's tokens for
every position it attends to. That catches wrong slots, leaked or shared-but-rewritten
blocks and bad prefix-cache hits. The Cython tick is compared tick by tick with the plain
reference in tests/sched_reference.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cext.tick import FinishCode
from engine.config import EngineConfig
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.sequence import Sequence, SequenceStatus
from engine.errors import InvalidParameterError, SchedulerRefused
from engine.params import SamplingParams
from tests.sched_reference import ReferenceScheduler, RefSeq

VOCAB = 50


def next_token(token_ids: list[int]) -> int:
    """The fake model's greedy choice: a function of the whole sequence so far."""
    return (sum(t * (i + 1) for i, t in enumerate(token_ids)) * 31 + len(token_ids)) % VOCAB


def solo_run(prompt: list[int], max_tokens: int, eos: int | None) -> list[int]:
    out = []
    toks = list(prompt)
    while len(out) < max_tokens:
        t = next_token(toks)
        out.append(t)
        toks.append(t)
        if t == eos:
            break
    return out


class FakeKV:
    def __init__(self, num_blocks: int, block_size: int):
        self.tokens = np.full(num_blocks * block_size, -1, dtype=np.int64)

    def forward(self, out) -> None:
        b = out.batch
        assert b.input_ids.dtype == torch.int64 and b.block_tables.dtype == torch.int64
        self.tokens[b.slot_mapping.numpy()] = b.input_ids.numpy()
        qs = b.query_starts_list
        assert qs == b.query_starts.tolist() and b.context_lens_list == b.context_lens.tolist()
        bs = b.block_size
        for i, seq in enumerate(out.seqs):
            ctx = b.context_lens_list[i]
            pos = np.arange(ctx)
            table = b.block_tables[i].numpy()
            assert (table[: -(-ctx // bs)] >= 0).all() and (table[-(-ctx // bs) :] == -1).all()
            slots = table[pos // bs] * bs + pos % bs
            np.testing.assert_array_equal(self.tokens[slots], seq.token_array[:ctx])
            rows = b.positions[qs[i] : qs[i + 1]].numpy()
            np.testing.assert_array_equal(rows, np.arange(ctx - (qs[i + 1] - qs[i]), ctx))
            assert b.prompt_lens[i].item() == seq.num_prompt_tokens


requests = st.lists(
    st.tuples(
        st.integers(0, 12),  # arrival tick
        st.integers(1, 40),  # prompt length
        st.integers(1, 12),  # max_tokens
        st.integers(0, 2),  # shared prefix: none, short, long
        st.booleans(),  # wants prompt logprobs
        st.one_of(st.none(), st.integers(0, 30)),  # abort at tick
        st.integers(0, 10**6),  # content seed
    ),
    min_size=1,
    max_size=12,
)


def run_workload(reqs, max_num_seqs, budget, num_blocks, block_size, caching, eos=None, prefill_budgets=None):
    cfg = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        num_blocks=num_blocks,
        max_model_len=64,
        block_size=block_size,
        enable_prefix_caching=caching,
        target_tick_seconds=None,
    )
    sched = Scheduler(cfg)
    ref = ReferenceScheduler(max_num_seqs, budget, num_blocks, block_size, caching)
    kv = FakeKV(num_blocks, block_size)
    shared = [list(np.random.default_rng(seed).integers(0, VOCAB, 40)) for seed in (7, 8)]
    seqs: dict[str, Sequence] = {}
    expected: dict[str, list[int]] = {}
    arrivals: list[str] = []
    first_admitted: list[str] = []
    logprob_positions: dict[str, list[int]] = {}
    aborted = set()
    pending = sorted(enumerate(reqs), key=lambda x: x[1][0])
    tick = 0
    while pending or sched.has_work():
        for idx, (arrive, n, max_tokens, prefix, plp, abort_at, seed) in [p for p in pending if p[1][0] <= tick]:
            pending.remove((idx, (arrive, n, max_tokens, prefix, plp, abort_at, seed)))
            rng = np.random.default_rng(seed)
            prompt = [int(x) for x in rng.integers(0, VOCAB, n)]
            if prefix:
                k = min(n - 1, 8 if prefix == 1 else 33)
                prompt[:k] = shared[prefix - 1][:k]
            max_tokens = min(max_tokens, cfg.max_model_len - n)
            rid = f"r{idx}"
            seq = Sequence(rid, prompt, max_tokens, num_prompt_logprobs=1 if plp else None,
                           stop_ids=() if eos is None else (eos,))
            if -(-(n + max_tokens) // block_size) > num_blocks:
                with pytest.raises(SchedulerRefused, match="KV blocks"):
                    sched.add(seq)
                continue
            sched.add(seq)
            ref.add(RefSeq(rid, prompt, max_tokens, 1 if plp else None))
            seqs[rid] = seq
            expected[rid] = solo_run(prompt, max_tokens, eos)
            arrivals.append(rid)
            logprob_positions[rid] = []
        for rid, seq in list(seqs.items()):
            abort_at = reqs[int(rid[1:])][5]
            if abort_at == tick and seq.status is not SequenceStatus.FINISHED:
                assert sched.abort(rid) is seq and seq.status is SequenceStatus.FINISHED
                assert ref.remove(rid) is not None
                aborted.add(rid)
        prefill_budget = None
        if prefill_budgets:  # stand-in for the time-target budget, shared with the reference
            prefill_budget = prefill_budgets[tick % len(prefill_budgets)]
            sched.prefill_budget = lambda b=prefill_budget: b
        out = sched.schedule()
        ref_tick = ref.schedule(prefill_budget)
        tick += 1
        if out is None:
            assert ref_tick is None
            assert not sched.has_work() or pending, "work left but nothing scheduled"
            continue
        b = out.batch
        # The budget and the slots are never exceeded; decodes come first.
        assert b.num_tokens <= budget and b.num_seqs <= max_num_seqs
        assert all(b.query_starts_list[i + 1] - b.query_starts_list[i] == 1 for i in range(b.num_decode_seqs))
        for s in out.seqs:
            if s.request_id not in first_admitted:
                first_admitted.append(s.request_id)
        for s in out.preempted:
            assert s.status is SequenceStatus.WAITING and s.block_ids == [] and s.num_computed_tokens == 0
        got = dict(
            request_ids=[s.request_id for s in out.seqs],
            input_ids=b.input_ids.tolist(),
            positions=b.positions.tolist(),
            slot_mapping=b.slot_mapping.tolist(),
            query_starts=b.query_starts_list,
            context_lens=b.context_lens_list,
            block_tables=b.block_tables.tolist(),
            logit_rows=b.logit_rows.tolist(),
            sample_ids=[s.request_id for s in out.sample_seqs],
            sample_logit_index=out.sample_logit_index,
            spans=[(s.request_id, f, c, p) for s, f, c, p in out.prompt_logprob_spans],
            preempted=[s.request_id for s in out.preempted],
            num_decode_seqs=b.num_decode_seqs,
        )
        assert got == ref_tick, f"tick {tick}"
        kv.forward(out)
        rows = b.logit_rows.tolist()
        for seq, first, count, pos in out.prompt_logprob_spans:
            for j in range(count):
                assert b.positions[rows[first + j]].item() == pos + j
                assert b.input_ids[rows[first + j]].item() == seq.token_ids[pos + j]
            logprob_positions[seq.request_id].extend(range(pos, pos + count))
        for seq, li in zip(out.sample_seqs, out.sample_logit_index):
            assert b.positions[rows[li]].item() == seq.num_tokens - 1
        sampled = [next_token(s.token_ids) for s in out.sample_seqs]
        sched.update(out, sampled)
        ref.update(sampled)
        if out.is_decode_only:  # the tick's finish verdicts against this test's own rule
            verdicts = [FinishCode.FINISH_STOP_ID if s.output_token_ids[-1] == eos else FinishCode.FINISH_LENGTH
                        if s.num_generated >= s.max_tokens else FinishCode.FINISH_NONE for s in out.sample_seqs]
            assert sched.state.finish_codes[:len(verdicts)].tolist() == verdicts
        for s in out.sample_seqs:
            done = s.num_generated >= s.max_tokens or s.output_token_ids[-1] == eos
            if s.status is SequenceStatus.RUNNING and done:
                sched.finish(s)
                ref.remove(s.request_id)
        table_refs: dict[int, int] = {}
        for s in sched.running:
            for blk in s.block_ids:
                table_refs[blk] = table_refs.get(blk, 0) + 1
        sched.block_manager.check_invariants(table_refs)
        assert tick < 2000, "no progress"
    # Every request finished or was aborted; nothing leaked.
    assert sched.num_running == 0 and sched.num_waiting == 0
    assert sched.num_free_blocks == num_blocks and sched.kv_usage() == 0.0
    for rid, seq in seqs.items():
        assert seq.status is SequenceStatus.FINISHED
        if rid not in aborted:
            assert seq.output_token_ids == expected[rid], rid
            assert seq.token_ids == seq.prompt_token_ids + expected[rid]
            if seq.num_prompt_logprobs is not None:
                assert logprob_positions[rid] == list(range(seq.num_prompt_tokens - 1))
    # FIFO admission: requests are first admitted in arrival order.
    assert [r for r in first_admitted] == [r for r in arrivals if r in first_admitted]
    return sched


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=requests,
    max_num_seqs=st.integers(1, 5),
    extra_budget=st.integers(0, 40),
    num_blocks=st.integers(4, 40),
    block_size=st.sampled_from([1, 2, 4, 16]),
    caching=st.booleans(),
    eos=st.one_of(st.none(), st.integers(0, VOCAB - 1)),
    prefill_budgets=st.one_of(st.none(), st.lists(st.integers(1, 30), min_size=1, max_size=5)),
)
def test_random_workloads(reqs, max_num_seqs, extra_budget, num_blocks, block_size, caching, eos, prefill_budgets):
    run_workload(reqs, max_num_seqs, max_num_seqs + extra_budget, num_blocks, block_size, caching, eos, prefill_budgets)


def test_tiny_cache_preempts_and_finishes():
    reqs = [(0, 10, 12, 0, False, None, i) for i in range(6)]
    sched = run_workload(reqs, max_num_seqs=4, budget=16, num_blocks=8, block_size=4, caching=False)
    assert sched.num_preemptions > 0 and sched.num_decode_ticks > 0


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_steady_state_ticks_take_the_decode_path_and_match_the_reference(block_size):
    # Staggered arrivals and lengths: steady stretches (a new block every block_size tokens, finishes by
    # max_tokens and by EOS, an abort) between admissions, every tick held to the reference.
    reqs = [(3 * i, 5 + 7 * i, 12 - i, i % 3, False, 20 if i == 2 else None, i) for i in range(5)]
    sched = run_workload(reqs, max_num_seqs=4, budget=16, num_blocks=64, block_size=block_size, caching=True,
                         eos=3)
    assert sched.num_decode_ticks >= 10


def test_decode_ticks_reuse_one_output_while_the_running_set_stays():
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, num_blocks=32, max_model_len=64, block_size=4,
                          target_tick_seconds=None)
    sched = Scheduler(cfg)
    for rid in "ab":
        sched.add(Sequence(rid, [1, 2, 3], 20, stop_ids=(7,)))
    out = sched.schedule()
    sched.update(out, [5, 6])
    assert not out.is_decode_only
    outs = []
    for _ in range(6):  # positions 3..8: a new block at position 4 and 8 (width 2 then 3)
        out = sched.schedule()
        outs.append(out)
        assert out.is_decode_only and out.batch.context_lens_list == [out.batch.positions[0].item() + 1] * 2
        sched.update(out, [5, 5])
    assert outs[1] is outs[2] is outs[3] is outs[4] and outs[0] is not outs[1] and outs[5] is not outs[4]
    out = sched.schedule()
    sched.update(out, [7, 5])  # a stop id for a, nothing for b
    assert sched.state.finish_codes[:2].tolist() == [FinishCode.FINISH_STOP_ID, FinishCode.FINISH_NONE]
    sched.finish(sched.running[0])
    out2 = sched.schedule()
    assert out2 is not out and out2.is_decode_only and [s.request_id for s in out2.seqs] == ["b"]


def test_prefix_cache_hits_skip_computation():
    # Same 33-token prefix, long budget: later requests reuse the first one's full blocks.
    reqs = [(0, 40, 4, 2, False, None, 1)] + [(5 + i, 40, 4, 2, False, None, 2 + i) for i in range(3)]
    sched = run_workload(reqs, max_num_seqs=4, budget=64, num_blocks=64, block_size=4, caching=True)
    assert sched.block_manager.num_cached_blocks >= 8


def test_prefix_hit_counts_and_prompt_logprobs_do_not_reuse():
    cfg = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, num_blocks=32, max_model_len=64, block_size=4,
        target_tick_seconds=None,
    )
    sched = Scheduler(cfg)
    prompt = list(range(1, 19))  # 18 tokens: 4 full blocks
    first = Sequence("a", prompt, 2)
    sched.add(first)
    out = sched.schedule()
    sched.update(out, [5])
    hit = Sequence("b", prompt, 2)
    whole = Sequence("c", prompt[:16], 2)  # exactly 4 blocks: the last token is still computed
    no_reuse = Sequence("d", prompt, 2, num_prompt_logprobs=0)
    for s in (hit, whole, no_reuse):
        sched.add(s)
    out = sched.schedule()
    assert [s.request_id for s in out.seqs] == ["a", "b", "c", "d"]
    assert hit.num_cached_tokens == 16 and whole.num_cached_tokens == 12 and no_reuse.num_cached_tokens == 0
    assert hit.block_ids[:4] == first.block_ids[:4] and whole.block_ids[:3] == first.block_ids[:3]
    assert whole.block_ids[3] != first.block_ids[3] and not set(no_reuse.block_ids) & set(first.block_ids)
    assert out.batch.query_starts_list == [0, 1, 3, 7, 25]
    assert [p for _, _, _, p in out.prompt_logprob_spans] == [0]
    assert out.prompt_logprob_spans[0][2] == 17


def test_long_prompt_spreads_over_ticks():
    cfg = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=16, num_blocks=64, max_model_len=256, block_size=4,
        target_tick_seconds=None,
    )
    sched = Scheduler(cfg)
    decoders = [Sequence(f"d{i}", [1, 2], 50) for i in range(3)]
    for s in decoders:
        sched.add(s)
    out = sched.schedule()
    sched.update(out, [3, 3, 3])
    long = Sequence("long", list(range(100)), 4)
    sched.add(long)
    num_ticks = 0
    while long.num_generated == 0:
        out = sched.schedule()
        assert out.batch.num_decode_seqs == 3 and out.batch.num_tokens <= 16
        assert out.seqs[-1] is long
        sched.update(out, [7] * len(out.sample_seqs))
        num_ticks += 1
    assert num_ticks == -(-100 // 13)


def test_validation_errors_name_the_field():
    # Engine options are validated once, by EngineConfig (SchedulerConfig is derived from it).
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig(max_num_seqs=1, max_num_batched_tokens=8, block_size=0)
    # A request's values are checked once, where they enter: max_tokens by SamplingParams, the
    # prompt's ids and its context length by Request.create (tests/test_engine.py); Sequence trusts
    # them. The scheduler refuses, with its own type, only what its buffers cannot hold.
    with pytest.raises(InvalidParameterError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, num_blocks=4, max_model_len=16,
                                      block_size=4))
    with pytest.raises(SchedulerRefused, match="max_model_len"):
        sched.add(Sequence("x", [1] * 10, 7))
    with pytest.raises(SchedulerRefused, match="kv_cache_tokens"):
        Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=8, num_blocks=2, max_model_len=16,
                                  block_size=4)).add(Sequence("y", [1] * 8, 2))
    sched.add(Sequence("x", [1] * 4, 2))
    with pytest.raises(SchedulerRefused, match="already") as info:
        sched.add(Sequence("x", [1] * 4, 2))
    assert info.value.param == "request_id"


def test_abort_everywhere_and_interface():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=8, num_blocks=16, max_model_len=32, block_size=4)
    sched = Scheduler(cfg)
    a, b = Sequence("a", [1, 2, 3], 4), Sequence("b", [4, 5], 4)
    sched.add(a)
    sched.add(b)
    assert sched.num_waiting == 2 and sched.has_work() and sched.abort("nope") is None
    out = sched.schedule()
    assert out.seqs == [a] and sched.num_running == 1 and sched.kv_usage() > 0
    assert a.status is SequenceStatus.RUNNING and len(a.block_ids) == 1
    assert sched.abort("b") is b and sched.num_waiting == 0
    # Aborted between schedule and update: update must not touch the freed slot.
    assert sched.abort("a") is a and a.block_ids == []
    sched.update(out, [9])
    assert a.output_token_ids == [] and a.token_ids == [1, 2, 3]
    assert not sched.has_work() and sched.schedule() is None and sched.num_free_blocks == 16
    c = Sequence("c", [1, 2, 3], 2)
    c.append(8)
    assert c.token_ids == [1, 2, 3, 8] and c.num_generated == 1 and c.output_token_ids == [8]


def test_short_request_starts_during_a_long_prefill():
    cfg = SchedulerConfig(
        max_num_seqs=4, max_num_batched_tokens=64, num_blocks=64, max_model_len=512, block_size=4,
        target_tick_seconds=None,
    )
    sched = Scheduler(cfg)
    long = Sequence("long", list(range(200)), 2)
    sched.add(long)
    out = sched.schedule()
    assert out.batch.num_tokens == 64  # alone: the whole budget
    sched.update(out, [])
    short = Sequence("short", [5, 6, 7, 8, 9], 2)
    sched.add(short)
    out = sched.schedule()  # the long chunk leaves half the budget to the waiting request
    assert [s.request_id for s in out.seqs] == ["long", "short"]
    assert out.batch.query_starts_list == [0, 59, 64] and out.sample_seqs == [short]  # unused reserve returned
    sched.update(out, [1])
    out = sched.schedule()  # nobody waits: the long prefill takes the budget back
    assert out.batch.query_starts_list == [0, 1, 64] and out.seqs == [short, long]
    sched.update(out, [1])
    # Nothing admissible (no free slot): the reserve goes back to the chunk (top-up).
    full = Scheduler(
        SchedulerConfig(
            max_num_seqs=1, max_num_batched_tokens=64, num_blocks=64, max_model_len=512, block_size=4,
            target_tick_seconds=None,
        )
    )
    full.add(Sequence("a", list(range(200)), 2))
    full.add(Sequence("b", [1, 2], 2))
    assert full.schedule().batch.num_tokens == 64


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_prefill_budget_adapts_to_the_time_target():
    clock = FakeClock()
    cfg = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=512, num_blocks=1024, max_model_len=4096, block_size=16,
        target_tick_seconds=0.5,
    )
    sched = Scheduler(cfg, clock=clock)
    for i in range(4):
        sched.add(Sequence(f"d{i}", [1, 2, 3], 1000))
    long = Sequence("long", list(range(3000)), 2)
    sched.add(long)

    def cost(out):  # the simulated forward: 0.1 s per tick + 2 ms per prefill token
        b = out.batch
        return 0.1 + 0.002 * (b.num_tokens - b.num_decode_seqs)

    assert sched.prefill_budget() == 64  # nothing timed yet
    ticks = []
    while long.num_generated == 0:
        out = sched.schedule()
        clock.now += cost(out)
        ticks.append(cost(out))
        sched.update(out, [1] * len(out.sample_seqs))
    # The estimate converges: after a few ticks every tick fits the target (0.1 + 0.002 * 200 = 0.5).
    assert max(ticks[4:]) <= 0.52 and max(ticks[6:]) >= 0.45
    assert 120 <= sched.prefill_budget() <= 200
    # Decode-only ticks teach the fixed cost; the prefill budget then uses it.
    before = sched.prefill_budget()
    for _ in range(6):
        out = sched.schedule()
        clock.now += cost(out)
        sched.update(out, [1] * len(out.sample_seqs))
    assert 0.09 < sched.cost.sec_per_decode_tick <= 0.1 and sched.prefill_budget() < before
    with pytest.raises(ValueError, match="target_tick_seconds"):
        EngineConfig(max_num_seqs=1, max_num_batched_tokens=8, target_tick_seconds=0)


def test_prefill_keeps_a_share_when_decodes_alone_exceed_the_target():
    clock = FakeClock()
    cfg = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=512, num_blocks=512, max_model_len=2048, block_size=16,
        target_tick_seconds=0.3,
    )
    sched = Scheduler(cfg, clock=clock)
    sched.add(Sequence("d", [1, 2], 1000))
    for _ in range(8):  # decode-only ticks of 0.6 s: over the target on their own
        out = sched.schedule()
        clock.now += 0.6 if out.batch.num_tokens == out.batch.num_decode_seqs else 0.6 + 0.01 * out.batch.num_tokens
        sched.update(out, [1] * len(out.sample_seqs))
    sched.add(Sequence("long", list(range(1000)), 2))
    for _ in range(12):
        out = sched.schedule()
        clock.now += 0.6 + 0.01 * (out.batch.num_tokens - out.batch.num_decode_seqs)
        sched.update(out, [1] * len(out.sample_seqs))
    # 0.01 s per token, 0.6 s of decodes: a quarter of the tick is 20 tokens (0.2 / 0.01).
    assert 17 <= sched.prefill_budget() <= 20
    # A prompt that fits the hard budget is admitted whole past the time target: it is done in one tick.
    sched.add(Sequence("short", list(range(5000, 5300)), 2))
    out = sched.schedule()
    assert (out.seqs[-1].request_id == "short"
            and out.batch.query_starts_list[-1] - out.batch.query_starts_list[-2] == 300)
