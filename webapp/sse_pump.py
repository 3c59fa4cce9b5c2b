"""One writer thread for every SSE stream of a server: a tick's chunks in one wake-up.

A streamed request's handler thread waits for its first event and writes it (the response's
headers go out with it), then hands the rest of the stream to the engine's pump and sleeps
until the stream ends. The engine thread wakes the pump once after each tick
(EngineCore.add_tick_listener); the pump then drains what every stream queued
(``ready_events``, no lock), serializes it with the request's own ChunkWriter (the same
``webapp.sse`` chunks as the handler would write, byte for byte) and sends it on the
connection. So a tick of B streams costs one thread wake-up, not B: the handler threads'
per-token wake-ups and the GIL hand-offs between them and the engine thread were most of a
stream's host cost over HTTP (benchmarks/host_path.py).

The pump never blocks on a client: a connection with more than ``BACKLOG_BYTES`` not yet taken
by its socket is skipped until it drains (its events wait on their queue and go out together),
so a slow reader delays only itself. A disconnect, a failed write or an error in one stream
ends that stream alone (the handler's ``finally`` aborts the request), never the pump or the
other streams. Only waitress's handler threads hand off (``webapp.wsgi``: the task is in the
WSGI environ); any other server keeps the per-handler loop of ``webapp.sse.stream_chunks``.
"""
from __future__ import annotations

import logging
import threading
import weakref

from engine.core.pacing import pace

from .sse import end_chunk, error_end, events_chunk

log = logging.getLogger("webapp")

SSE_TASK_KEY = "webapp.sse_task"  # a waitress request's task in its WSGI environ (webapp.wsgi)
BACKLOG_BYTES = 1 << 20  # bytes a connection may hold unsent before the pump skips it
IDLE_WAIT_S = 0.05  # the pump's longest sleep with streams attached (ends seen outside ticks)

_PUMPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its pump (SSEPump.for_engine)
_PUMPS_LOCK = threading.Lock()  # two handlers' first streams make one pump


class Handoff:
    """A stream the pump writes; ``done`` is set once it has ended (``status``: ok, error, abort)."""

    __slots__ = ("stream", "writer", "record", "include_usage", "opening", "send", "backlog", "is_disconnected",
                 "done", "status", "is_pumped")

    def __init__(self, stream, writer, record, include_usage, opening, send, backlog, is_disconnected):
        self.stream, self.writer, self.record = stream, writer, record
        self.include_usage, self.opening = include_usage, opening
        self.send = send  # bytes -> None (frames and writes one chunk; raises on a disconnect)
        self.backlog = backlog  # () -> bytes the connection holds unsent
        self.is_disconnected = is_disconnected
        self.done = threading.Event()
        self.status = "abort"
        self.is_pumped = _never  # () -> whether the pump thread still runs (SSEPump.hand_off sets it)

    def pump(self) -> bool:
        """Write what queued; True once the stream has ended (then ``done`` is set)."""
        stream = self.stream
        try:
            if self.backlog() > BACKLOG_BYTES:
                return False
            events = stream.ready_events()
            if events:
                self.send(events_chunk(self.writer, events, self.record, self.opening))
            err = stream.take_error()
            if err is not None:  # the engine failed mid-stream: tell the client in-band, then end
                log.error("stream failed: %s", err)
                self.status = "error"
                self.send(error_end(err))
            elif stream.is_drained:
                self.send(end_chunk(self.writer, self.record, self.include_usage))
                self.status = "ok"
            elif events and events[-1].finish_reason is None and self.is_disconnected():
                self.status = "abort"
            else:
                return False
        except Exception as exc:  # a disconnect (waitress raises in its write) or a failed chunk
            if self.status != "error":
                self.status = "abort" if self.is_disconnected() or _is_disconnect(exc) else "error"
            if self.status == "error":
                log.exception("stream failed")
                try:
                    self.send(error_end(exc))
                except Exception:
                    pass
        self.done.set()
        return True


def _never() -> bool:
    return False


def _is_disconnect(exc: BaseException) -> bool:
    """A socket's error, or what waitress raises from a write to a connection its client closed
    (imported here, on a failed write: ``import webapp`` loads no server until it serves)."""
    if isinstance(exc, OSError):
        return True
    try:
        from waitress.channel import ClientDisconnected
    except ImportError:
        return False
    return isinstance(exc, ClientDisconnected)


class SSEPump:
    """The writer thread of one engine's streams (``for_engine``)."""

    def __init__(self, num_running=lambda: 2, events_due=lambda: 0.0):
        self._num_running = num_running  # () -> sequences the engine runs (read without a lock)
        self._events_due = events_due  # EngineCore.events_due
        self.num_streams = 0  # streams attached (written by the pump thread, read by any)
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _new (handlers append, the pump takes)
        self._new: list[Handoff] = []
        self._thread: threading.Thread | None = None
        self.num_handed_off = 0  # streams handed to this pump (tests; read without the lock)

    @classmethod
    def for_engine(cls, engine) -> SSEPump | None:
        """The engine's pump (made once, woken after each of its ticks); None for an engine without
        tick listeners."""
        pump = _PUMPS.get(engine)
        if pump is not None:
            return pump
        core = getattr(engine, "_core", None)
        if core is None or not hasattr(core, "add_tick_listener"):
            return None
        with _PUMPS_LOCK:
            pump = _PUMPS.get(engine)
            if pump is None:
                pump = cls(lambda: len(core.scheduler.running), core.events_due)
                core.add_tick_listener(pump._wake.set)
                _PUMPS[engine] = pump
        return pump

    def hand_off(self, handoff: Handoff) -> Handoff:
        handoff.is_pumped = self.is_alive
        with self._lock:
            self._new.append(handoff)
            self.num_handed_off += 1
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="sse-pump", daemon=True)
                self._thread.start()
        self._wake.set()
        return handoff

    def is_worth_it(self) -> bool:
        """Whether a stream should go to the pump: it already writes others, or the engine runs
        more than one sequence. A lone stream stays on its handler thread: one wake-up per token
        either way, and the hand-off's extra work then only adds to it."""
        return self.num_streams > 0 or self._num_running() > 1

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        streams: list[Handoff] = []
        wake = self._wake

        def not_woken() -> bool:
            return not wake.is_set()

        while True:
            with self._lock:
                if self._new:
                    streams.extend(self._new)
                    self._new.clear()
                elif not streams:  # idle: the next hand_off starts a new thread
                    self._thread = None
                    self.num_streams = 0
                    return
            pace(self._events_due, not_woken)  # paced by the ticks (engine/core/pacing.py), else woken by them
            wake.wait(IDLE_WAIT_S)
            wake.clear()
            self.num_streams = len(streams)
            ended = [h for h in streams if h.pump()]  # every stream, each time
            if ended:
                streams = [h for h in streams if not h.done.is_set()]
                self.num_streams = len(streams)


def hand_off_for(pump: SSEPump | None, environ, is_disconnected):
    """``stream_chunks``' hand_off for a request served by webapp.wsgi's waitress task, else None."""
    task = environ.get(SSE_TASK_KEY)
    if pump is None or task is None:
        return None

    def hand_off(stream, writer, record, include_usage, opening) -> Handoff | None:
        if not pump.is_worth_it():
            return None
        return pump.hand_off(Handoff(stream, writer, record, include_usage, opening, task.write, task.backlog,
                                     is_disconnected))

    return hand_off
