"""POST /v1/embeddings (OpenAI), POST /v1/rerank (Jina / Cohere, as llama.cpp and vLLM serve it)
and POST /score (vLLM): parse, run on the engine, build the response. No web framework here:
the Flask app (webapp.app) and the Ray Serve ingress share these functions.

Every field of these bodies is listed below; any other field is a 400 naming it, as is a value
the server cannot honour. Inputs over the model's length are a 400 naming ``input``
(``context_length_exceeded``, with the limit) unless ``truncate_prompt_tokens`` (vLLM) says to
cut them (-1: to the limit; k: to k tokens; the end of an input goes). Rerank and score pairs
are cut to the model's length longest-first, as transformers' cross-encoders are.
"""

from __future__ import annotations

import base64
import time
import uuid
from dataclasses import dataclass

from .errors import APIError, bad_request, from_exception

EMBEDDING_FIELDS = {
    "input",
    "model",
    "encoding_format",
    "dimensions",
    "user",
    "truncate_prompt_tokens",
    "normalize",
}
RERANK_FIELDS = {"query", "documents", "top_n", "model", "return_documents", "truncate_prompt_tokens"}
SCORE_FIELDS = {"text_1", "text_2", "model", "truncate_prompt_tokens"}
ENCODING_FORMATS = ("float", "base64")
RERANK_PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")  # vLLM serves all three, llama.cpp the first two
SCORE_PATHS = ("/score", "/v1/score")
MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


@dataclass
class EmbeddingsRequest:
    inputs: object
    encoding_format: str
    dimensions: int | None
    truncate: int | bool
    normalize: bool


