"""Pooled embeddings of the default model (SmolLM2-135M-Instruct, its Q4_1 GGUF) against
llama-cpp-python's ``Llama.embed`` on the same file with the same pooling (cosine >= 0.999).

Skipped only when ``llama_cpp`` is not importable (llama-cpp-python 0.3.36 is built by
``make llamacpp``); everything else here is the real thing on both sides."""

from __future__ import annotations

import numpy as np
import pytest
from embedding_fixtures import DECODER_TEXTS

from engine import Engine
from engine.loader import default_model_path

llama_cpp = pytest.importorskip(
    "llama_cpp", reason="llama-cpp-python is not installed in this venv (`make llamacpp` builds 0.3.36)"
)

TEXTS = [*DECODER_TEXTS,
         "A longer sentence about retrieval: embed the documents, embed the question, rank them, answer."]
POOLING_TYPES = {"mean": "LLAMA_POOLING_TYPE_MEAN", "last": "LLAMA_POOLING_TYPE_LAST",
                 "cls": "LLAMA_POOLING_TYPE_CLS"}


@pytest.fixture(scope="module")
def ours():
    first = Engine.from_pretrained(default_model_path(), pooling="mean")
    engines = {"mean": first}
    for pooling in ("last", "cls"):
        engines[pooling] = Engine(first.model, first.tokenizer, pooling=pooling)
    yield engines
    for eng in engines.values():
        eng.close()


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
def test_pooled_default_model_equals_llama_cpp(ours, pooling):
    llm = llama_cpp.Llama(
        model_path=str(default_model_path()), embedding=True,
        pooling_type=getattr(llama_cpp, POOLING_TYPES[pooling]), n_ctx=1024, n_batch=1024, n_ubatch=1024,
        n_threads=2, verbose=False,
    )
    try:
        theirs = np.asarray(llm.embed(TEXTS, normalize=True), dtype=np.float32)  # [N, E]
        their_ids = [llm.tokenize(t.encode("utf-8")) for t in TEXTS]
    finally:
        llm.close()
    eng = ours[pooling]
    assert their_ids == [eng.tokenizer.encode(t) for t in TEXTS]  # the same rows go in
    vectors = eng.embed(TEXTS)
    assert vectors.shape == theirs.shape
    cosines = np.sum(vectors * theirs, axis=1)
    assert cosines.min() >= 0.999, (pooling, cosines.tolist())
