"""Sampler and SamplingParams: behaviour that can fail, compared against plain torch."""
import pytest
import torch

from engine.params import SamplingParams
from engine.sampling.sampler import RandomStream, prompt_logprobs, sample


def _logits(rows=4, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * 3


def test_greedy_is_argmax_and_skips_logprobs():
    logits = _logits()
    ids, lps = sample(logits, [SamplingParams(temperature=0)] * 4, [None] * 4)
    assert ids == torch.argmax(logits, dim=-1).tolist()
    assert lps == [None] * 4


def test_logprobs_match_log_softmax_and_top_is_sorted():
    logits = _logits()
    params = [SamplingParams(temperature=0, logprobs=True, top_logprobs=k) for k in (0, 1, 3, 5)]
    ids, lps = sample(logits, params, [None] * 4)
    ref = torch.log_softmax(logits, dim=-1)
    for row, (tid, lp, p) in enumerate(zip(ids, lps, params)):
        assert lp.logprob == pytest.approx(ref[row, tid].item(), abs=1e-5)
        assert len(lp.top_ids) == p.top_logprobs
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        if p.top_logprobs:
            assert lp.top_ids[0] == tid  # greedy picks the best
            assert lp.top_ids == torch.topk(ref[row], p.top_logprobs).indices.tolist()


def test_same_seed_same_tokens_whatever_the_batch():
    logits = _logits(rows=3)
    p = SamplingParams(temperature=1.0, seed=1234)

    def draws(batch_rows):
        gen = RandomStream(1234)
        out = []
        for _ in range(20):
            others = [SamplingParams(temperature=0.7, seed=5)] * (batch_rows - 1)
            gens = [gen] + [RandomStream(9) for _ in others]
            ids, _ = sample(logits[:batch_rows], [p] + others, gens)
            out.append(ids[0])
        return out

    assert draws(1) == draws(3)
    gen_a = RandomStream(1)
    gen_b = RandomStream(2)
    a = [sample(logits[:1], [p], [gen_a])[0][0] for _ in range(30)]
    b = [sample(logits[:1], [p], [gen_b])[0][0] for _ in range(30)]
    assert a != b


def test_top_k_and_top_p_restrict_the_support():
    logits = _logits(rows=1, vocab=30)[0]
    order = torch.argsort(logits, descending=True).tolist()
    gen = RandomStream(0)
    seen_k = {sample(logits[None], [SamplingParams(temperature=5.0, top_k=3)], [gen])[0][0] for _ in range(300)}
    assert seen_k <= set(order[:3]) and len(seen_k) > 1
    probs = torch.softmax(logits, dim=-1)
    cum = torch.cumsum(probs[order], 0)
    nucleus = set(order[: int((cum < 0.6).sum()) + 1])
    seen_p = {sample(logits[None], [SamplingParams(temperature=1.0, top_p=0.6)], [gen])[0][0] for _ in range(300)}
    assert seen_p <= nucleus


def test_temperature_sampling_follows_the_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    gen = RandomStream(0)
    n = 4000
    counts = torch.zeros(4)
    for _ in range(n):
        counts[sample(logits, [SamplingParams(temperature=1.0)], [gen])[0][0]] += 1
    expected = torch.softmax(logits[0], 0)
    assert torch.allclose(counts / n, expected, atol=0.03)


def test_prompt_logprobs_rows():
    logits = _logits(rows=3)
    rows = prompt_logprobs(logits, [1, 2, 3], k=2)
    ref = torch.log_softmax(logits, dim=-1)
    for i, r in enumerate(rows):
        assert r.logprob == pytest.approx(ref[i, i + 1].item(), abs=1e-5)
        assert r.top_ids == torch.topk(ref[i], 2).indices.tolist()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": [1]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 1}, "logprobs"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_invalid_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_string_becomes_tuple_and_top_logprobs_implies_logprobs():
    p = SamplingParams(stop="END", top_logprobs=2)
    assert p.stop == ("END",) and p.logprobs
