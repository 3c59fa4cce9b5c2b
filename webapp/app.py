"""The Flask app: ``create_app(engine)`` (served by webapp.wsgi's waitress server).

A request's path: the handler thread parses and validates the body (webapp.protocol),
then takes the engine's own prompt path (``engine.stream_chat`` / ``engine.submit_batch``: the
template and the tokenizer run on this thread, GIL released) and, for ``stream: true``,
returns a generator response that writes each event as one SSE chunk (webapp.sse,
cext.chunk) the moment it arrives; otherwise it folds the events with the engine's
``RequestStream.collect``. Engine exceptions map to HTTP errors in one table
(``webapp.errors.from_exception``).
"""
from __future__ import annotations

import json
import logging
import time

from flask import Flask, Response, request, send_from_directory
from werkzeug.exceptions import HTTPException

from cext.chunk import ChunkWriter

from . import (
    cors,
    embeddings,
    errors,
    generation,
    prompt_echo,
    protocol,
    request_fields,
    response_objects,
    responses,
    sse,
    sse_pump,
)
from . import infill as infill_api
from .errors import APIError
from .metrics import RequestRecord, ServerMetrics
from .response_store import ResponseStore
from .shared import (
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_THREADS,
    GENERATION_ENDPOINTS,
    RESERVED_THREADS,
    STATIC_DIR,
    version,
)

log = logging.getLogger("webapp")

JSON_MIMETYPE = "application/json"


def _json(obj, status: int = 200) -> Response:
    return Response(json.dumps(obj, allow_nan=False), status=status, mimetype=JSON_MIMETYPE)


class _SSEBody:
    """A streamed response's WSGI iterable: the server iterates the body generator itself, and
    close() is the response's (the generator's finally, then the on-close callbacks)."""

    __slots__ = ("_body", "close")

    def __init__(self, body, close):
        self._body = body
        self.close = close

    def __iter__(self):
        return iter(self._body)


class _SSEResponse(Response):
    """A stream of SSE bytes: werkzeug's iterator (a str check and a frame per chunk) is left out."""

    def get_app_iter(self, environ):
        return _SSEBody(self.response, self.close)


def _never_disconnected() -> bool:  # a WSGI server other than waitress: no disconnect check
    return False


def _error_response(err: APIError) -> Response:
    response = Response(err.body(), status=err.status, mimetype=JSON_MIMETYPE)
    for name, value in err.headers.items():
        response.headers[name] = value
    return response


