"""The Ray Serve ingress: the single-process server's protocol as a Starlette (ASGI) app.

Every answer is built by the same functions as the Flask app, webapp.app (protocol, generation,
sse, errors, metrics, shared); only the transport differs: the engine is reached through a
DeploymentHandle to the EngineReplica deployment (webapp.ray_serve), whose replicas stream a
StreamHead and then batches of StreamEvents. A streamed request's path:

    parse (protocol) -> admission (429) -> handle.generate (routed by webapp.ray_router)
    -> first item: StreamHead (200 + SSE) or an APIError (its status) -> per batch
    sse.events_chunk -> sse.end_chunk, or sse.error_end when the replica died mid-stream.

Failures: a replica that dies before its first item is retried once on another replica; one
that dies mid-stream ends the stream with an in-band error (503 engine_dead in the error
body, then [DONE]), as the single-process server does when its engine thread dies. The
router's queue being full (max_queued_requests) is a 429 with Retry-After.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
import weakref

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, Response, StreamingResponse
from starlette.routing import Route

from cext.chunk import ChunkWriter
from engine.errors import EngineDead

from . import embeddings, errors, generation, infill, protocol, request_fields, response_objects, responses, sse
from .errors import APIError
from .metrics import RequestRecord, ServerMetrics
from .ray_messages import StreamEnd
from .response_objects import ResponseEvents
from .response_store import ResponseStore
from .shared import DEFAULT_MAX_BODY_BYTES, GENERATION_ENDPOINTS, STATIC_DIR, version

log = logging.getLogger("webapp")

HEALTH_TIMEOUT_S = 5.0


_routers: weakref.WeakSet = weakref.WeakSet()  # PrefixAffinityRouters of this process
_routers_lock = threading.Lock()


def register_router(router) -> None:
    with _routers_lock:
        _routers.add(router)


def routers() -> list:
    """The routers of this process (the ingress has one: its handle's, to the engine deployment)."""
    with _routers_lock:
        return list(_routers)


class ReplicaStatsView:
    """What ServerMetrics reads from an engine (``stats()``, ``is_alive()``), summed over the
    replicas the router knows, from the stats Ray polls (``EngineReplica.record_routing_stats``)."""

    def stats(self) -> dict:
        replica_stats = [s for router in routers() for s in router.replica_stats() if s]
        total: dict = {}
        for stats in replica_stats:
            for name, value in stats.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    total[name] = total.get(name, 0) + value
        if replica_stats:
            total["kv_usage"] = total.get("kv_usage", 0.0) / len(replica_stats)  # a fraction: the mean
        total["num_replicas"] = len(replica_stats)
        return total

    def is_alive(self) -> bool:
        return any(s.get("is_alive") for router in routers() for s in router.replica_stats())


def _json(obj, headers: dict | None = None) -> Response:
    """As the single-process server writes JSON (json.dumps, ASCII, no NaN)."""
    return Response(json.dumps(obj, allow_nan=False), media_type="application/json", headers=headers)


class _Once:
    """Ends a stream once, from its body's ``finally`` or when a body that never ran is collected:
    cancels the replica's stream (the request is aborted there) and frees the admission slot."""

    def __init__(self, response, admission: generation.Admission):
        self._parts: tuple | None = (response, admission)

    def __call__(self) -> None:
        parts, self._parts = self._parts, None
        if parts is not None:
            response, admission = parts
            response.cancel()
            admission.leave()


def _error_response(err: APIError) -> Response:
    return Response(err.body(), status_code=err.status, media_type="application/json", headers=err.headers)


def _replica_gone(exc: BaseException) -> EngineDead:
    return EngineDead(f"the engine replica serving this request stopped ({type(exc).__name__})")


def build_app(engine_handle, model_name: str = "default", api_key: str | None = None,
              max_concurrent_requests: int = 56, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Starlette:
    admission = generation.Admission(max_concurrent_requests)
    metrics = ServerMetrics(ReplicaStatsView(), model_name)
    expected_auth = generation.expected_authorization(api_key)
    stream_handle = engine_handle.options(stream=True)
    store = ResponseStore()  # /v1/responses' stored responses: in this (the one) ingress replica
    max_model_len: list[int | None] = []  # asked of a replica once

    async def read_body(request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
            raise errors.from_http_status(413, f"The request body exceeds {max_body_bytes} bytes.")
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > max_body_bytes:
                raise errors.from_http_status(413, f"The request body exceeds {max_body_bytes} bytes.")
        return protocol.decode_body(bytes(raw))

    def endpoint(path: str, handler):
        """Auth first; APIErrors (and anything unexpected) become OpenAI error bodies, counted.
        ``path`` is the route's own (the app may be mounted under a prefix)."""
        async def run(request: Request) -> Response:
            try:
                generation.check_api_key(expected_auth, path, request.method, request.headers.get("authorization"))
                return await handler(request)
            except Exception as exc:
                if not isinstance(exc, APIError):
                    log.exception("unhandled error in %s %s", request.method, path)
                err = errors.from_exception(exc)
                name = GENERATION_ENDPOINTS.get(path)
                if name is not None:
                    metrics.count(name, f"http_{err.status}")
                return _error_response(err)
        return run

    async def first_item(req):
        """Send the request to a replica and wait for its head; a replica that died first gets one retry."""
        for attempt in range(2):
            response = stream_handle.generate.remote(req)
            try:
                return response, await response.__anext__()
            except BackPressureError:
                raise errors.overloaded("every engine replica's queue is full") from None
            except DeploymentUnavailableError as exc:
                raise errors.from_exception(_replica_gone(exc)) from None
            except RayActorError as exc:
                if attempt == 1:
                    raise errors.from_exception(_replica_gone(exc)) from None
                log.warning("engine replica died before answering; retrying once: %s", exc)

    async def stream_body(response, writer, record, include_usage, echo_texts, release):
        status = "abort"
        try:
            if echo_texts:
                yield sse.echo_chunk(writer, echo_texts)
            async for item in response:
                if isinstance(item, StreamEnd):
                    record.queue_s = item.queue_s
                    continue
                if isinstance(item, APIError):  # the engine failed mid-stream
                    status = "error"
                    yield sse.error_end(item)
                    return
                yield sse.events_chunk(writer, item, record)
            yield sse.end_chunk(writer, record, include_usage)
            status = "ok"
        except (RayActorError, DeploymentUnavailableError) as exc:
            status = "error"
            log.warning("engine replica died mid-stream: %s", exc)
            yield sse.error_end(_replica_gone(exc))
        finally:
            release()
            metrics.finish(record, status)

    async def response_events_body(response, events: ResponseEvents, record, release):
        """A streamed /v1/responses request: the replica's event batches as typed Responses events."""
        status = "abort"
        try:
            yield events.opening()
            async for item in response:
                if isinstance(item, StreamEnd):
                    record.queue_s = item.queue_s
                    continue
                if isinstance(item, APIError):  # the engine failed mid-stream
                    status = "error"
                    yield events.failure(item)
                    return
                for event in item:
                    record.event(event)
                yield b"".join(events.add(event) for event in item)
            yield events.closing(record.num_prompt_tokens)[0]
            status = "ok"
        except (RayActorError, DeploymentUnavailableError) as exc:
            status = "error"
            log.warning("engine replica died mid-stream: %s", exc)
            yield events.failure(_replica_gone(exc))
        finally:
            release()
            metrics.finish(record, status)

    async def infill_body(response, record, release):
        """A streamed /infill request: one llama.cpp object per event (webapp.infill)."""
        status = "abort"
        try:
            async for item in response:
                if isinstance(item, StreamEnd):
                    record.queue_s = item.queue_s
                    continue
                if isinstance(item, APIError):
                    status = "error"
                    yield b"data: " + item.body() + b"\n\n"
                    return
                parts = []
                for event in item:
                    record.event(event)
                    parts.append(infill.event_chunk(event, record.num_generated, record.num_prompt_tokens))
                yield b"".join(parts)
            status = "ok"
        except (RayActorError, DeploymentUnavailableError) as exc:
            status = "error"
            log.warning("engine replica died mid-stream: %s", exc)
            yield b"data: " + errors.from_exception(_replica_gone(exc)).body() + b"\n\n"
        finally:
            release()
            metrics.finish(record, status)

    async def collect(response, record) -> list:
        """A non-streamed request's Completions (the replica's fold), its metrics folded in."""
        try:
            completions = await response.__anext__()
            end = await response.__anext__() if not isinstance(completions, APIError) else None
        except (RayActorError, DeploymentUnavailableError) as exc:
            metrics.finish(record, "error")
            raise errors.from_exception(_replica_gone(exc)) from None
        if isinstance(completions, APIError):
            metrics.finish(record, "error")
            raise completions
        record.queue_s = end.queue_s
        for c in completions:
            record.finish_reasons.append(c.finish_reason)
        record.tokens(sum(c.usage.completion_tokens for c in completions))
        metrics.finish(record, "ok")
        return completions

    async def generate(request: Request, endpoint_name: str, parse) -> Response:
        """Chat, completions, responses and /infill alike: a Responses request runs as its chat request
        (``req.chat``), /infill as a completion with a suffix; only the answers' shapes differ
        (webapp.response_objects, webapp.infill)."""
        admission.enter()
        is_admitted = True  # until the response body owns the slot
        try:
            record = RequestRecord(endpoint_name, 0)
            req = parse(await read_body(request))
            is_responses = isinstance(req, responses.ResponsesRequest)
            chat_req = req.chat if is_responses else req
            response, head = await first_item(chat_req)
            if isinstance(head, APIError):
                raise responses.renamed(head) if is_responses else head
            record.num_prompt_tokens = head.num_prompt_tokens
            request_id = (responses.RESPONSE_ID_PREFIX + head.request_id if is_responses
                          else generation.response_id(req, head.request_id))
            created = int(time.time())
            headers = {"X-Replica-Id": head.replica_id}
            if chat_req.is_stream:
                release = _Once(response, admission)
                if is_responses:
                    events = ResponseEvents(req, store, request_id, model_name, created)
                    body = response_events_body(response, events, record, release)
                elif endpoint_name == "infill":
                    body = infill_body(response, record, release)
                else:
                    writer = ChunkWriter(request_id, model_name, created, req.is_chat, req.include_usage)
                    body = stream_body(response, writer, record, req.include_usage, head.echo_texts, release)
                weakref.finalize(body, release)  # a body never started (the client left first) is dropped
                is_admitted = False
                return StreamingResponse(body, media_type="text/event-stream",
                                         headers={**sse.STREAM_HEADERS, **headers})
            completions = await collect(response, record)
            if is_responses:
                body = response_objects.response_body(req, store, request_id, model_name, created,
                                                      completions[0], record.num_prompt_tokens)
            elif endpoint_name == "infill":
                body = infill.infill_body(completions[0], record.num_prompt_tokens, model_name)
            else:
                body = generation.response_body(req, request_id, model_name, created, completions,
                                                head.echo_texts)
            return _json(body, headers)
        finally:
            if is_admitted:
                admission.leave()

    async def chat(request: Request) -> Response:
        return await generate(request, "chat", protocol.parse_chat)

    async def completions(request: Request) -> Response:
        return await generate(request, "completions", protocol.parse_completion)

    async def infill_endpoint(request: Request) -> Response:
        return await generate(request, "infill", infill.parse_infill)

    async def create_response(request: Request) -> Response:
        return await generate(request, "responses", lambda body: responses.parse_responses(body, store))

    async def get_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        responses.check_no_query(request.query_params)
        entry = store.get(response_id)
        if entry is None:
            raise responses.response_not_found(response_id)
        return _json(entry.body)

    async def delete_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not store.delete(response_id):
            raise responses.response_not_found(response_id)
        return _json(responses.deleted_body(response_id))

    async def health(request: Request) -> Response:
        try:
            is_alive = await asyncio.wait_for(_resolve(engine_handle.is_alive.remote()), HEALTH_TIMEOUT_S)
        except Exception:
            is_alive = False
        if not is_alive:
            raise errors.engine_dead()
        return _json({"status": "ok"})

    async def models(request: Request) -> Response:
        if not max_model_len:
            info = await engine_handle.info.remote()
            max_model_len.append(info["max_model_len"])
        return _json(generation.models_body(model_name, max_model_len[0]))

    async def tokenize(request: Request) -> Response:
        return _answer(await engine_handle.tokenize.remote(await read_body(request)))

    async def detokenize(request: Request) -> Response:
        return _answer(await engine_handle.detokenize.remote(await read_body(request)))

    def scores(kind: str):
        """/v1/embeddings, rerank and score: one call to a replica, in an admission slot."""
        async def handle(request: Request) -> Response:
            admission.enter()
            try:
                body = await read_body(request)
                try:
                    answer = await engine_handle.embeddings.remote(body, kind, model_name)
                except BackPressureError:
                    raise errors.overloaded("every engine replica's queue is full") from None
                except (RayActorError, DeploymentUnavailableError) as exc:
                    raise errors.from_exception(_replica_gone(exc)) from None
                return _answer(answer)
            finally:
                admission.leave()
        return handle

    async def metrics_endpoint(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def version_endpoint(request: Request) -> Response:
        return _json({"version": version()})

    async def schema(request: Request) -> Response:
        return _json({name: request_fields.json_schema(name) for name in request_fields.ENDPOINTS})

    async def index(request: Request) -> Response:
        return FileResponse(os.path.join(STATIC_DIR, "index.html"))

    async def static_file(request: Request) -> Response:
        name = os.path.normpath(request.path_params["name"])
        path = os.path.join(STATIC_DIR, name)
        if name.startswith("..") or not os.path.isfile(path):
            raise errors.from_http_status(404, "Not Found")
        return FileResponse(path)

    table = [
        ("/v1/chat/completions", "POST", chat),
        ("/v1/completions", "POST", completions),
        ("/v1/responses", "POST", create_response),
        ("/infill", "POST", infill_endpoint),
        ("/v1/responses/{response_id}", "GET", get_response),
        ("/v1/responses/{response_id}", "DELETE", delete_response),
        ("/v1/models", "GET", models),
        ("/health", "GET", health),
        ("/metrics", "GET", metrics_endpoint),
        ("/tokenize", "POST", tokenize),
        ("/detokenize", "POST", detokenize),
        ("/version", "GET", version_endpoint),
        ("/v1/schema", "GET", schema),
        ("/v1/embeddings", "POST", scores("embeddings")),
        *((path, "POST", scores("rerank")) for path in embeddings.RERANK_PATHS),
        *((path, "POST", scores("score")) for path in embeddings.SCORE_PATHS),
        ("/", "GET", index),
        ("/static/{name:path}", "GET", static_file),
    ]
    routes = [Route(path, endpoint(path, handler), methods=[method]) for path, method, handler in table]
    app = Starlette(routes=routes, exception_handlers={
        404: lambda request, exc: _error_response(errors.from_http_status(404, "Not Found")),
        405: lambda request, exc: _error_response(errors.from_http_status(405, "Method Not Allowed")),
    })
    app.state.metrics = metrics
    return app


def _answer(result) -> Response:
    if isinstance(result, APIError):
        raise result
    return _json(result)


async def _resolve(awaitable):
    return await awaitable