def _check_fields(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(
            f"{unknown[0]} is not a field this endpoint supports (known: {', '.join(sorted(known))})",
            unknown[0],
        )


def _optional_int(body: dict, name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise bad_request(f"{name} must be an integer >= {minimum}, got {value!r}", name)
    return value


def _truncate(body: dict) -> int | bool:
    value = body.get("truncate_prompt_tokens")
    if value is None:
        return False
    if not isinstance(value, int) or isinstance(value, bool) or not (value == -1 or value >= 1):
        raise bad_request(
            f"truncate_prompt_tokens must be -1 (the model's limit) or a token count >= 1, got {value!r}",
            "truncate_prompt_tokens",
        )
    return value


def parse_embeddings(body: dict) -> EmbeddingsRequest:
    _check_fields(body, EMBEDDING_FIELDS)
    if "input" not in body:
        raise bad_request("input is required", "input")
    inputs = body["input"]
    if isinstance(inputs, list) and len(inputs) > MAX_INPUTS and not all(isinstance(t, int) for t in inputs):
        raise bad_request(
            f"input holds {len(inputs)} inputs, more than the {MAX_INPUTS} of one request", "input"
        )
    if inputs == "" or (isinstance(inputs, list) and any(item == "" for item in inputs)):
        raise bad_request("input must not contain empty strings", "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODING_FORMATS:
        raise bad_request(
            f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, got {fmt!r}", "encoding_format"
        )
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad_request("model must be a string", "model")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad_request("user must be a string", "user")
    normalize = body.get("normalize", True)
    if normalize is None:
        normalize = True
    if not isinstance(normalize, bool):
        raise bad_request(f"normalize must be a boolean, got {normalize!r}", "normalize")
    return EmbeddingsRequest(inputs, fmt, _optional_int(body, "dimensions", 1), _truncate(body), normalize)


def submit_embeddings(engine, req: EmbeddingsRequest):
    """Tokenize here and queue the job: an engine.embedding.api.EmbedCall (or an APIError)."""
    try:
        return engine.submit_embed(
            req.inputs, req.normalize, req.dimensions, req.truncate, truncate_param="truncate_prompt_tokens"
        )
    except APIError:
        raise
    except Exception as exc:
        raise from_exception(exc) from None


def embeddings_body(req: EmbeddingsRequest, vectors, model_name: str, num_prompt_tokens: int) -> dict:
    """vectors [N, D] float32 -> OpenAI's list of embedding objects (base64: little-endian float32)."""
    if req.encoding_format == "base64":
        items = [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in vectors]
    else:
        items = vectors.tolist()
    return {
        "object": "list",
        "model": model_name,
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(items)],
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }


@dataclass
class ScoreRequest:
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True


def _strings(value, name: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise bad_request(f"{name} must be a non-empty list of strings", name)
    for i, item in enumerate(value):
        if isinstance(item, dict) and isinstance(item.get("text"), str):  # Cohere's {"text": ...}
            value[i] = item = item["text"]
        if not isinstance(item, str):
            raise bad_request(f"{name}[{i}] must be a string", f"{name}[{i}]")
    return value


def _no_truncation_field(body: dict) -> None:
    value = body.get("truncate_prompt_tokens")
    if value not in (None, -1):  # pairs are always cut to the model's length, longest-first
        raise bad_request(
            "truncate_prompt_tokens: pairs are cut to the model's length longest-first; only -1 "
            "(that limit) is supported here",
            "truncate_prompt_tokens",
        )


def parse_rerank(body: dict) -> ScoreRequest:
    _check_fields(body, RERANK_FIELDS)
    _no_truncation_field(body)
    query = body.get("query")
    if not isinstance(query, str):
        raise bad_request("query must be a string", "query")
    documents = _strings(body.get("documents"), "documents")
    return_documents = body.get("return_documents", True)
    if not isinstance(return_documents, bool):
        raise bad_request("return_documents must be a boolean", "return_documents")
    return ScoreRequest(query, documents, _optional_int(body, "top_n", 1), return_documents)


def parse_score(body: dict) -> ScoreRequest:
    """vLLM's /score: text_1 (one string) against text_2 (a string or a list)."""
    _check_fields(body, SCORE_FIELDS)
    _no_truncation_field(body)
    text_1 = body.get("text_1")
    if isinstance(text_1, list) and len(text_1) == 1:
        text_1 = text_1[0]
    if not isinstance(text_1, str):
        raise bad_request("text_1 must be a string (one query scored against text_2)", "text_1")
    text_2 = body.get("text_2")
    documents = [text_2] if isinstance(text_2, str) else _strings(text_2, "text_2")
    return ScoreRequest(text_1, documents)


def submit_scores(engine, req: ScoreRequest, param: str):
    try:
        return engine.submit_score(req.query, req.documents, param)
    except APIError:
        raise
    except Exception as exc:
        raise from_exception(exc) from None


def rerank_body(req: ScoreRequest, scores, model_name: str, num_prompt_tokens: int, request_id: str) -> dict:
    ranked = sorted(enumerate(float(s) for s in scores), key=lambda pair: -pair[1])
    if req.top_n is not None:
        ranked = ranked[: req.top_n]
    results = []
    for index, score in ranked:
        result = {"index": index, "relevance_score": score}
        if req.return_documents:
            result["document"] = {"text": req.documents[index]}
        results.append(result)
    return {
        "id": request_id,
        "model": model_name,
        "results": results,
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }


def score_body(scores, model_name: str, num_prompt_tokens: int, request_id: str, created: int) -> dict:
    return {
        "id": request_id,
        "object": "list",
        "created": created,
        "model": model_name,
        "data": [{"index": i, "object": "score", "score": float(s)} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_prompt_tokens, "total_tokens": num_prompt_tokens},
    }


def result(call):
    """Wait for an EmbedCall's values; engine errors come out as APIErrors."""
    try:
        return call.result()
    except Exception as exc:
        raise from_exception(exc) from None


async def aresult(call):
    try:
        return await call.aresult()
    except Exception as exc:
        raise from_exception(exc) from None


# ----- whole requests: body -> response dict (raise APIError); sync for Flask, async for Ray replicas


def _new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def _start(engine, body: dict, kind: str):
    if kind == "embeddings":
        req = parse_embeddings(body)
        return req, submit_embeddings(engine, req)
    req = parse_rerank(body) if kind == "rerank" else parse_score(body)
    return req, submit_scores(engine, req, "documents" if kind == "rerank" else "text_2")


def _body(kind: str, req, values, model_name: str, num_tokens: int) -> dict:
    if kind == "embeddings":
        return embeddings_body(req, values, model_name, num_tokens)
    if kind == "rerank":
        return rerank_body(req, values, model_name, num_tokens, _new_id("rerank"))
    return score_body(values, model_name, num_tokens, _new_id("score"), int(time.time()))


def respond(engine, body: dict, kind: str, model_name: str) -> dict:
    """``kind``: "embeddings" | "rerank" | "score"."""
    req, call = _start(engine, body, kind)
    return _body(kind, req, result(call), model_name, call.num_prompt_tokens)


async def arespond(engine, body: dict, kind: str, model_name: str) -> dict:
    req, call = _start(engine, body, kind)
    return _body(kind, req, await aresult(call), model_name, call.num_prompt_tokens)
