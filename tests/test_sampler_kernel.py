"""The sampler kernel (cext.sampler through engine.sampling) against the plain NumPy definitions
in tests/sampling_reference.py: the same uniform from the same stream must pick the same token,
except where float32 rounding in the kernel can decide (a mask threshold or a CDF boundary
within 1e-4 of the draw), which the property test recognises and leaves out."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine.params import SamplingParams
from engine.sampling.sampler import RandomStream, prompt_logprobs, sample
from tests.sampling_reference import draw, logprob_row, weights

SLACK = 1e-4


@pytest.mark.parametrize("seed", [0, 1, 1234, 2**32 + 5, 2**63 + 7, -3 % 2**64])
def test_random_stream_is_torchs_generator(seed):
    gen = torch.Generator().manual_seed(seed)
    stream = RandomStream(seed)
    assert [stream.random() for _ in range(700)] == [
        float(torch.rand((), dtype=torch.float64, generator=gen)) for _ in range(700)]


def _is_borderline(row: np.ndarray, params: SamplingParams, u: float) -> bool:
    """True when a mask or the draw is within SLACK of its threshold under exact arithmetic."""
    scaled = row.astype(np.float64) / params.temperature
    probs = np.exp(scaled - scaled.max())
    if params.min_p > 0 and np.any(np.abs(probs - params.min_p) < SLACK * params.min_p):
        return True
    kept = weights(row, params)
    if params.top_k and params.top_k < row.shape[0]:
        # The kernel keeps exactly k ids by logit (ties: lower id); the reference keeps every id
        # whose weight ties the k-th (e.g. logits 0 and -1e-45, weight 1 in both): ambiguous.
        by_prob = np.sort(probs)[::-1]
        if abs(by_prob[params.top_k - 1] - by_prob[params.top_k]) < SLACK * by_prob[0]:
            return True
    if params.top_p < 1.0:
        before_top_p = probs.copy()
        if params.min_p > 0:
            before_top_p[before_top_p < params.min_p] = 0.0
        if params.top_k and params.top_k < row.shape[0]:
            kth = np.partition(before_top_p, -params.top_k)[-params.top_k]
            before_top_p[before_top_p < kth] = 0.0
        order = np.argsort(-before_top_p, kind="stable")
        sorted_probs = before_top_p[order]
        cum_before = np.cumsum(sorted_probs) - sorted_probs
        limit = params.top_p * sorted_probs.sum()
        if np.any(np.abs(cum_before[sorted_probs > 0] - limit) < SLACK * sorted_probs.sum()):
            return True
        # Distinct logits whose weights differ by less than float32 can tell (e.g. 0 and 2e-16):
        # the kernel's weights tie and it keeps the lower id first, exact arithmetic does not.
        positive = sorted_probs[sorted_probs > 0]
        gaps = positive[:-1] - positive[1:]
        if np.any((gaps > 0) & (gaps < SLACK * positive[0])):
            return True
    cdf = np.cumsum(kept)
    return bool(np.any(np.abs(cdf - u * cdf[-1]) < SLACK * cdf[-1]))


logit_rows = st.lists(st.floats(-20, 20, width=32), min_size=2, max_size=64).map(
    lambda v: np.array(v, dtype=np.float32))
random_params = st.builds(
    SamplingParams,
    temperature=st.floats(0.1, 4.0),
    top_k=st.integers(0, 70),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)),
    seed=st.integers(0, 2**64 - 1),
)


@settings(max_examples=400, deadline=None)
@given(row=logit_rows, params=random_params)
def test_random_choice_matches_the_reference(row, params):
    assume(not params.is_greedy)
    u = RandomStream(params.seed).random()
    assume(not _is_borderline(row, params, u))
    ids, _ = sample(torch.from_numpy(row.copy())[None], [params], [RandomStream(params.seed)])
    assert ids[0] == draw(weights(row, params), u)


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(logit_rows.filter(lambda r: r.shape[0] == 24).map(lambda r: r), min_size=1, max_size=6)
       | st.integers(1, 6).map(lambda n: [np.random.default_rng(n).standard_normal(24).astype(np.float32)] * n),
       data=st.data())
def test_each_row_of_a_batch_draws_from_its_own_stream(rows, data):
    logits = np.stack(rows)  # [R, 24]
    params = [data.draw(random_params) for _ in rows]
    streams = [None if p.is_greedy else RandomStream(p.seed) for p in params]
    ids, _ = sample(torch.from_numpy(logits.copy()), params, streams)
    for row, p, token_id in zip(logits, params, ids):
        if p.is_greedy:
            assert token_id == int(np.argmax(row))
            continue
        u = RandomStream(p.seed).random()
        if not _is_borderline(row, p, u):
            assert token_id == draw(weights(row, p), u)


def test_greedy_takes_the_first_maximum_and_survives_an_all_masked_row():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [-np.inf] * 4, [0.0, -1.0, 5.0, 5.0]])
    ids, _ = sample(logits, [SamplingParams(temperature=0)] * 3, [None] * 3)
    assert ids == [1, 0, 2]
    random = SamplingParams(temperature=1.0, top_p=0.5, top_k=2, min_p=0.1)
    ids, _ = sample(torch.full((1, 4), -np.inf), [random], [RandomStream(0)])
    assert ids == [0]


@pytest.mark.parametrize("vocab", [5, 63, 64, 65, 1000, 49152])
def test_logprobs_rank_and_top_match_the_reference(vocab):
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((3, vocab)) * 3).astype(np.float32)
    k = min(5, vocab)
    params = [SamplingParams(temperature=t, logprobs=True, top_logprobs=k, seed=1) for t in (0, 0.7, 2.0)]
    streams = [None, RandomStream(1), RandomStream(2)]
    ids, rows = sample(torch.from_numpy(logits.copy()), params, streams)
    for row, token_id, lp in zip(logits, ids, rows):
        logprob, rank, top_ids, top_logprobs = logprob_row(row, token_id, k)
        assert lp.logprob == pytest.approx(logprob, abs=1e-5)
        assert lp.rank == rank
        assert lp.top_ids == top_ids
        np.testing.assert_allclose(lp.top_logprobs, top_logprobs, atol=1e-5)
    assert rows[0].rank == 1  # greedy took the best


def test_rank_counts_ties_and_prompt_logprobs_carry_ranks():
    logits = torch.tensor([[2.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    rows = prompt_logprobs(logits, [1, 0], k=2)
    assert [r.rank for r in rows] == [2, 4]  # vLLM's rank: ids with logprob >= the token's
    assert rows[0].top_ids == [0, 1] and rows[1].top_ids == [3, 2]
    ref = torch.log_softmax(logits, dim=-1)
    assert rows[1].logprob == pytest.approx(ref[1, 0].item(), abs=1e-6)


def test_out_of_vocabulary_ids_raise_instead_of_writing_outside_the_row():
    from engine.sampling.logits_process import LogitsAdjuster
    params = SamplingParams(temperature=0, logit_bias={10: 1.0})
    adjuster = LogitsAdjuster.for_request(params, [1], (), 4)
    with pytest.raises(IndexError, match="outside the vocabulary"):
        sample(torch.zeros(1, 8), [params], [None], [adjuster])
    with pytest.raises(IndexError, match="outside the vocabulary"):
        prompt_logprobs(torch.zeros(1, 8), [8], k=1)


@settings(max_examples=150, deadline=None)
@given(data=st.data(), num_rows=st.integers(1, 4))
def test_processing_then_choice_matches_the_reference_over_many_blocks(data, num_rows):
    # vocab 300: several blocks of the kernel's block maxima, which the processing must keep exact
    # (a penalty or mask that lowers a block's max, a bias that raises one).
    from engine.sampling.logits_process import LogitsAdjuster, adjust
    vocab = 300
    ids = st.integers(0, vocab - 1)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    logits = (rng.standard_normal((num_rows, vocab)) * 3).astype(np.float32)  # distinct values: one max per block
    params, adjusters, streams = [], [], []
    for row in range(num_rows):
        top = [int(i) for i in np.argsort(-logits[row])[:3]]  # aim the options at the leaders
        options = data.draw(st.fixed_dictionaries({}, optional={
            "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(0, 2),
            "repetition_penalty": st.floats(0.5, 3),
            "logit_bias": st.dictionaries(st.sampled_from(top) | ids, st.floats(-100, 100), max_size=4),
            "allowed_token_ids": st.lists(ids, min_size=1, max_size=5)}))
        p = data.draw(st.builds(SamplingParams, max_tokens=st.just(50), temperature=st.sampled_from([0, 0.5, 1.5]),
                                top_k=st.integers(0, 20), min_p=st.sampled_from([0.0, 0.1]),
                                seed=st.integers(0, 2**32), **{k: st.just(v) for k, v in options.items()}))
        a = LogitsAdjuster.for_request(p, data.draw(st.lists(st.sampled_from(top) | ids, max_size=8)), (), 50)
        for t in data.draw(st.lists(st.sampled_from(top) | ids, max_size=8)):
            if a is not None:
                a.add(t)
        params.append(p)
        adjusters.append(a)
        streams.append(None if p.is_greedy else RandomStream(p.seed))
    expected = logits.copy()
    adjust(expected, adjusters)
    got_ids, _ = sample(torch.from_numpy(logits.copy()), params, streams, adjusters)
    for row, (p, token_id) in enumerate(zip(params, got_ids)):
        if p.is_greedy:
            assert token_id == int(np.argmax(expected[row]))
        else:
            u = RandomStream(p.seed).random()
            if np.isfinite(expected[row]).any() and not _is_borderline(expected[row], p, u):
                assert token_id == draw(weights(expected[row], p), u)


@pytest.fixture(params=["avx2", "portable"])
def sampler_path(request):
    """Both implementations of the sampler's row passes on this machine (AVX2 when it has it),
    chosen through cext.cpu's one instruction-set switch."""
    from cext import cpu
    if request.param == "avx2" and "avx2" not in cpu.features():
        pytest.skip("CPU lacks AVX2")  # the portable run below still covers the logic
    cpu.set_isa("auto" if request.param == "avx2" else "baseline")
    yield request.param
    cpu.set_isa("auto")