def create_app(engine, model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_concurrent_requests: int = DEFAULT_THREADS - RESERVED_THREADS,
               allowed_origins: list[str] | None = None):
    """A Flask app serving ``engine``. ``api_key`` set: /v1/* needs ``Authorization: Bearer <key>``.

    ``max_concurrent_requests`` bounds the generation requests in flight (streamed or not);
    one more gets 429 with Retry-After at once instead of waiting for a handler thread.
    ``allowed_origins`` (off by default): browser origins that may call the API (CORS; "*": any).
    """
    admission = generation.Admission(max_concurrent_requests)
    app = Flask(__name__, static_folder=None)
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    model_name = model_name or getattr(engine, "model_name", None) or "default"
    metrics = ServerMetrics(engine, model_name)
    pump = sse_pump.SSEPump.for_engine(engine)  # the streams' writer thread (waitress only)
    app.extensions["llm_engine"] = engine
    app.extensions["llm_metrics"] = metrics
    store = app.extensions["llm_responses"] = ResponseStore()  # POST /v1/responses with store
    tokenizer = engine.tokenizer
    max_model_len = getattr(engine, "max_model_len", None)
    expected_auth = generation.expected_authorization(api_key)

    def _counted(err: APIError) -> Response:
        endpoint = GENERATION_ENDPOINTS.get(request.path)
        if endpoint is not None:  # every rejected generation request counts, parse errors included
            metrics.count(endpoint, f"http_{err.status}")
        return _error_response(err)

    @app.errorhandler(APIError)
    def _api_error(err: APIError):
        return _counted(err)

    @app.errorhandler(HTTPException)
    def _http_error(err: HTTPException):
        return _counted(errors.from_http_status(err.code or 500, err.description or err.name))

    @app.errorhandler(Exception)
    def _unexpected(err: Exception):
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _counted(errors.internal_error())

    if allowed_origins:
        cors.install(app, allowed_origins)

    @app.before_request
    def _check_api_key():
        authorization = request.headers.get("Authorization")
        generation.check_api_key(expected_auth, request.path, request.method, authorization)

    @app.get("/")
    def index():
        return send_from_directory(STATIC_DIR, "index.html")

    @app.get("/static/<path:name>")
    def static_file(name: str):
        return send_from_directory(STATIC_DIR, name)

    @app.get("/health")
    def health():
        if not engine.is_alive():
            raise errors.engine_dead()
        return _json({"status": "ok"})

    @app.get("/metrics")
    def metrics_endpoint():
        return Response(metrics.render(), mimetype="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    def models():
        return _json(generation.models_body(model_name, max_model_len))

    @app.post("/tokenize")
    def tokenize():
        return _json(generation.tokenize_body(tokenizer, _read_body(), max_model_len))

    @app.post("/detokenize")
    def detokenize():
        return _json(generation.detokenize_body(tokenizer, _read_body()))

    @app.get("/version")
    def version_endpoint():
        return _json({"version": version()})

    @app.get("/v1/schema")
    def schema():
        return _json({name: request_fields.json_schema(name) for name in request_fields.ENDPOINTS})

    @app.post("/v1/chat/completions")
    def chat_completions():
        return _limited(lambda: _generate(protocol.parse_chat(_read_body()), "chat"))

    @app.post("/v1/completions")
    def completions():
        return _limited(lambda: _generate(protocol.parse_completion(_read_body()), "completions"))

    @app.post("/infill")
    def infill():
        return _limited(lambda: _infill(infill_api.parse_infill(_read_body())))

    @app.post("/v1/responses")
    def create_response():
        return _limited(lambda: _respond(responses.parse_responses(_read_body(), store)))

    @app.get("/v1/responses/<response_id>")
    def get_response(response_id: str):
        responses.check_no_query(request.args)
        entry = store.get(response_id)
        if entry is None:
            raise responses.response_not_found(response_id)
        return _json(entry.body)

    @app.delete("/v1/responses/<response_id>")
    def delete_response(response_id: str):
        if not store.delete(response_id):
            raise responses.response_not_found(response_id)
        return _json(responses.deleted_body(response_id))

    # ----- embeddings and scores (webapp.embeddings; the forwards run between the engine's ticks) -----
    def _scores_route(kind: str):
        return lambda: _limited(lambda: _json(embeddings.respond(engine, _read_body(), kind, model_name)))

    app.add_url_rule("/v1/embeddings", "embeddings", _scores_route("embeddings"), methods=["POST"])
    for path in embeddings.RERANK_PATHS:
        app.add_url_rule(path, f"rerank:{path}", _scores_route("rerank"), methods=["POST"])
    for path in embeddings.SCORE_PATHS:
        app.add_url_rule(path, f"score:{path}", _scores_route("score"), methods=["POST"])

    def _limited(handle) -> Response:
        """Run a generation request in one of the bounded slots, held until its response closes."""
        admission.enter()
        try:
            response = handle()
        except BaseException:
            admission.leave()
            raise
        response.call_on_close(admission.leave)
        return response

    def _read_body() -> dict:
        return protocol.decode_body(request.get_data(cache=False))

    def _generate(req: protocol.ParsedRequest, endpoint: str):
        record = RequestRecord(endpoint, 0)  # the clock starts before templating
        stream = generation.submit(engine, req)
        record.num_prompt_tokens = generation.num_prompt_tokens(stream, req.params.n)
        request_id = generation.response_id(req, stream.request_id)
        created = int(time.time())
        is_disconnected = request.environ.get("waitress.client_disconnected") or _never_disconnected
        echo_texts = generation.echo_texts(tokenizer, req)
        if req.is_stream:
            writer = ChunkWriter(request_id, model_name, created, req.is_chat, req.include_usage)
            opening = None
            if prompt_echo.OpeningChunks.is_needed(req):  # sent with each choice's first event
                opening = prompt_echo.OpeningChunks(req, stream, writer, tokenizer, echo_texts)
                echo_texts = None
            body = sse.stream_chunks(stream, writer, record, metrics, req.include_usage, is_disconnected,
                                     echo_texts, opening, sse_pump.hand_off_for(pump, request.environ, is_disconnected))
            return _SSEResponse(body, mimetype="text/event-stream", headers=sse.STREAM_HEADERS)
        done = sse.collect(stream, record, metrics, is_disconnected)
        if done is None:
            return Response(status=499)
        body = generation.response_body(req, request_id, model_name, created, done, echo_texts, tokenizer)
        return _json(body)

    def _infill(req: protocol.ParsedRequest) -> Response:
        record = RequestRecord("infill", 0)
        stream = generation.submit(engine, req)
        record.num_prompt_tokens = num_prompt = generation.num_prompt_tokens(stream, 1)
        is_disconnected = request.environ.get("waitress.client_disconnected") or _never_disconnected
        if req.is_stream:
            body = infill_api.stream_chunks(stream, record, metrics, is_disconnected, num_prompt)
            return _SSEResponse(body, mimetype="text/event-stream", headers=sse.STREAM_HEADERS)
        done = sse.collect(stream, record, metrics, is_disconnected)
        if done is None:
            return Response(status=499)
        return _json(infill_api.infill_body(done[0], num_prompt, model_name))

    def _respond(req: responses.ResponsesRequest) -> Response:
        record = RequestRecord("responses", 0)
        stream = responses.submit(engine, req)
        record.num_prompt_tokens = generation.num_prompt_tokens(stream, 1)
        response_id = responses.RESPONSE_ID_PREFIX + stream.request_id
        created = int(time.time())
        is_disconnected = request.environ.get("waitress.client_disconnected") or _never_disconnected
        if req.chat.is_stream:
            events = response_objects.ResponseEvents(req, store, response_id, model_name, created)
            body = response_objects.stream_events(stream, events, record, metrics, is_disconnected)
            return _SSEResponse(body, mimetype="text/event-stream", headers=sse.STREAM_HEADERS)
        done = sse.collect(stream, record, metrics, is_disconnected)
        if done is None:
            return Response(status=499)
        return _json(response_objects.response_body(req, store, response_id, model_name, created, done[0],
                                                    record.num_prompt_tokens))

    return app
