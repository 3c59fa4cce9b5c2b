"""Speculative decoding at temperature > 0 and with every kind of logits processing: the output
distribution is exactly the target's (chi-square over many seeded draws on a small-vocabulary
ScriptedModel, against the distribution computed here by enumeration), a seeded request gives
the same ids with and without speculation, and the rule for a real draft distribution q
(``accept_from_draft``) draws from p."""
import itertools

import numpy as np
import pytest
from sampling_reference import weights
from scipy.stats import chi2

import engine
from cext.sampler import RandomStream
from engine.core import speculative
from engine.core.speculative import accept_from_draft
from engine.loader import default_model_path
from engine.params import SamplingParams
from engine.testing import ScriptedModel

VOCAB = 4
PEAK = 2.0  # logits 0 everywhere, PEAK on the scripted id, PEAK / 2 on the next: a spread distribution
SCRIPT = [0, 1, 2, 3, 1, 2, 0]
PROMPT = [0, 0, 1, 0, 2, 0, 3, 1, 1, 2, 1, 3, 2, 2, 3, 3, 0]  # every pair occurs: every suffix proposes
NUM_TOKENS = 5
P_VALUE = 1e-4  # the draws are seeded: a test that passes once passes always; this bounds a real bias


def chi_square_p_value(counts: dict, probs: dict, num_draws: int) -> float:
    """Pearson's chi-square of observed ``counts`` against ``probs`` (over the same cells);
    cells expected fewer than 5 times are pooled into one."""
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for cell, p in probs.items():
        e = p * num_draws
        if e < 5:
            pooled_obs += counts.get(cell, 0)
            pooled_exp += e
        else:
            observed.append(counts.get(cell, 0))
            expected.append(e)
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    assert sum(observed) == num_draws, "a draw fell outside the cells"
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    stat = float(((observed - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, len(observed) - 1))


# -- the rule for a draft distribution --

@pytest.mark.parametrize("case", range(3))
def test_accept_from_draft_draws_from_the_target(case):
    rng = np.random.default_rng(case)
    p = rng.dirichlet(np.full(6, 0.7))
    q = rng.dirichlet(np.full(6, 0.7)) if case else p.copy()  # case 0: q == p, always accepted
    stream = RandomStream(100 + case)
    num_draws = 40000
    counts = np.zeros(6, dtype=np.int64)
    num_accepted = 0
    cdf_q = np.cumsum(q)
    for _ in range(num_draws):
        x = min(int(np.searchsorted(cdf_q, stream.random() * cdf_q[-1], side="right")), 5)  # x ~ q
        y, is_accepted = accept_from_draft(p, q, x, stream)
        counts[y] += 1
        num_accepted += is_accepted
    assert chi_square_p_value(dict(enumerate(counts)), dict(enumerate(p)), num_draws) > P_VALUE
    # The acceptance rate of the rule is sum(min(p, q)).
    assert abs(num_accepted / num_draws - np.minimum(p, q).sum()) < 0.01
    if case == 0:
        assert num_accepted == num_draws


# -- the engine, q one-hot (n-gram proposals) --

@pytest.fixture(autouse=True)
def verify_every_row(monkeypatch):
    """These tests draw thousands of requests in batches of many sequences; the engine would verify
    no proposal at 16 and more (MAX_VERIFY_ROWS, a speed policy), and only the proposed ids its
    step times say pay (the verify budget, another). Exactness must not depend on the batch, so
    here every batch speculates and verifies every proposed id."""
    monkeypatch.setattr(speculative, "MAX_VERIFY_ROWS", 1 << 20)
    monkeypatch.setattr(speculative, "VERIFY_BUDGET", False)


@pytest.fixture(scope="module")
def tok():
    return engine.load_tokenizer(default_model_path())


def make_engine(tok, **options):
    return engine.Engine(ScriptedModel(SCRIPT, VOCAB, peak=PEAK), tok, max_model_len=256, kv_cache_tokens=8192,
                         max_num_seqs=16, **options)


def logits_at(i: int) -> np.ndarray:
    """The ScriptedModel's row at generated position i."""
    row = np.zeros(VOCAB, dtype=np.float64)
    j = min(i, len(SCRIPT) - 1)
    row[SCRIPT[min(j + 1, len(SCRIPT) - 1)]] = PEAK / 2
    row[SCRIPT[j]] = PEAK
    return row


def processed(row: np.ndarray, params: SamplingParams, generated: tuple[int, ...]) -> np.ndarray:
    """logit_bias, then the repetition penalty over prompt + output, then frequency and presence
    penalties over the output (vLLM's order), then min_tokens' mask: a plain reference."""
    row = row.copy()
    for t, b in (params.logit_bias or {}).items():
        row[t] += b
    seen = set(PROMPT) | set(generated)
    for t in range(VOCAB):
        if t in seen and params.repetition_penalty != 1.0:
            row[t] = row[t] / params.repetition_penalty if row[t] > 0 else row[t] * params.repetition_penalty
        count = generated.count(t)
        row[t] -= params.frequency_penalty * count + (params.presence_penalty if count else 0.0)
    if len(generated) < params.min_tokens:
        for t in params.stop_token_ids:
            row[t] = -np.inf
    return row


def exact_distribution(params: SamplingParams) -> dict:
    """Probability of every output of NUM_TOKENS ids under the target."""
    probs = {}
    for seq in itertools.product(range(VOCAB), repeat=NUM_TOKENS):
        p = 1.0
        for i in range(NUM_TOKENS):
            w = weights(processed(logits_at(i), params, seq[:i]).astype(np.float32), params)
            p *= w[seq[i]] / w.sum()
            if p == 0.0:
                break
        probs[seq] = p
    return probs


def draw_many(eng, params: SamplingParams, seeds) -> list[tuple[int, ...]]:
    """One request per seed, 16 at a time (so every tick after the first speculates)."""
    outs = []
    seeds = list(seeds)
    for start in range(0, len(seeds), 16):
        batch = [SamplingParams(**{**params.__dict__, "seed": s}) for s in seeds[start : start + 16]]
        outs.extend(tuple(c.token_ids) for c in eng.generate([PROMPT] * len(batch), batch))
    return outs


CASES = {
    "temperature": SamplingParams(max_tokens=NUM_TOKENS, temperature=0.9, ignore_eos=True),
    "top_k_top_p": SamplingParams(max_tokens=NUM_TOKENS, temperature=1.3, top_k=3, top_p=0.9, ignore_eos=True),
    "penalties_bias": SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, ignore_eos=True,
                                     frequency_penalty=0.6, presence_penalty=0.3, repetition_penalty=1.3,
                                     logit_bias={3: 0.8, 0: -0.5}, min_p=0.05),
    "min_tokens": SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, ignore_eos=True, min_tokens=3,
                                 stop_token_ids=[3]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sampled_output_is_the_target_distribution(tok, name):
    params = CASES[name]
    num_draws = 4000
    with make_engine(tok, speculative="ngram", num_speculative_tokens=3) as fast:
        outs = draw_many(fast, params, range(num_draws))
        stats = fast.stats()
    if name == "min_tokens":  # id 3 stops the output once 3 ids are out: count outputs cut there
        probs = {}
        for seq, p in exact_distribution(params).items():
            cut = next((i + 1 for i, t in enumerate(seq) if t == 3 and i >= 3), NUM_TOKENS)
            probs[seq[:cut]] = probs.get(seq[:cut], 0.0) + p
    else:
        probs = exact_distribution(params)
    counts: dict = {}
    for seq in outs:
        counts[seq] = counts.get(seq, 0) + 1
    assert chi_square_p_value(counts, probs, num_draws) > P_VALUE
    assert stats["spec_decode_num_draft_tokens"] > 1000  # speculation ran, was accepted and rejected
    assert 0.05 < stats["spec_decode_acceptance_rate"] < 0.95


@pytest.mark.parametrize("name", list(CASES))
def test_seeded_output_equals_plain_decoding(tok, name):
    params = CASES[name]
    seeds = range(7, 7 + 320)
    with make_engine(tok) as plain, make_engine(tok, speculative="ngram", num_speculative_tokens=3) as fast:
        want = draw_many(plain, params, seeds)
        got = draw_many(fast, params, seeds)
        again = draw_many(fast, params, reversed(seeds))[::-1]  # other batches: the same ids per seed
        assert fast.stats()["spec_decode_num_accepted_tokens"] > 0
    assert got == want
    assert again == want
    assert len(set(want)) > 50  # the seeds draw different outputs
