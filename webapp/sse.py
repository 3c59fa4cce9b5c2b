"""Server-sent events: one request's StreamEvents -> SSE chunks, written as they arrive.

The per-token path of a streamed request is: ``next(stream)`` (the engine's one queue
get) -> ``ChunkWriter.event`` (escape into the request's reused buffer) -> ``yield`` to
the WSGI server, which writes it to the socket at once (waitress: its default send_bytes=1 flushes every write).
Events that queued up while the handler was busy (``stream.ready_events()``, no lock) are
written with it in one chunk: a handler that falls behind catches up with one send.
No lock is taken here; metrics are folded in once, when the request ends.

Disconnects: the WSGI server raises inside its write, then closes this generator; the
``finally`` closes the engine stream, which aborts the request and frees its KV blocks.
The disconnect check between events (``is_disconnected``) catches a client that left
while the request was waiting, within one tick of the next event.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import logging

from cext.chunk import DONE, ChunkWriter

from .errors import APIError, engine_dead, internal_error
from .metrics import RequestRecord, ServerMetrics

log = logging.getLogger("webapp")


def error_event(exc: BaseException) -> bytes:
    """An SSE error event for a failure after the 200 headers went out (the openai client raises it)."""
    import engine

    if isinstance(exc, APIError):
        err = exc
    elif isinstance(exc, engine.EngineDead):
        err = engine_dead()
    elif isinstance(exc, engine.EngineError):  # its message names the request and the cause, no traceback
        err = APIError(500, str(exc), type="server_error", code="engine_error")
    else:
        err = internal_error()
    return b"data: " + err.body() + b"\n\n"


def _never() -> bool:
    return False


def stream_chunks(
    stream,
    writer: ChunkWriter,
    record: RequestRecord,
    metrics: ServerMetrics,
    include_usage: bool,
    is_disconnected: Callable[[], bool] = _never,
) -> Iterator[bytes]:
    status = "abort"
    try:
        for event in stream:
            chunk = writer.event(event.text, event.logprobs, event.finish_reason)
            if event.token_ids:
                record.tokens(len(event.token_ids))
            later = stream.ready_events()  # queued meanwhile: sent in the same write
            if later:
                parts = [chunk]
                for event in later:
                    parts.append(writer.event(event.text, event.logprobs, event.finish_reason))
                    if event.token_ids:
                        record.tokens(len(event.token_ids))
                chunk = b"".join(parts)
            yield chunk
            if event.finish_reason is None and is_disconnected():
                return
        if include_usage:
            yield writer.usage(record.num_prompt_tokens, record.num_generated)
        yield DONE
        status = "ok"
    except Exception as exc:  # the engine failed mid-stream: tell the client in-band, then end
        status = "error"
        log.exception("stream failed")
        yield error_event(exc)
        yield DONE
    finally:
        stream.close()  # aborts the request if it is still running
        metrics.finish(record, status)


class Collected:
    """A whole non-streamed answer, built from the same events as a stream."""

    __slots__ = ("text", "token_ids", "logprobs", "finish_reason", "usage")

    def __init__(self, text, token_ids, logprobs, finish_reason, usage):
        self.text = text
        self.token_ids = token_ids
        self.logprobs = logprobs
        self.finish_reason = finish_reason
        self.usage = usage


class _Usage:
    __slots__ = ("prompt_tokens", "completion_tokens")

    def __init__(self, prompt_tokens: int, completion_tokens: int):
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens


def collect(stream, record: RequestRecord, metrics: ServerMetrics,
            is_disconnected: Callable[[], bool] = _never) -> Collected | None:
    """Runs a request to the end; None if the client went away first (the request is aborted)."""
    texts: list[str] = []
    token_ids: list[int] = []
    logprobs = None
    finish_reason = None
    status = "abort"
    try:
        for event in stream:
            if event.token_ids:
                record.tokens(len(event.token_ids))
                token_ids.extend(event.token_ids)
            texts.append(event.text)
            if event.logprobs is not None:
                if logprobs is None:
                    logprobs = []
                logprobs.extend(event.logprobs)
            finish_reason = event.finish_reason or finish_reason
            if event.finish_reason is None and is_disconnected():
                return None
        status = "ok"
    except Exception:
        status = "error"
        raise
    finally:
        stream.close()
        metrics.finish(record, status)
    return Collected("".join(texts), token_ids, logprobs, finish_reason,
                     _Usage(record.num_prompt_tokens, len(token_ids)))
