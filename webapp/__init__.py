"""The OpenAI-compatible HTTP server: ``create_app(engine)`` and ``serve(engine)``.

A request's path: the handler thread parses and validates the body (webapp.protocol),
then takes the engine's own prompt path (``engine.stream_chat`` / ``engine.submit_batch``: the
template and the tokenizer run on this thread, GIL released) and, for ``stream: true``,
returns a generator response that writes each event as one SSE chunk (webapp.sse,
cext.chunk) the moment it arrives; otherwise it folds the events with the engine's
``RequestStream.collect``. Engine exceptions map to HTTP errors in one table
(``webapp.errors.from_exception``).
"""
from __future__ import annotations

import logging
import os
import time

from flask import Flask, Response, request, send_from_directory
from werkzeug.exceptions import HTTPException

from cext.chunk import ChunkWriter
from . import cors, errors, generation, prompt_echo, protocol, request_fields, sse
from .errors import APIError
from .metrics import RequestRecord, ServerMetrics

log = logging.getLogger("webapp")

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_THREADS = 64
# Handler threads kept free of generation requests, so /health, /metrics, /v1/models and the
# 429 answers themselves always find a thread (benchmarks/overload.py measures the probe latency).
RESERVED_THREADS = 8
GENERATION_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
_JSON = "application/json"


def _json(obj, status: int = 200) -> Response:
    import json

    return Response(json.dumps(obj, allow_nan=False), status=status, mimetype=_JSON)


def _error_response(err: APIError) -> Response:
    response = Response(err.body(), status=err.status, mimetype=_JSON)
    for name, value in err.headers.items():
        response.headers[name] = value
    return response


def _version() -> str:
    import importlib.metadata

    import engine as engine_package

    try:
        return importlib.metadata.version("llm-engine")
    except importlib.metadata.PackageNotFoundError:
        return getattr(engine_package, "__version__", "0+unknown")


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
    app.extensions["llm_engine"] = engine
    app.extensions["llm_metrics"] = metrics
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
        generation.check_api_key(expected_auth, request.path, request.method, request.headers.get("Authorization"))

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
    def version():
        return _json({"version": _version()})

    @app.get("/v1/schema")
    def schema():
        return _json({endpoint: request_fields.json_schema(endpoint)
                      for endpoint in (request_fields.CHAT, request_fields.COMPLETIONS)})

    @app.post("/v1/chat/completions")
    def chat_completions():
        return _limited(lambda: _generate(protocol.parse_chat(_read_body()), "chat"))

    @app.post("/v1/completions")
    def completions():
        return _limited(lambda: _generate(protocol.parse_completion(_read_body()), "completions"))

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
        is_disconnected = request.environ.get("waitress.client_disconnected") or sse._never
        echo_texts = generation.echo_texts(tokenizer, req)
        if req.is_stream:
            writer = ChunkWriter(request_id, model_name, created, req.is_chat, req.include_usage)
            opening = None
            if prompt_echo.OpeningChunks.is_needed(req):  # sent with each choice's first event
                opening, echo_texts = prompt_echo.OpeningChunks(req, stream, writer, tokenizer, echo_texts), None
            body = sse.stream_chunks(stream, writer, record, metrics, req.include_usage, is_disconnected,
                                     echo_texts, opening)
            return Response(body, mimetype="text/event-stream", headers=sse.STREAM_HEADERS)
        done = sse.collect(stream, record, metrics, is_disconnected)
        if done is None:
            return Response(status=499)
        return _json(generation.response_body(req, request_id, model_name, created, done, echo_texts, tokenizer))

    return app


# Connection limits of the WSGI server (documented in the README, "Limits"). A connection that
# sends nothing for CHANNEL_TIMEOUT_S while no request of it is running (headers never finished,
# an idle keep-alive) is closed; the check runs every CLEANUP_INTERVAL_S. CONNECTION_LIMIT open
# sockets (each one file descriptor) are accepted before new ones wait in the listen backlog.
CHANNEL_TIMEOUT_S = 10
CLEANUP_INTERVAL_S = 2
CONNECTION_LIMIT = 2000
# Bodies past max_body_bytes get Flask's JSON 413 without being read; past this many bytes the
# WSGI server itself refuses (still JSON, via _JSONErrorChannel) before buffering them.
MAX_REQUEST_BODY_BYTES = 64 << 20