long_rows = st.tuples(st.integers(450, 2200), st.integers(0, 2**32 - 1), st.sampled_from([0.5, 3.0, 12.0])).map(
    lambda t: (np.random.default_rng(t[1]).standard_normal(t[0]) * t[2]).astype(np.float32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(row=long_rows, params=random_params, data=st.data())
def test_long_rows_match_the_reference_on_both_paths(sampler_path, row, params, data):
    # Rows of several groups of 8 blocks (the AVX2 passes work on 8 block maxima at once) and a
    # ragged tail: block maxima, the top-k heap's masked scan, the min-p candidate scan and the
    # dense exp pass, against the NumPy definitions.
    if data.draw(st.booleans()):  # ties and -inf holes
        row[data.draw(st.lists(st.integers(0, row.shape[0] - 1), max_size=40))] = -np.inf
        row[data.draw(st.integers(0, row.shape[0] - 1))] = row.max()
    greedy_ids, _ = sample(torch.from_numpy(row.copy())[None], [SamplingParams(temperature=0)], [None])
    assert greedy_ids[0] == int(np.argmax(row))
    if params.is_greedy:
        return
    u = RandomStream(params.seed).random()
    assume(not _is_borderline(row, params, u))
    ids, _ = sample(torch.from_numpy(row.copy())[None], [params], [RandomStream(params.seed)])
    assert ids[0] == draw(weights(row, params), u)


@pytest.mark.parametrize("vocab", [511, 512, 4099])
def test_long_row_logprobs_match_the_reference_on_both_paths(sampler_path, vocab):
    rng = np.random.default_rng(vocab)
    logits = (rng.standard_normal((2, vocab)) * 4).astype(np.float32)
    logits[1, ::7] = -np.inf
    params = [SamplingParams(temperature=t, logprobs=True, top_logprobs=20, seed=3) for t in (0, 0.9)]
    ids, rows = sample(torch.from_numpy(logits.copy()), params, [None, RandomStream(3)])
    for row, token_id, lp in zip(logits, ids, rows):
        logprob, rank, top_ids, top_logprobs = logprob_row(row, token_id, 20)
        assert lp.logprob == pytest.approx(logprob, abs=1e-5)
        assert (lp.rank, lp.top_ids) == (rank, top_ids)
        np.testing.assert_allclose(lp.top_logprobs, top_logprobs, atol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_a_batch_shared_with_the_thread_pool_equals_its_rows_sampled_one_by_one(num_threads):
    # From 4 rows on the kernel hands rows to cext.cpu's pool: each row still draws from its own
    # stream and processes its own adjuster, so the ids and logprobs are those of one row at a time.
    from cext import cpu
    from engine.sampling.logits_process import LogitsAdjuster
    rng = np.random.default_rng(num_threads)
    num_rows, vocab = 23, 3000
    logits = (rng.standard_normal((num_rows, vocab)) * 3).astype(np.float32)
    params = [SamplingParams(temperature=[0, 0.8, 1.3][i % 3], top_k=[0, 50][i % 2], seed=i, logprobs=i % 4 == 0,
                             top_logprobs=3 if i % 4 == 0 else 0, repetition_penalty=1.0 + (i % 5 == 1),
                             logit_bias={7: 5.0} if i % 7 == 2 else None) for i in range(num_rows)]

    def adjusters_of(ps):
        return [LogitsAdjuster.for_request(p, [1, 2, 3], (), 8) for p in ps]

    def streams_of(ps):
        return [None if p.is_greedy else RandomStream(p.seed) for p in ps]

    before = cpu.get_num_threads()
    try:
        cpu.set_num_threads(num_threads)
        ids, rows = sample(torch.from_numpy(logits.copy()), params, streams_of(params), adjusters_of(params))
    finally:
        cpu.set_num_threads(before)
    for i, p in enumerate(params):
        one_ids, one_rows = sample(torch.from_numpy(logits[i:i + 1].copy()), [p], streams_of([p]), adjusters_of([p]))
        assert ids[i] == one_ids[0]
        assert (rows[i] is None) == (one_rows[0] is None)
        if rows[i] is not None:
            assert rows[i] == one_rows[0]


@pytest.mark.parametrize("layout", ["runs", "interleaved"])
@pytest.mark.parametrize("num_threads", [2, 3])
def test_rows_sharing_a_stream_draw_in_row_order_on_any_number_of_threads(layout, num_threads):
    # A speculative proposal's verification rows draw from their request's one stream in row order
    # (engine/core/speculative.py): those rows must not be split between threads, where the order of
    # the draws (and the stream's state) would depend on which thread runs first. "runs": each stream's
    # rows consecutive, as verification lays them out; "interleaved": a stream reappears after another.
    from cext import cpu
    rng = np.random.default_rng(7)
    owners = [0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 3, 3, 3, 4, 4] if layout == "runs" else [0, 1, 0, 1, 2, 0, 2, 1] * 2
    vocab = 4000
    logits = (rng.standard_normal((len(owners), vocab)) * 2).astype(np.float32)
    params = [SamplingParams(temperature=1.0, seed=o) for o in owners]

    def serial():
        streams = {o: RandomStream(o) for o in set(owners)}
        return [sample(torch.from_numpy(logits[i:i + 1].copy()), [params[i]], [streams[o]])[0][0]
                for i, o in enumerate(owners)]

    want = serial()
    before, threshold = cpu.get_num_threads(), cpu.get_parallel_threshold()
    try:
        cpu.set_num_threads(num_threads)
        cpu.set_parallel_threshold(0)  # every batch goes to the pool
        for _ in range(30):  # a race shows in some repeats, not all
            streams = {o: RandomStream(o) for o in set(owners)}
            ids, _ = sample(torch.from_numpy(logits.copy()), params, [streams[o] for o in owners])
            assert ids == want
    finally:
        cpu.set_num_threads(before)
        cpu.set_parallel_threshold(threshold)


def test_a_thread_scratch_grown_for_a_larger_vocabulary_samples_as_a_fresh_one():
    # Each thread's scratch (cext/csrc/sampler_kernels.c) is one anonymous map sized to the largest
    # vocabulary it has seen, remapped when a larger one comes: rows sampled after the regrowth
    # (top-k, top-p, a penalty and logprobs touch every array in it) equal those of a thread
    # that only ever saw the large vocabulary.
    import threading

    from engine.sampling.logits_process import LogitsAdjuster
    rng = np.random.default_rng(11)
    small = (rng.standard_normal((2, 100)) * 3).astype(np.float32)
    large = (rng.standard_normal((3, 70_000)) * 3).astype(np.float32)
    params = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=5, logprobs=True, top_logprobs=4,
                             repetition_penalty=1.3),
              SamplingParams(temperature=0, logprobs=True, top_logprobs=2),
              SamplingParams(temperature=1.2, min_p=0.05, seed=9)]

    def run(warm_up: bool) -> list:
        out = []

        def body():
            if warm_up:
                sample(torch.from_numpy(small.copy()), params[:2],
                       [RandomStream(1), None], None)
            streams = [None if p.is_greedy else RandomStream(p.seed) for p in params]
            adjusters = [LogitsAdjuster.for_request(p, [3, 4, 5], (), 8) for p in params]
            out.append(sample(torch.from_numpy(large.copy()), params, streams, adjusters))
            out.append(sample(torch.from_numpy(small.copy()), params[:2], [RandomStream(2), None], None))

        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
        return out

    assert run(warm_up=True) == run(warm_up=False)
