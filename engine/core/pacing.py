"""Threads paced by the engine's ticks instead of woken by them.

On the 2-vCPU VMs a put (or a lock's release) that wakes a blocked thread costs the engine thread
10-15 us: the wake-up of an idle virtual CPU. At 650 tok/s that was a third of a lone HTTP
stream's host time per token (benchmarks/host_path.py). A thread that waits for the engine's
next output (a stream's consumer, the SSE pump, the output worker) and finds nothing yet sleeps
instead until the next forward should have started (``TickClock.next_forward``): by then the
tick's output is queued and the GIL is likely free (our forwards release it), and the engine's put
or release found nobody to wake. Paced only while forwards start at most PACE_MAX_PERIOD_S apart
(a wake costs nothing beside a slower tick). Ticks closer than PACE_MIN_WAIT_S (a no-compute
double's 20-50 us; no model's forward on a CPU) are taken several a wake-up: a paced thread waking
once a tick would take the GIL from the engine thread at every tick. A guess that misses costs only
the wake it meant to save: the thread then blocks as before.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable

PACE_MAX_PERIOD_S = 0.005
PACE_MIN_WAIT_S = 0.0005  # ticks closer than this (a no-compute double's) are taken several a wake-up
PACE_MARGIN_S = 0.00005  # after the next forward's expected start (the timer adds its ~50 us slack)


class TickClock:
    """When the engine thread's plain forwards start: written by that thread alone, read by any
    thread without a lock (a torn read only misplaces one guess)."""

    __slots__ = ("start", "period")

    def __init__(self) -> None:
        self.start = -math.inf  # time.perf_counter() at the last forward's start
        self.period = math.inf  # seconds between the last two forwards' starts

    def forward_started(self, now: float) -> None:
        self.period = now - self.start
        self.start = now

    def next_forward(self) -> float:
        """When the next forward should have started (at least PACE_MIN_WAIT_S after the last),
        plus PACE_MARGIN_S, while forwards start at most PACE_MAX_PERIOD_S apart; else 0.0."""
        if self.period > PACE_MAX_PERIOD_S:
            return 0.0
        return self.start + max(self.period, PACE_MIN_WAIT_S) + PACE_MARGIN_S


def time_to(due: Callable[[], float], is_empty: Callable[[], bool]) -> float:
    """Seconds a waiting thread sleeps before it waits for the engine's output: until ``due()`` (a
    ``time.perf_counter()`` time at most PACE_MAX_PERIOD_S + PACE_MARGIN_S ahead; 0.0: not paced)
    while ``is_empty()`` (nothing to take yet), else 0.0. ``due`` is read first: the engine queues
    a tick's output before it starts the next forward, so a due time read after that start finds
    the output where ``is_empty`` looks, and no thread sleeps past output that was already there."""
    when = due()
    if not when or not is_empty():
        return 0.0
    return max(when - time.perf_counter(), 0.0)


def pace(due: Callable[[], float], is_empty: Callable[[], bool]) -> None:
    """Sleep for ``time_to(due, is_empty)``; an asyncio consumer awaits ``asyncio.sleep`` of it
    instead (engine/async_stream.py)."""
    wait = time_to(due, is_empty)
    if wait:
        time.sleep(wait)
