"""Speculative decoding (n-gram): the proposer against a brute-force scan, KV rollback against the
block manager's invariants, and engine output with speculation equal to plain decoding
(ScriptedModel scripts that copy the prompt, so proposals are accepted, cut and rejected)."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine
from engine.config import EngineConfig, add_engine_arguments, engine_options_from_args
from engine.core.draft import DraftModel
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.sequence import Sequence
from engine.core.speculative import FIRST_LIMIT, MAX_VERIFY_ROWS, NgramProposer, SpecDecoder, SpecEntry
from engine.errors import InvalidParameterError
from engine.loader import default_model_path
from engine.params import SamplingParams
from engine.testing import ScriptedModel


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


@pytest.mark.parametrize("num_seqs", [1, 4, 12, 15, 16, 20])
def test_a_tick_verifies_at_most_max_verify_rows(num_seqs):
    """Proposals are cut so that a tick's rows (one per decoding sequence plus every proposed id)
    stay within MAX_VERIFY_ROWS; from that many sequences on, the tick decodes plainly."""
    cfg = SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=1024, num_blocks=512, max_model_len=128,
                          block_size=4, target_tick_seconds=None)
    sched = Scheduler(cfg)
    spec = sched.spec = SpecDecoder("ngram", 8)
    for i in range(num_seqs):
        seq = Sequence(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8, 9] * 3 + [1, 2, 3], 40)
        seq.spec = spec.make_state()
        seq.spec.limit = 8
        sched.add(seq)
    out = sched.schedule()  # the prompts, in one tick
    sched.update(out, [4] * num_seqs)
    out = sched.schedule()
    proposed = sum(len(entry.draft) for entry, _k, _first in out.spec_entries)
    if num_seqs >= MAX_VERIFY_ROWS:
        assert proposed == 0
    else:  # every sequence's prompt repeats: the rows left are all used, and no more
        assert proposed == min(8 * num_seqs, MAX_VERIFY_ROWS - num_seqs)
        assert num_seqs + proposed <= MAX_VERIFY_ROWS


@pytest.mark.parametrize("num_seqs", [1, 3, 12, 15, 16])
def test_the_draft_model_is_asked_for_no_more_ids_than_a_tick_verifies(num_seqs):
    """A draft id costs a row of every draft forward: the draft is asked for at most the rows a
    tick has left (MAX_VERIFY_ROWS less one per decoding sequence), first come first served, and
    the tick verifies all it proposed."""
    cfg = SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=1024, num_blocks=512, max_model_len=128,
                          block_size=4, target_tick_seconds=None)
    sched = Scheduler(cfg)
    draft = DraftModel(ScriptedModel([7, 8, 9], 64), 512, 4, 24, 128)
    asked = []
    propose = draft.propose
    draft.propose = lambda state, wants: asked.append(list(wants)) or propose(state, wants)
    spec = sched.spec = SpecDecoder("draft", 8, draft=draft)
    for i in range(num_seqs):
        seq = Sequence(f"r{i}", [1, 2, 3, 4, 5], 40)
        seq.spec = spec.make_state()
        seq.spec.limit = 8
        sched.add(seq)
    out = sched.schedule()  # the prompts, in one tick
    sched.update(out, [4] * num_seqs)
    out = sched.schedule()
    proposed = sum(len(entry.draft) for entry, _k, _first in out.spec_entries)
    rows_left = max(0, MAX_VERIFY_ROWS - num_seqs)
    wanted = sum(k for _slot, _n, k, _p in asked[0]) if asked else 0
    assert wanted == proposed == min(8 * num_seqs, rows_left)
    assert [k for _slot, _n, k, _p in asked[0]] == [min(8, rows_left - 8 * i) for i in range(len(asked[0]))] \
        if asked else rows_left == 0


# -- the engine, with and without speculation --

@pytest.fixture(scope="module")
def tok():
    return engine.load_tokenizer(default_model_path())


CODE = "def total(items, rate):\n    subtotal = 0\n    for item in items:\n        subtotal += item\n" \
       "    return subtotal * rate\n"


def make_engine(tok, script, **options):
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
        EngineConfig(draft_model="/tmp/x.gguf")
    import argparse
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--speculative", "ngram", "--num-speculative-tokens", "6"])
    assert engine_options_from_args(args) == {"speculative": "ngram", "num_speculative_tokens": 6}
    args = parser.parse_args(["--speculative", "draft", "--draft-model", "/m/draft.gguf"])
    assert engine_options_from_args(args) == {"speculative": "draft", "draft_model": "/m/draft.gguf"}
