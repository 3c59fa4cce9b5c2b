"""Server-sent events: one request's StreamEvents -> SSE chunks, written as they arrive.

The per-token path of a streamed request is: ``next(stream)`` (the engine's one queue
get) -> ``ChunkWriter.event`` (escape into the request's reused buffer) -> ``yield`` to
the WSGI server, which writes it to the socket at once (waitress: its default send_bytes=1 flushes every write).
Events that queued up while the handler was busy (``stream.ready_events()``, no lock) are
written with it in one chunk: a handler that falls behind catches up with one send.
No lock is taken here; metrics are folded in once, when the request ends. Under waitress
(webapp.wsgi) only the first chunk is written so: the rest of the stream goes to the engine's
one writer thread (webapp.sse_pump), which writes every stream's chunks of a tick in one
wake-up, with these same functions.

Disconnects: the WSGI server raises inside its write, then closes this generator; the
``finally`` closes the engine stream, which aborts the request and frees its KV blocks.
The disconnect check between events (``is_disconnected``) catches a client that left
while the request was waiting, within one tick of the next event.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator

from cext.chunk import DONE, ChunkWriter

from .errors import from_exception
from .metrics import RequestRecord, ServerMetrics

log = logging.getLogger("webapp")

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_event(exc: BaseException) -> bytes:
    """An SSE error event for a failure after the 200 headers went out (the openai client raises it)."""
    return b"data: " + from_exception(exc).body() + b"\n\n"


def delta_chunk(writer: ChunkWriter, event) -> bytes:
    """The chunk of an event with reasoning or tool call deltas (chat requests of a reasoning
    template or with tools only). The reasoning and content texts go through the serializer;
    tool call deltas are few and small, so they go through json.dumps."""
    deltas = None
    if event.tool_calls is not None:
        deltas = json.dumps([d.to_dict() for d in event.tool_calls], ensure_ascii=False).encode("utf-8", "replace")
    return writer.delta_event(event.text, event.reasoning_content, deltas, event.logprobs, event.finish_reason,
                              event.index)


def _never() -> bool:
    return False


# The bytes of a stream, in order: echo_chunk (completions' echo), events_chunk per batch of
# events, then end_chunk, or error_end after a failure. Both front-ends (the WSGI generator
# below, the Ray Serve ingress's async one) write exactly these.

def echo_chunk(writer: ChunkWriter, echo_texts: list[str]) -> bytes:
    """Per choice, the prompt text sent as its first chunk."""
    return b"".join(writer.event(text, None, None, index) for index, text in enumerate(echo_texts))


def events_chunk(writer: ChunkWriter, events, record: RequestRecord, opening=None) -> bytes:
    """Events that arrived together, as one write; their tokens and finish reasons go to ``record``.
    ``opening.first(index)``: the chunk that goes before a choice's first event (echo with logprobs,
    prompt_logprobs: webapp.prompt_echo.OpeningChunks), written first since it moves the writer's offsets."""
    parts = []
    for event in events:
        if opening is not None:
            parts.append(opening.first(event.index))
        parts.append(writer.event(event.text, event.logprobs, event.finish_reason, event.index)
                     if event.tool_calls is None and event.reasoning_content is None else delta_chunk(writer, event))
        if event.token_ids:
            record.tokens(len(event.token_ids))
        if event.finish_reason is not None:
            record.finish_reasons.append(event.finish_reason)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def end_chunk(writer: ChunkWriter, record: RequestRecord, include_usage: bool) -> bytes:
    """The usage chunk (stream_options.include_usage), then [DONE]."""
    if include_usage:
        return writer.usage(record.num_prompt_tokens, record.num_generated) + DONE
    return DONE


def error_end(exc: BaseException) -> bytes:
    """A failure mid-stream: the error event, then [DONE]."""
    return error_event(exc) + DONE


def stream_chunks(
    stream,
    writer: ChunkWriter,
    record: RequestRecord,
    metrics: ServerMetrics,
    include_usage: bool,
    is_disconnected: Callable[[], bool] = _never,
    echo_texts: list[str] | None = None,
    opening=None,
    hand_off: Callable | None = None,
) -> Iterator[bytes]:
    """``echo_texts``: per choice, the prompt text sent as its first chunk (completions' echo).
    ``opening``: see ``events_chunk``. ``hand_off(stream, writer, record, include_usage, opening)``:
    after a chunk went out, gives the rest of the stream to the server's writer thread
    (webapp.sse_pump) and returns its Handoff, whose end this generator then waits for, or None
    (asked again after the next chunk)."""
    status = "abort"
    try:
        if echo_texts:
            yield echo_chunk(writer, echo_texts)
        for event in stream:
            later = stream.ready_events()  # queued meanwhile: sent in the same write
            yield events_chunk(writer, [event, *later] if later else (event,), record, opening)
            if (later[-1] if later else event).finish_reason is None and is_disconnected():
                return
            if hand_off is not None and not stream.is_drained:
                handoff = hand_off(stream, writer, record, include_usage, opening)
                if handoff is None:  # declined (one stream alone): this thread writes on
                    continue
                while not handoff.done.wait(1.0):
                    if not handoff.is_pumped():  # the writer thread died: this thread goes on
                        hand_off = None
                        break
                else:
                    status = handoff.status
                    return
        yield end_chunk(writer, record, include_usage)
        status = "ok"
    except Exception as exc:  # the engine failed mid-stream: tell the client in-band, then end
        status = "error"
        log.exception("stream failed")
        yield error_end(exc)
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
