"""Engine.rerank / score: a random-weights cross-encoder against sentence-transformers' CrossEncoder,
and a bi-encoder's cosine scores against its own embeddings."""

from __future__ import annotations

import numpy as np
import pytest
from embedding_fixtures import NON_LATIN, corpus, make_cross_encoder, minilm_path

from engine import Engine, InvalidParameterError

QUERY = "Which city is the capital of Japan?"


@pytest.fixture(scope="module")
def cross_dir(tmp_path_factory):
    return make_cross_encoder(tmp_path_factory.mktemp("cross-encoder"))


@pytest.fixture(scope="module")
def cross(cross_dir):
    with Engine.from_pretrained(cross_dir) as eng:
        yield eng


@pytest.fixture(scope="module")
def documents():
    return [t[:300] for t in corpus(40, seed=3)] + list(NON_LATIN)


def test_cross_encoder_equals_sentence_transformers(cross, cross_dir, documents):
    from sentence_transformers import CrossEncoder

    ref = CrossEncoder(str(cross_dir), device="cpu")
    want = ref.predict([(QUERY, d) for d in documents], batch_size=16, convert_to_numpy=True)
    got = np.array(cross.score(QUERY, documents))
    assert got.shape == want.shape == (len(documents),)
    np.testing.assert_allclose(got, want, atol=1e-4)
    assert np.ptp(want) > 0.1  # the scores are not all alike
    ranked = cross.rerank(QUERY, documents)
    assert [i for i, _ in ranked] == list(np.argsort(-got, kind="stable"))
    np.testing.assert_allclose([s for _, s in ranked], np.sort(want)[::-1], atol=1e-4)
    assert cross.rerank(QUERY, documents, top_n=3) == ranked[:3]


def test_long_pairs_are_cut_longest_first(cross, cross_dir):
    from sentence_transformers import CrossEncoder

    ref = CrossEncoder(str(cross_dir), device="cpu", max_length=512)
    long_doc = "tokyo is large " * 300  # 900 tokens: cut to fit 512 with the query
    want = ref.predict([(QUERY, long_doc)], convert_to_numpy=True)
    np.testing.assert_allclose(cross.score(QUERY, [long_doc]), want, atol=1e-4)


def test_rerank_errors_name_the_field(cross):
    for kwargs, param in (
        ({"documents": []}, "documents"),
        ({"documents": ["a", 3]}, "documents[1]"),
        ({"documents": ["a"], "top_n": 0}, "top_n"),
        ({"query": 5, "documents": ["a"]}, "query"),
    ):
        kwargs.setdefault("query", QUERY)
        with pytest.raises(InvalidParameterError) as err:
            cross.rerank(**kwargs)
        assert err.value.param == param


def test_bi_encoder_scores_are_embedding_cosines():
    with Engine.from_pretrained(minilm_path()) as eng:
        docs = ["Tokyo is the capital of Japan.", "Bananas are yellow.", "Japan's capital city is Tokyo."]
        scores = eng.score(QUERY, docs)
        vectors = eng.embed([QUERY, *docs])
        np.testing.assert_allclose(scores, vectors[1:] @ vectors[0], atol=1e-6)
        assert [i for i, _ in eng.rerank(QUERY, docs)][-1] == 1
