"""Each sampling option against a plain NumPy reference of its definition (logits in, logits or
distribution out), batched with rows that have no processing; the NumPy ``adjust`` and the
sampler kernel's processing (``engine.sampling.sampler.process``) both; then the engine end to end."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.errors import InvalidParameterError
from engine.params import SamplingParams
from engine.sampling.logits_process import LogitsAdjuster, adjust
from engine.sampling.sampler import RandomStream, process, sample
from tests.sampling_reference import mask_min_p

VOCAB = 40


def reference(logits, params, prompt_ids, output_ids, stop_ids, bad_words_ids=()):
    """The definitions, written plainly: one row, one option after another (vLLM's order)."""
    out = logits.astype(np.float64).copy()
    if params.allowed_token_ids is not None:
        keep = np.zeros(VOCAB, bool)
        keep[list(params.allowed_token_ids)] = True
        out[~keep] = -np.inf
    for ids in bad_words_ids:
        prefix = ids[:-1]
        if not prefix or (len(output_ids) >= len(prefix) and output_ids[len(output_ids) - len(prefix):] == prefix):
            out[ids[-1]] = -np.inf
    if len(output_ids) < params.min_tokens:
        for t in stop_ids:
            out[t] = -np.inf
    for t, b in (params.logit_bias or {}).items():
        out[t] += b
    for t in set(prompt_ids) | set(output_ids):
        p = params.repetition_penalty
        out[t] = out[t] / p if out[t] > 0 else out[t] * p
    for t in set(output_ids):
        out[t] -= params.frequency_penalty * output_ids.count(t) + params.presence_penalty
    return out


token_ids = st.integers(0, VOCAB - 1)
option_sets = st.fixed_dictionaries({}, optional={
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 3),
    "logit_bias": st.dictionaries(token_ids, st.floats(-100, 100), max_size=6),
    "min_tokens": st.integers(0, 6),
    "allowed_token_ids": st.lists(token_ids, min_size=1, max_size=8),
})


@settings(max_examples=150, deadline=None)
@given(options=st.lists(option_sets, min_size=1, max_size=4), data=st.data())
def test_adjust_matches_reference_per_row(options, data):
    rows = len(options)
    logits = np.array(data.draw(st.lists(st.floats(-30, 30, width=32), min_size=rows * VOCAB,
                                         max_size=rows * VOCAB)), dtype=np.float32).reshape(rows, VOCAB)
    stop_ids = frozenset(data.draw(st.lists(token_ids, max_size=3)))
    expected, adjusters = [], []
    for row, opts in enumerate(options):
        params = SamplingParams(max_tokens=20, **opts)
        prompt = data.draw(st.lists(token_ids, min_size=1, max_size=10))
        output = data.draw(st.lists(token_ids, max_size=12))
        bad = data.draw(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3), max_size=3))
        if bad:  # small ids so that multi-token words do match the output now and then
            output = output + data.draw(st.sampled_from(bad))[:-1]
            params = SamplingParams(max_tokens=20, bad_words=["w"] * len(bad), **opts)
        a = LogitsAdjuster.for_request(params, prompt, stop_ids, params.max_tokens, bad)
        for t in output:
            if a is not None:
                a.add(t)
        adjusters.append(a)
        expected.append(reference(logits[row], params, prompt, output, stop_ids, bad) if a is not None
                        else logits[row].astype(np.float64))
    got = logits.copy()
    adjust(got, adjusters)
    np.testing.assert_allclose(got, np.array(expected), rtol=1e-5, atol=1e-4)
    kernel = logits.copy()
    process(kernel, adjusters)  # the sampler kernel's processing: the same float32 arithmetic
    np.testing.assert_array_equal(kernel, got)


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(-20, 20), min_size=2, max_size=30), min_p=st.floats(0.001, 1.0),
       temperature=st.floats(0.2, 3.0))
def test_min_p_keeps_exactly_the_tokens_with_p_at_least_min_p_times_p_max(values, min_p, temperature):
    logits = np.array(values, dtype=np.float64)
    probs = np.exp((logits - logits.max()) / temperature)
    probs /= probs.sum()
    expected = probs >= min_p * probs.max()
    scaled = np.array(values, dtype=np.float64) / temperature
    kept_probs = np.exp(scaled - scaled.max())
    mask_min_p(kept_probs, min_p)
    kept = kept_probs > 0
    borderline = np.isclose(probs, min_p * probs.max(), rtol=1e-4)
    assert (kept == expected)[~borderline].all()


def test_draws_follow_the_adjusted_distribution():
    # With temperature 1 the sampler must draw from softmax(adjusted logits): compare frequencies.
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0, logit_bias={0: -3.0, 4: 2.5}, min_p=0.05)
    expected = reference(logits[0].numpy(), params, [], [], ())
    expected = np.exp(expected - expected.max())
    expected = np.where(expected >= 0.05 * expected.max(), expected, 0.0)
    expected /= expected.sum()
    gen = RandomStream(7)
    counts = np.zeros(5)
    for _ in range(4000):
        adjuster = LogitsAdjuster.for_request(params, [1], (), 4)
        ids, _ = sample(logits.clone(), [params], [gen], [adjuster])
        counts[ids[0]] += 1
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.03)


def test_logprobs_stay_the_models_own_after_processing():
    logits = torch.tensor([[3.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=0, logprobs=True, top_logprobs=2, logit_bias={0: -100})
    adjuster = LogitsAdjuster.for_request(params, [1], (), 4)
    ids, lps = sample(logits.clone(), [params], [None], [adjuster])
    assert ids == [1]  # the bias moved the choice ...
    raw = torch.log_softmax(logits[0], dim=-1)
    assert lps[0].logprob == pytest.approx(raw[1].item())  # ... the logprobs describe the model
    assert lps[0].top_ids == [0, 1]


def test_counts_are_kept_incrementally():
    params = SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=2.0, max_tokens=5,
                            logit_bias={9: 1.0})
    a = LogitsAdjuster.for_request(params, [3, 3, 4], (), 5)
    for t in (4, 5, 5, 6, 9):
        a.add(t)
    touched = dict(zip(a.ids[: a.num_ids].tolist(), zip(a.bias.tolist(), a.scale.tolist(), a.sub.tolist())))
    assert touched == {9: (1.0, 2.0, 1.5), 3: (0.0, 2.0, 0.0), 4: (0.0, 2.0, 1.5), 5: (0.0, 2.0, 2.5),
                       6: (0.0, 2.0, 1.5)}


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 2.5), ("presence_penalty", "1"), ("frequency_penalty", -3), ("frequency_penalty", True),
    ("repetition_penalty", 0), ("repetition_penalty", -1.0), ("min_p", 1.5), ("min_p", -0.1), ("n", 0),
    ("n", 1.5), ("n", 1000), ("logit_bias", "junk"), ("logit_bias", {"x": 1}), ("logit_bias", {"5": 101}),
    ("logit_bias", {-1: 1}), ("logit_bias", {"5": "1"}), ("allowed_token_ids", []), ("allowed_token_ids", [-1]),
    ("min_tokens", -1), ("bad_words", "x"), ("bad_words", [""]), ("bad_words", [3]),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(InvalidParameterError) as err:
        SamplingParams(**{field: value})
    assert err.value.param == field


def test_logit_bias_string_keys_are_token_ids():
    assert SamplingParams(logit_bias={"12": 5, 3: -1.5}).logit_bias == {12: 5.0, 3: -1.5}