def _json_error_channel():
    """A waitress channel whose own errors (413 past MAX_REQUEST_BODY_BYTES, malformed HTTP) are
    OpenAI-style JSON like every other error of this server."""
    from waitress.channel import HTTPChannel
    from waitress.task import ErrorTask

    class _JSONErrorTask(ErrorTask):
        def execute(self):
            error = self.request.error
            body = errors.from_http_status(error.code, f"{error.reason}: {error.body}").body()
            self.status = f"{error.code} {error.reason}"
            self.response_headers.append(("Content-Type", _JSON))
            self.set_close_on_finish()
            self.content_length = len(body)
            self.write(body)

    class _JSONErrorChannel(HTTPChannel):
        error_task_class = _JSONErrorTask

    return _JSONErrorChannel


def make_server(engine, host: str = "127.0.0.1", port: int = 0, threads: int = DEFAULT_THREADS,
                max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_concurrent_requests: int | None = None,
                channel_timeout: int = CHANNEL_TIMEOUT_S, sock=None, **app_options):
    """A waitress server bound now (port 0: a free one); ``.run()`` serves, ``.close()`` stops.

    ``sock``: a socket already bound (engine.startup.bind_listen_socket, taken before the model
    loaded); host and port are then ignored.

    ``server.effective_port`` is the bound port. ``threads`` handler threads serve requests;
    at most ``max_concurrent_requests`` (default: threads - RESERVED_THREADS) of them run
    generation requests, one more gets 429 at once, so health probes and metrics scrapes always
    find a free thread under overload.

    Why waitress (measured in benchmarks/serving.py, section "wsgi"): it costs ~10-20 us per
    SSE chunk, on par with cheroot (which was slower at 8 streams in our runs), is already
    pinned, serves from threads in this process (one engine, one continuous batch; gunicorn's
    pre-fork workers would each need their own engine and split the batch), sends every write at
    once (waitress 3 defaults to send_bytes=1), and with channel_request_lookahead it keeps
    reading the socket, so a client that leaves is noticed at the next chunk.
    """
    import waitress.server

    if not isinstance(threads, int) or threads <= RESERVED_THREADS:
        raise ValueError(f"threads must be an integer > {RESERVED_THREADS} (the threads kept for probes), "
                         f"got {threads!r}")
    if max_concurrent_requests is None:
        max_concurrent_requests = threads - RESERVED_THREADS
    app = create_app(engine, max_body_bytes=max_body_bytes, max_concurrent_requests=max_concurrent_requests,
                     **app_options)
    _raise_open_file_limit(CONNECTION_LIMIT + 256)
    where = {"sockets": [sock]} if sock is not None else {"host": host, "port": port}
    server = waitress.server.create_server(
        app,
        **where,
        threads=threads,
        channel_request_lookahead=1,  # keep reading the socket: notice disconnects mid-stream
        # waitress 3 defaults to send_bytes=1: each SSE chunk is sent from the handler thread at once
        max_request_body_size=max(MAX_REQUEST_BODY_BYTES, max_body_bytes),
        connection_limit=CONNECTION_LIMIT,
        channel_timeout=channel_timeout,
        cleanup_interval=min(CLEANUP_INTERVAL_S, channel_timeout),
        ident="llm-engine",
    )
    server.channel_class = _json_error_channel()
    return server


def _raise_open_file_limit(wanted: int) -> None:
    """Each connection is a file descriptor: lift the soft limit toward ``wanted`` (never above the hard one)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):  # not POSIX, or not allowed: keep the limit
        pass


def serve(engine, host: str = "127.0.0.1", port: int = 8000, sock=None, **options) -> None:
    """Serve ``engine`` on host:port with the production WSGI server (waitress); blocks.

    ``sock``: serve on this bound socket instead of binding host:port (python -m webapp binds
    it before the model loads). options: api_key, model_name, threads, max_body_bytes,
    max_concurrent_requests, allowed_origins.
    """
    server = make_server(engine, host, port, sock=sock, **options)
    if sock is not None:
        host = sock.getsockname()[0]
    log.warning("serving on http://%s:%s", host, server.effective_port)
    try:
        server.run()
    finally:
        server.close()


__all__ = ["create_app", "serve", "make_server"]
