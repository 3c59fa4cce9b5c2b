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

from .errors import from_exception
from .metrics import RequestRecord, ServerMetrics

log = logging.getLogger("webapp")


def error_event(exc: BaseException) -> bytes:
    """An SSE error event for a failure after the 200 headers went out (the openai client raises it)."""
    return b"data: " + from_exception(exc).body() + b"\n\n"


def _never() -> bool:
    return False


def stream_chunks(
    stream,
    writer: ChunkWriter,
    record: RequestRecord,
    metrics: ServerMetrics,
    include_usage: bool,
    is_disconnected: Callable[[], bool] = _never,
    echo_texts: list[str] | None = None,
    opening: Callable[[int], bytes] | None = None,
) -> Iterator[bytes]:
    """``echo_texts``: per choice, the prompt text sent as its first chunk (completions' echo).
    ``opening(index)``: the chunk sent just before a choice's first event (echo with logprobs,
    prompt_logprobs: webapp.prompt_echo)."""
    status = "abort"
    opened: set[int] = set()

    def event_chunk(event) -> bytes:
        head = b""
        if opening is not None and event.index not in opened:  # first: it moves the writer's offsets
            opened.add(event.index)
            head = opening(event.index)
        return head + writer.event(event.text, event.logprobs, event.finish_reason, event.index)

    try:
        if echo_texts:
            yield b"".join(writer.event(text, None, None, index) for index, text in enumerate(echo_texts))
        for event in stream:
            chunk = event_chunk(event)
            if event.token_ids:
                record.tokens(len(event.token_ids))
            if event.finish_reason is not None:
                record.finish_reasons.append(event.finish_reason)
            later = stream.ready_events()  # queued meanwhile: sent in the same write
            if later:
                parts = [chunk]
                for event in later:
                    parts.append(event_chunk(event))
                    if event.token_ids:
                        record.tokens(len(event.token_ids))
                    if event.finish_reason is not None:
                        record.finish_reasons.append(event.finish_reason)
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
        record.queue_s = stream.queue_time
        metrics.finish(record, status)


def collect(stream, record: RequestRecord, metrics: ServerMetrics,
            is_disconnected: Callable[[], bool] = _never):
    """Runs a request to the end with the engine's fold (``RequestStream.collect_choices``), timing
    its tokens: the Completion of each choice, or None if the client went away first (the request
    is aborted). Engine failures become APIErrors."""
    left = []  # set when the client went away

    def on_event(event) -> bool:
        if event.token_ids:
            record.tokens(len(event.token_ids))
        if event.finish_reason is not None:
            record.finish_reasons.append(event.finish_reason)
        if event.finish_reason is None and is_disconnected():
            left.append(True)
            return True
        return False

    status = "error"
    try:
        done = stream.collect_choices(on_event)
        status = "abort" if left else "ok"
    except Exception as exc:
        raise from_exception(exc) from None
    finally:
        record.queue_s = stream.queue_time
        metrics.finish(record, status)
    return None if left else done
