"""The output loop of a steady decode tick, run beside the next tick's forward.

A decode tick's critical path is forward -> sample -> update -> schedule -> forward; the output
loop (detokenizer, stop strings, one queue put per request: cext.emit) is not on it. When every
row of a decode-only tick keeps running by the tick's own verdicts (no stop id, no length limit:
``finish_codes`` all FINISH_NONE) and the forwards are long enough to hide it, the engine thread
hands the rows to this worker and goes on to the next tick; the worker takes the GIL while that
tick's forward runs with it released (as every kernel does), so the loop costs the engine thread
a hand-off instead of its run.

The one thing a deferred loop finds that the tick did not know is a stop string. Such a row ends
one tick late: the worker records its final text; the engine thread (``join``, then
EngineCore._apply_deferred after the next tick's update) finishes the sequence, puts that final
event (the text it would have put a tick earlier) and drops the token the late tick computed for
it, so the output is the same event for event. vLLM's async scheduling makes the same trade. A
row's exception is recorded likewise and fails its request on the engine thread.

Invariant: the engine thread ``join``s before anything else touches a request's text pipeline or
queue (the next tick's output, an abort, a failure, shutdown), so a request's events keep their
order and nothing follows its last event.
"""
from __future__ import annotations

import logging
import threading

from cext.emit import emit_rows

from ..outputs import StreamEvent
from .pacing import TickClock, pace

log = logging.getLogger("engine")

# A tick's output loop is deferred only after a forward at least this long (seconds; a no-compute
# double, ScriptedModel, runs tens of us) and for at least this many rows: the loop costs 2-5 us a
# row with the caches a forward left, the hand-off 8-35 us (waking the worker's virtual CPU; measured
# on the 2-vCPU VMs), so one row gains nothing and 32 gain ~0.1 ms a tick.
DEFER_MIN_FORWARD_S = 0.0005
DEFER_MIN_ROWS = 8


class Deferred:
    """One handed-off tick: its rows, and what the worker found that the engine thread must apply."""

    __slots__ = ("reqs", "token_ids", "codes", "late_stops", "failures")

    def __init__(self, reqs: list, token_ids: list[int], codes):
        self.reqs = reqs
        self.token_ids = token_ids
        self.codes = codes  # the verdicts, all FINISH_NONE (a view: the engine joins before its next update)
        self.late_stops: list = []  # (req, token_id, text): a stop string ended the row
        self.failures: list = []  # (req, exc)


class OutputWorker:
    """A daemon thread that runs one Deferred at a time (``hand_off``), ``join``ed by the engine."""

    def __init__(self, listeners: list, clock: TickClock):
        self._listeners = listeners  # the engine's tick listeners, called once the events are queued
        self._clock = clock  # the engine's forwards: the worker paces by them (pacing.py)
        self._job: Deferred | None = None
        # Two locks as binary semaphores (a C call each way, where an Event is Python code around a
        # Condition): the worker blocks on _ready until hand_off releases it; _done is held from
        # hand_off until the worker has run the job.
        self._ready = threading.Lock()
        self._ready.acquire()
        self._done = threading.Lock()
        self._stopping = False
        self.error: BaseException | None = None
        self.num_handed_off = 0
        self._thread = threading.Thread(target=self._run, name="engine-output", daemon=True)
        self._thread.start()

    @property
    def is_pending(self) -> bool:
        return self._job is not None

    def hand_off(self, job: Deferred) -> None:
        """Start ``job`` (none may be pending: ``join`` first)."""
        self._done.acquire()
        self.num_handed_off += 1
        self._job = job
        self._ready.release()

    def join(self) -> Deferred | None:
        """Wait for the pending job, if any, and return it (its late stops and failures to apply)."""
        job = self._job
        if job is None:
            return None
        self._done.acquire()  # released by the worker when the job is done
        self._done.release()
        self._job = None
        if self.error is not None:  # the loop itself broke (not a row): the engine thread fails
            error, self.error = self.error, None
            raise error
        return job

    def close(self) -> None:
        self._stopping = True
        if self._job is None:  # else the worker is running a job (the engine joins before it closes)
            self._ready.release()

    def _run(self) -> None:
        next_forward, no_job = self._clock.next_forward, self._ready.locked
        while True:
            pace(next_forward, no_job)  # a job is handed off before the next forward starts
            self._ready.acquire()
            if self._stopping:
                return
            job = self._job
            try:
                self._emit(job)
            except BaseException as exc:  # handed to the engine thread at join
                self.error = exc
            self._done.release()
            try:
                for fn in self._listeners:
                    fn()
            except Exception:  # a listener must not raise; if one does, the loop still serves the engine
                log.exception("tick listener failed")

    @staticmethod
    def _emit(job: Deferred) -> None:
        reqs, token_ids = job.reqs, job.token_ids

        def end_row(k: int, text: str | None, finish_reason: str | None) -> None:
            # Every verdict was FINISH_NONE, so only a stop string ends a row here.
            job.late_stops.append((reqs[k], token_ids[k], text))

        def fail_row(k: int, exc: BaseException) -> None:
            job.failures.append((reqs[k], exc))

        emit_rows(reqs, token_ids, job.codes, StreamEvent, end_row, fail_row)
