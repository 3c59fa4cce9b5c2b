"""Engine.embed on all-MiniLM-L6-v2 against sentence-transformers (the reference), and the
embedding API's contract: shapes, truncation, dimensions, id inputs, errors, async."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from embedding_fixtures import corpus, minilm_path

from engine import ContextLengthError, Engine, InvalidParameterError


@pytest.fixture(scope="module")
def minilm():
    with Engine.from_pretrained(minilm_path()) as eng:
        yield eng


@pytest.fixture(scope="module")
def st_model():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path()), device="cpu")


@pytest.fixture(scope="module")
def texts():
    return corpus(200)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def test_parity_with_sentence_transformers(minilm, st_model, texts):
    ours = minilm.embed(texts, truncate=True)
    ref = st_model.encode(texts, batch_size=32, convert_to_numpy=True)
    assert ours.dtype == np.float32 and ours.shape == ref.shape == (len(texts), 384)
    cos = _cosines(ours, ref)
    assert cos.min() >= 0.99999, (int(cos.argmin()), float(cos.min()))
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(ours, ref, atol=2e-5)
    # the corpus does reach past the model's 256 tokens (truncation is exercised), and is not all alike
    lens = [len(minilm.tokenizer.backend.encode(t).ids) for t in texts]
    assert max(lens) > 256 and min(lens) < 8
    assert _cosines(ours[:1], ours[1:2])[0] < 0.99


def test_one_at_a_time_equals_batched(minilm, texts):
    batched = minilm.embed(texts[:24], truncate=True)
    single = np.concatenate([minilm.embed(t, truncate=True) for t in texts[:24]])
    np.testing.assert_allclose(single, batched, atol=1e-5)


def test_token_id_inputs(minilm):
    text = "Token ids are taken as they are."
    ids = minilm.tokenizer.backend.encode(text).ids  # [CLS] ... [SEP]
    assert ids[0] == 101 and ids[-1] == 102
    np.testing.assert_allclose(minilm.embed(ids), minilm.embed(text), atol=1e-6)
    np.testing.assert_allclose(minilm.embed([ids, ids[:-1]])[0], minilm.embed(text)[0], atol=1e-6)
    with pytest.raises(InvalidParameterError) as err:
        minilm.embed([ids, [30522]])
    assert err.value.param == "input[1]"


def test_over_length_is_an_error_unless_truncated(minilm):
    long_text = "word " * 400
    with pytest.raises(ContextLengthError) as err:
        minilm.embed(["short", long_text])
    assert err.value.param == "input" and err.value.max_model_len == 256 and "256" in str(err.value)
    full = minilm.embed(long_text, truncate=True)
    # truncating keeps [CLS] + the first 254 tokens + [SEP], as sentence-transformers does
    ids = minilm.tokenizer.backend.encode(long_text).ids
    np.testing.assert_allclose(minilm.embed(ids[:255] + [102]), full, atol=1e-6)
    np.testing.assert_allclose(minilm.embed(long_text, truncate=-1), full, atol=1e-6)
    cut = minilm.embed(long_text, truncate=16)
    np.testing.assert_allclose(cut, minilm.embed(ids[:15] + [102]), atol=1e-6)
    for bad in (0, 257, 2.5, "yes"):
        with pytest.raises(InvalidParameterError) as err:
            minilm.embed("x", truncate=bad)
        assert err.value.param == "truncate"


def test_dimensions_truncate_then_normalise(minilm, texts):
    full = minilm.embed(texts[:10], normalize=False)
    assert not np.allclose(np.linalg.norm(full, axis=1), 1.0)
    cut = minilm.embed(texts[:10], dimensions=64)
    expect = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    assert cut.shape == (10, 64)
    np.testing.assert_allclose(cut, expect, atol=1e-6)
    np.testing.assert_allclose(
        minilm.embed(texts[:10], dimensions=64, normalize=False), full[:, :64], atol=1e-6
    )
    for bad in (0, 385, True, "64"):
        with pytest.raises(InvalidParameterError) as err:
            minilm.embed("x", dimensions=bad)
        assert err.value.param == "dimensions"


@pytest.mark.parametrize(
    "bad, param",
    [
        ([], "input"),
        (None, "input"),
        ([["a"]], "input[0]"),
        (["ok", 3.5], "input[1]"),
        ([[]], "input[0]"),
        (["ok", [1, "x"]], "input[1]"),
    ],
)
def test_bad_inputs_name_the_field(minilm, bad, param):
    with pytest.raises(InvalidParameterError) as err:
        minilm.embed(bad)
    assert err.value.param == param


def test_generation_is_refused_and_the_engine_lives(minilm):
    with pytest.raises(InvalidParameterError) as err:
        minilm.generate(["hello"])
    assert err.value.param == "model"
    assert minilm.is_alive() and minilm.embed("still alive").shape == (1, 384)


def test_aembed_equals_embed(minilm, texts):
    async def main():
        return await asyncio.gather(minilm.aembed(texts[:5]), minilm.aembed(texts[5:9], dimensions=32))

    first, second = asyncio.run(main())
    np.testing.assert_allclose(first, minilm.embed(texts[:5]), atol=1e-6)
    np.testing.assert_allclose(second, minilm.embed(texts[5:9], dimensions=32), atol=1e-6)


def test_many_inputs_over_several_chunks(minilm, texts):
    many = texts * 12  # 2,400 inputs, ~100k tokens: several engine-thread steps
    out = minilm.embed(many, truncate=True)
    np.testing.assert_allclose(out[len(texts) * 11 :], out[: len(texts)], atol=1e-5)


def test_bert_matches_transformers_on_random_weights(tmp_path):
    """A small random BertModel saved by transformers: our hidden states equal its own."""
    import transformers

    config = transformers.BertConfig(
        vocab_size=97,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=80,
        max_position_embeddings=64,
        type_vocab_size=2,
    )
    torch.manual_seed(0)
    ref = transformers.BertModel(config, add_pooling_layer=False).eval()
    ref.save_pretrained(tmp_path)
    from engine.loader.encoder_loader import load_encoder
    from engine.models.bert import pack_rows

    ours = load_encoder(tmp_path)
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 97, (n,), generator=gen).tolist() for n in (5, 17, 1, 40)]
    types = [[0] * (n // 2) + [1] * (n - n // 2) for n in map(len, seqs)]
    hidden = ours.encode(pack_rows(seqs, types))
    for b, (ids, tt) in enumerate(zip(seqs, types)):
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([ids]), token_type_ids=torch.tensor([tt])).last_hidden_state[0]
        start = sum(map(len, seqs[:b]))
        torch.testing.assert_close(hidden[start : start + len(ids)], want, atol=1e-5, rtol=1e-5)


def test_bfloat16_encoder_stays_close(st_model, texts):
    """dtype="bfloat16": projections and attention in bfloat16 (residual and norms float32)."""
    with Engine.from_pretrained(minilm_path(), dtype="bfloat16") as eng:
        assert eng.model.dtype == torch.bfloat16
        ours = eng.embed(texts[:60], truncate=True)
    ref = st_model.encode(texts[:60], batch_size=32, convert_to_numpy=True)
    assert _cosines(ours, ref).min() >= 0.9999


class _RecordingRunner:
    """Our batching logic only: a runner whose 'embedding' of a sequence is its length."""

    size = 1

    def __init__(self):
        self.chunks = []

    def embed(self, ids, type_ids, pooling):
        self.chunks.append([len(seq) for seq in ids])
        return torch.tensor([[float(len(seq))] for seq in ids])


class _Core:
    def __init__(self):
        self.jobs = []

    def submit_job(self, job):
        self.jobs.append(job)


def test_batcher_packs_several_calls_into_one_forward_under_the_budget():
    from engine.embedding.inputs import EncodedInputs
    from engine.embedding.runner import EmbedBatcher, EmbedJob

    core, runner = _Core(), _RecordingRunner()
    batcher = EmbedBatcher(core, runner, busy_tokens=10)
    jobs = [EmbedJob(EncodedInputs([[1] * n for n in lens], None), "mean") for lens in ([3, 1], [2], [4, 4])]
    for job in jobs:
        batcher.submit(job)
    assert core.jobs == [batcher]  # scheduled once, however many calls wait
    assert batcher.step(is_busy=True) is False  # 10 tokens: job 0 (shortest first), job 1, one of job 2
    assert runner.chunks == [[1, 3, 2, 4]]
    assert jobs[0].future.result().ravel().tolist() == [3.0, 1.0] and jobs[1].future.done()
    assert not jobs[2].future.done()
    assert batcher.step(is_busy=True) is True  # the rest; nothing left: unscheduled
    assert runner.chunks[1] == [4] and jobs[2].future.result().ravel().tolist() == [4.0, 4.0]
    late = EmbedJob(EncodedInputs([[1] * 30], None), "mean")  # over the budget alone: runs by itself
    batcher.submit(late)
    assert core.jobs == [batcher, batcher] and batcher.step(is_busy=True) is True
    assert late.future.result().ravel().tolist() == [30.0]


def test_concurrent_calls_equal_one_batched_call(minilm, texts):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        singles = list(pool.map(lambda t: minilm.embed(t, truncate=True)[0], texts[:32]))
    np.testing.assert_allclose(np.stack(singles), minilm.embed(texts[:32], truncate=True), atol=1e-5)
