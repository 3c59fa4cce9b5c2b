"""Pooled embeddings from a generation model (the default SmolLM2-135M-Instruct): the packed,
chunked engine path against a plain torch reference of the pooling over one causal forward per
text (the model's torch reference path, all hidden rows), for mean, last and cls pooling."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine import Engine, InvalidParameterError
from engine.batch import single_sequence_batch
from engine.loader import default_model_path

TEXTS = [
    "Hello",
    "The capital of France is Paris.",
    "東京は日本の首都です。 🙂",
    "one two three " * 40,
    "Embeddings from a decoder use the causal mask.",
    "x",
]


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
    """An embed call while a generation stream runs: both finish, the stream's text is unchanged."""
    import engine as engine_package

    eng = engines["mean"]
    params = engine_package.SamplingParams(max_tokens=24, temperature=0)
    [alone] = eng.generate(["Once upon a time"], params)
    stream = eng.stream("Once upon a time", params)
    vectors = eng.embed(TEXTS * 8)
    text = "".join(ev.text for ev in stream)
    assert text == alone.text
    # The same rows in a forward of another row count take other product routes (engine/models/routes.py),
    # which round differently in float32: unit vectors agree to ~1e-5 (cosine 0.99999), not bit for bit.
    alone_vectors = eng.embed(TEXTS)
    np.testing.assert_allclose(vectors[: len(TEXTS)], alone_vectors, atol=1e-4)
    assert (np.sum(vectors[: len(TEXTS)] * alone_vectors, axis=1) >= 0.99999).all()


def test_decoder_errors(engines):
    eng = engines["last"]
    with pytest.raises(InvalidParameterError) as err:
        eng.embed(["fine", ""])  # no tokens: SmolLM2 adds no BOS
    assert err.value.param == "input[1]"
    with pytest.raises(InvalidParameterError) as err:
        Engine(eng.model, eng.tokenizer, pooling="median")
    assert err.value.param == "pooling"
