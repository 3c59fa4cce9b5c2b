"""Pooled embeddings from a generation model (the default SmolLM2-135M-Instruct): the packed,
chunked engine path against a plain torch reference of the pooling over one causal forward per
text (the model's torch reference path, all hidden rows), for mean, last and cls pooling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from embedding_fixtures import DECODER_TEXTS

from engine import Engine, InvalidParameterError
from engine.batch import single_sequence_batch
from engine.loader import default_model_path

TEXTS = DECODER_TEXTS


def reference(model, ids: list[int], pooling: str) -> np.ndarray:
    """One sequence, one forward on the torch path; every row's final-normed hidden state pooled here."""
    cache = model.make_kv_cache(-(-len(ids) // 16), 16)
    batch = single_sequence_batch(ids, 0, list(range(-(-len(ids) // 16))), 16, logit_rows="all")
    fused = model.use_fused
    model.use_fused = False
    try:
        hidden = model.forward_hidden(batch, cache).float()  # [T, E]
    finally:
        model.use_fused = fused
    vector = {"mean": hidden.mean(0), "last": hidden[-1], "cls": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=0).numpy()


@pytest.fixture(scope="module")
def engines():
    first = Engine.from_pretrained(default_model_path(), pooling="mean", max_num_batched_tokens=64)
    others = {
        p: Engine(first.model, first.tokenizer, pooling=p, max_num_batched_tokens=64) for p in ("last", "cls")
    }
    yield {"mean": first, **others}
    for eng in (first, *others.values()):
        eng.close()


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_pooled_decoder_equals_reference(engines, pooling):
    eng = engines[pooling]
    got = eng.embed(TEXTS)
    assert got.shape == (len(TEXTS), eng.model.config.hidden_size) and got.dtype == np.float32
    for text, vector in zip(TEXTS, got):
        want = reference(eng.model, eng.tokenizer.encode(text), pooling)
        assert float(vector @ want) >= 0.9999, (pooling, text)
    assert not np.allclose(got[0], got[1], atol=1e-3)  # texts differ (first tokens too, for cls)


def test_embedding_beside_generation(engines):
    """An embed call while a generation stream runs: the embedding rows share the stream's ticks
    (mixed forwards, counted), the stream's greedy text is the one it has alone, and each vector
    equals the one computed with no generation running (embedding rows only)."""
    import engine as engine_package

    eng = engines["mean"]
    params = engine_package.SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    [alone] = eng.generate(["Once upon a time"], params)
    alone_vectors = eng.embed(TEXTS)
    num_mixed = eng.stats()["num_mixed_ticks"]
    stream = eng.stream("Once upon a time", params)
    first = next(stream)  # the stream is running (its prompt prefilled) before the embeddings arrive
    vectors = eng.embed(TEXTS * 4)
    text = first.text + "".join(ev.text for ev in stream)
    assert text == alone.text
    assert eng.stats()["num_mixed_ticks"] > num_mixed  # the rows went into the stream's ticks
    # The same rows in a forward of another row count take other product routes (engine/models/routes.py)
    # and other attention chunks, which round differently: measured up to ~3e-5 per element on a Zen 4,
    # 1.1e-4 on an AMX Xeon (its table: 1-16 rows int16, which rounds the activations to 16 bits,
    # 17-32 the float kernel, more oneDNN's float32). A real mix-up of rows moves the cosine by
    # far more than the 1e-5 below.
    for k in range(4):
        got = vectors[k * len(TEXTS) : (k + 1) * len(TEXTS)]
        np.testing.assert_allclose(got, alone_vectors, atol=5e-4, rtol=0)
        assert (np.sum(got * alone_vectors, axis=1) >= 0.99999).all()


def test_generation_beside_embeddings_unchanged(engines):
    """Two streams (greedy, and seeded sampling) give the same tokens with a long embedding job
    beside them as alone, and the KV blocks the embedding rows took are all given back."""
    import engine as engine_package

    eng = engines["last"]
    greedy = engine_package.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    seeded = engine_package.SamplingParams(max_tokens=32, temperature=0.8, seed=7, ignore_eos=True)
    prompts = ["The capital of France is", "List three colours:"]
    alone = [eng.generate([p], q)[0].token_ids for p, q in zip(prompts, (greedy, seeded))]
    num_mixed = eng.stats()["num_mixed_ticks"]
    streams = [eng.stream(p, q) for p, q in zip(prompts, (greedy, seeded))]
    call = eng.submit_embed(TEXTS * 6)
    beside = [[t for ev in s for t in ev.token_ids] for s in streams]
    vectors = call.result()
    assert beside == alone
    # Last-token pooling reads one row (no mean to average rounding out): measured <= 1.3e-4 per element.
    alone_vectors = np.tile(eng.embed(TEXTS), (6, 1))
    np.testing.assert_allclose(vectors, alone_vectors, atol=5e-4, rtol=0)
    assert (np.sum(vectors * alone_vectors, axis=1) >= 0.99999).all()
    assert eng.stats()["num_mixed_ticks"] > num_mixed
    assert eng.stats()["kv_usage"] == 0.0  # blocks held by a request (prefix-cached ones are free)


def test_abort_embedding(engines):
    """Cancelling the task awaiting aembed drops the job on the engine thread: its remaining texts
    are never computed, its KV blocks are freed, a stream beside it and the next call are unaffected."""
    import asyncio

    import engine as engine_package

    eng = engines["cls"]
    params = engine_package.SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    [alone] = eng.generate(["Once upon a time"], params)
    many = [f"text number {i} " * 20 for i in range(300)]  # ~18,000 tokens: many ticks at 64 per tick
    stream = eng.stream("Once upon a time", params)

    async def cancel_midway():
        task = asyncio.ensure_future(eng.aembed(many))
        start = eng.stats()["num_embedding_tokens"]
        while eng.stats()["num_embedding_tokens"] == start:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    assert "".join(ev.text for ev in stream) == alone.text
    after = eng.stats()["num_embedding_tokens"]
    vector = eng.embed(TEXTS[:1])  # the engine goes on; the dropped job computed no more rows
    assert eng.stats()["num_embedding_tokens"] - after == len(eng.tokenizer.encode(TEXTS[0]))
    assert after < sum(len(eng.tokenizer.encode(t)) for t in many) // 2
    assert eng.stats()["kv_usage"] == 0.0
    assert float(vector[0] @ reference(eng.model, eng.tokenizer.encode(TEXTS[0]), "cls")) >= 0.9999


def test_decoder_errors(engines):
    eng = engines["last"]
    with pytest.raises(InvalidParameterError) as err:
        eng.embed(["fine", ""])  # no tokens: SmolLM2 adds no BOS
    assert err.value.param == "input[1]"
    with pytest.raises(InvalidParameterError) as err:
        Engine(eng.model, eng.tokenizer, pooling="median")
    assert err.value.param == "pooling"
