"""POST /v1/embeddings, /v1/rerank and /score through the real server, with the official openai client."""

from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
from embedding_fixtures import make_cross_encoder, minilm_path

from engine import Engine
from tests.server_fixtures import LiveServer

TEXTS = ["The quick brown fox.", "東京は日本の首都です。", "emoji 🚀✅", "a much longer sentence " * 5]


@pytest.fixture(scope="module")
def engine():
    with Engine.from_pretrained(minilm_path()) as eng:
        yield eng


@pytest.fixture(scope="module")
def live(engine):
    with LiveServer(engine, api_key="k") as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="k", max_retries=0, timeout=60) as c:
        yield c


AUTH = {"Authorization": "Bearer k"}


def test_openai_client_embeddings(client, engine):
    response = client.embeddings.create(model="default", input=TEXTS)  # the client asks for base64
    got = np.array([d.embedding for d in response.data], dtype=np.float32)
    np.testing.assert_allclose(got, engine.embed(TEXTS), atol=1e-6)
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    num_tokens = sum(len(engine.tokenizer.backend.encode(t).ids) for t in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
    one = client.embeddings.create(model="default", input="The quick brown fox.", encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, got[0], atol=1e-6)
    cut = client.embeddings.create(model="default", input=TEXTS[:2], dimensions=32)
    np.testing.assert_allclose(
        [d.embedding for d in cut.data], engine.embed(TEXTS[:2], dimensions=32), atol=1e-6
    )


def test_token_inputs_and_base64(live, engine):
    ids = engine.tokenizer.backend.encode(TEXTS[0]).ids
    for body_input in (ids, [ids, ids]):
        status, body = live.post_json(
            "/v1/embeddings", {"input": body_input, "encoding_format": "base64"}, AUTH
        )
        assert status == 200, body
        for item in body["data"]:
            vector = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
            np.testing.assert_allclose(vector, engine.embed(TEXTS[0])[0], atol=1e-6)
        assert body["usage"]["prompt_tokens"] == len(ids) * len(body["data"])


def test_over_length_400_unless_truncated(live, engine):
    long_text = "word " * 400
    status, body = live.post_json("/v1/embeddings", {"input": ["ok", long_text]}, AUTH)
    assert status == 400 and body["error"]["param"] == "input" and "256" in body["error"]["message"]
    assert body["error"]["code"] == "context_length_exceeded"
    status, body = live.post_json("/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": -1}, AUTH)
    assert status == 200 and body["usage"]["prompt_tokens"] == 256
    np.testing.assert_allclose(
        body["data"][0]["embedding"], engine.embed(long_text, truncate=True)[0], atol=1e-6
    )
    status, body = live.post_json("/v1/embeddings", {"input": long_text, "truncate_prompt_tokens": 10}, AUTH)
    assert status == 200 and body["usage"]["prompt_tokens"] == 10


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [["a"]]}, "input[0]"),
        ({"input": "x", "encoding_format": "binary"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 999}, "dimensions"),
        ({"input": "x", "pooling": "mean"}, "pooling"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "x", "truncate_prompt_tokens": 300}, "truncate_prompt_tokens"),
        ({"input": [101, 99999, 102]}, "input"),
    ],
)
def test_bad_requests_name_the_field(live, body, param):
    status, answer = live.post_json("/v1/embeddings", body, AUTH)
    assert status == 400, answer
    assert answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"


def test_client_errors_and_generation_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model="default", input=["fine", "word " * 400])
    assert err.value.body["param"] == "input"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="default", prompt="hello", max_tokens=4)
    assert err.value.body["param"] == "model"


def test_bi_encoder_rerank_and_score(live, engine):
    docs = ["Tokyo is the capital of Japan.", "Bananas are yellow."]
    status, body = live.post_json("/v1/rerank", {"query": "capital of Japan", "documents": docs}, AUTH)
    assert status == 200, body
    assert [r["index"] for r in body["results"]] == [0, 1]
    np.testing.assert_allclose(
        [r["relevance_score"] for r in body["results"]], engine.score("capital of Japan", docs), atol=1e-6
    )


@pytest.fixture(scope="module")
def cross_live(tmp_path_factory):
    with Engine.from_pretrained(make_cross_encoder(tmp_path_factory.mktemp("ce"))) as eng:
        with LiveServer(eng) as server:
            yield server, eng


def test_cross_encoder_rerank_and_score(cross_live):
    server, eng = cross_live
    query, docs = "Which city is the capital of Japan?", ["Tokyo.", "Bananas are yellow.", "Kyoto was, once."]
    want = eng.score(query, docs)
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        status, body = server.post_json(path, {"query": query, "documents": docs, "top_n": 2})
        assert status == 200, body
        order = sorted(range(3), key=lambda i: -want[i])[:2]
        assert [r["index"] for r in body["results"]] == order
        assert [r["document"]["text"] for r in body["results"]] == [docs[i] for i in order]
        np.testing.assert_allclose(
            [r["relevance_score"] for r in body["results"]], [want[i] for i in order], atol=1e-6
        )
        assert body["usage"]["prompt_tokens"] > 0
    status, body = server.post_json("/score", {"text_1": query, "text_2": docs})
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in body["data"]], want, atol=1e-6)
    status, body = server.post_json("/v1/score", {"text_1": query, "text_2": docs[0]})
    assert status == 200 and len(body["data"]) == 1


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/rerank", {"documents": ["a"]}, "query"),
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/v1/rerank", {"query": "q", "documents": ["a", 1]}, "documents[1]"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0}, "top_n"),
        ("/v1/rerank", {"query": "q", "documents": ["a"], "rank_fields": ["x"]}, "rank_fields"),
        ("/score", {"text_1": 3, "text_2": "a"}, "text_1"),
        ("/score", {"text_1": "q"}, "text_2"),
    ],
)
def test_rerank_bad_requests(cross_live, path, body, param):
    server, _ = cross_live
    status, answer = server.post_json(path, body)
    assert status == 400 and answer["error"]["param"] == param, answer
