"""/v1/embeddings, /v1/rerank and /score on the Ray Serve front-end (webapp.ray_serve): one
all-MiniLM-L6-v2 replica answers what the single Flask server answers, through the openai client."""

from __future__ import annotations

import faulthandler
import os

import httpx
import numpy as np
import openai
import pytest
import ray  # noqa: E402  (ray[serve]: requirements-ray.txt)
from embedding_fixtures import minilm_path  # noqa: E402
from ray import serve  # noqa: E402

from engine import Engine  # noqa: E402
from tests.ray_fixtures import serve_port  # noqa: E402
from tests.server_fixtures import LiveServer  # noqa: E402
from webapp.ray_serve import EngineSpec, deploy  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WATCHDOG_S = 420
TEXTS = ["The quick brown fox.", "東京は日本の首都です。", "emoji 🚀✅"]


@pytest.fixture(scope="module")
def ray_url():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = REPO + (os.pathsep + old_path if old_path else "")  # replicas import this tree
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = serve_port()
    try:
        deploy(
            EngineSpec(kwargs={"model": str(minilm_path())}, model_name="minilm"),
            "127.0.0.1",
            port,
            num_replicas=1,
            num_cpus_per_replica=1,
        )
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            faulthandler.cancel_dump_traceback_later()
            if old_path is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old_path


@pytest.fixture(scope="module")
def single():
    with Engine.from_pretrained(minilm_path()) as eng:
        with LiveServer(eng, model_name="minilm") as server:
            yield server


def test_openai_client_embeddings_equal_the_single_servers(ray_url, single):
    results = []
    for base_url in (ray_url, single.base_url):
        with openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120) as client:
            response = client.embeddings.create(model="minilm", input=TEXTS, dimensions=128)
            results.append(
                (np.array([d.embedding for d in response.data]), response.usage.prompt_tokens, response.model)
            )
    (ray_vectors, ray_tokens, ray_model), (vectors, tokens, model) = results
    assert ray_vectors.shape == (3, 128) and ray_tokens == tokens and ray_model == model == "minilm"
    np.testing.assert_allclose(ray_vectors, vectors, atol=1e-6)


@pytest.mark.parametrize(
    "path, body",
    [
        (
            "/v1/rerank",
            {"query": "capital of Japan", "documents": ["Tokyo is the capital.", "Bananas."], "top_n": 1},
        ),
        ("/score", {"text_1": "capital of Japan", "text_2": ["Tokyo is the capital.", "Bananas."]}),
        ("/v1/embeddings", {"input": "word " * 400}),  # a 400 naming input
        ("/v1/embeddings", {"input": "x", "encoding_format": "binary"}),
    ],
)
def test_rerank_score_and_errors_equal_the_single_servers(ray_url, single, path, body):
    ray_answer = httpx.post(ray_url + path, json=body, timeout=120)
    status, answer = single.post_json(path, body)
    assert ray_answer.status_code == status
    got = ray_answer.json()
    for key in ("id", "created"):
        got.pop(key, None)
        answer.pop(key, None)
    if status == 200:
        scores = "results" if "results" in answer else "data"
        key = "relevance_score" if scores == "results" else "score"
        np.testing.assert_allclose([r[key] for r in got[scores]], [r[key] for r in answer[scores]], atol=1e-6)
        assert [r["index"] for r in got[scores]] == [r["index"] for r in answer[scores]]
    else:
        assert got == answer
