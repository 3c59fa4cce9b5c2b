"""Threads paced by the engine's ticks (engine/core/pacing.py; EngineCore.events_due for consumers):
a waiting thread sleeps until the next tick's output is due instead of blocking on it, so the
engine's put wakes nobody. Tested here: the pace is computed as documented, and paced streams
(in-process, over HTTP through a lone handler and through the pump, asyncio; with the tick's
output on the engine thread or on the paced output worker) lose, reorder or duplicate nothing.
What the pace saves is measured by benchmarks/host_path.py."""
import math
import threading
import types

import pytest

import engine
from engine.core import pacing
from engine.params import SamplingParams
from engine.testing import ScriptedModel
from tests.server_fixtures import LiveServer, default_tokenizer, script_ids
from webapp.sse_pump import SSEPump

COMPLETIONS = "/v1/completions"


def test_pace_sleeps_only_until_a_due_time_ahead_and_while_nothing_is_there(monkeypatch):
    slept = []
    monkeypatch.setattr(pacing, "time", types.SimpleNamespace(perf_counter=lambda: 10.0, sleep=slept.append))
    for due in (0.0, 9.0, 10.0):  # not paced, already past, now: no sleep
        pacing.pace(lambda due=due: due, lambda: True)
    assert slept == []
    pacing.pace(lambda: 10.003, lambda: False)  # something to take already: no sleep
    assert slept == []
    pacing.pace(lambda: 10.003, lambda: True)
    assert slept == [pytest.approx(0.003)]
    order = []  # the due time is read before the emptiness (see pacing.time_to)
    pacing.time_to(lambda: order.append("due") or 10.003, lambda: order.append("empty") or True)
    assert order == ["due", "empty"]


def test_tick_clock_paces_only_short_steady_ticks():
    clock = pacing.TickClock()
    assert clock.next_forward() == 0.0  # no forward yet
    clock.forward_started(100.0)
    assert clock.next_forward() == 0.0  # one forward: no period yet
    clock.forward_started(100.002)
    assert clock.period == pytest.approx(0.002)
    assert clock.next_forward() == pytest.approx(100.004 + pacing.PACE_MARGIN_S)
    clock.forward_started(100.002 + pacing.PACE_MAX_PERIOD_S * 2)  # slow ticks: a wake costs nothing beside them
    assert clock.next_forward() == 0.0
    clock.forward_started(clock.start + 0.00002)  # a no-compute double's ticks: several a wake-up
    assert clock.next_forward() == pytest.approx(clock.start + pacing.PACE_MIN_WAIT_S + pacing.PACE_MARGIN_S)


def test_engine_ticks_drive_the_clock_and_a_pending_output_defers_to_the_worker():
    tok = default_tokenizer()
    with engine.Engine(ScriptedModel(script_ids(), tok.vocab_size, step_seconds=0.001), tok, max_model_len=256,
                       speculative=None) as eng:
        core = eng._core
        assert core.events_due() == 0.0  # no tick yet
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0))
        clock = core.clock  # the double paces a forward to ~1 ms, its own work included
        assert 0.0005 < clock.period < math.inf and clock.start > 0.0
        # The engine is idle now (its thread waits): set the last forwards' figures directly.
        clock.start, clock.period = 100.0, 0.002
        assert core.events_due() == clock.next_forward() > 0.0
        core._output._job = object()  # the last tick's output runs on the worker, whose puts wake
        try:
            assert core.events_due() == 0.0
        finally:
            core._output._job = None


class _CountedDue:
    """Wraps a core's events_due: how often it paced (returned a time)."""

    def __init__(self, core):
        self.inner, self.paced = core.events_due, 0
        core.events_due = self

    def __call__(self) -> float:
        due = self.inner()
        self.paced += due > 0.0
        return due


@pytest.mark.parametrize("defer", [False, True])
def test_paced_streams_are_exact_in_process_and_over_http(monkeypatch, defer):
    """Forwards of 1 ms: every stream (in-process, a lone HTTP stream, four written by the pump)
    has exactly the scripted text, paced (the ticks' bound raised so a loaded machine's slower
    ticks still pace); with ``defer`` every steady tick's output runs on the output worker, which
    paces itself (its puts then wake the consumers)."""
    monkeypatch.setattr(pacing, "PACE_MAX_PERIOD_S", 1.0)
    tok = default_tokenizer()
    ids = script_ids(with_eos=False)
    num = len(ids)
    want = tok.decode(ids[:num])
    params = SamplingParams(max_tokens=num, temperature=0, ignore_eos=True)
    with engine.Engine(ScriptedModel(ids, tok.vocab_size, step_seconds=0.001), tok, max_model_len=256,
                       speculative=None) as eng:
        if defer:
            eng._core.defer_min_forward_s, eng._core.defer_min_rows = 0.0, 1
        due = _CountedDue(eng._core)
        events = list(eng.stream("Go.", params))
        assert "".join(e.text for e in events) == want
        assert [t for e in events for t in e.token_ids] == ids[:num]
        assert eng._core.clock.next_forward() > 0.0  # the forwards were paced ones
        assert (eng._core._output.num_handed_off > 5) == defer
        assert defer or due.paced > 0
        body = {"prompt": "Go.", "max_tokens": num, "temperature": 0, "ignore_eos": True, "stream": True}
        with LiveServer(eng, threads=16) as live:
            paced = due.paced
            status, frames = live.stream_events(COMPLETIONS, body)
            assert status == 200 and frames[-1] == "[DONE]"
            assert "".join(f["choices"][0]["text"] for f in frames[:-1]) == want
            assert defer or due.paced > paced
            results = [None] * 4

            def run(i):
                results[i] = live.stream_events(COMPLETIONS, body)

            threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            for status, frames in results:
                assert status == 200 and frames[-1] == "[DONE]"
                assert "".join(f["choices"][0]["text"] for f in frames[:-1]) == want
            pump = SSEPump.for_engine(eng)
            assert pump._events_due is due  # the pump paces by the same ticks


def test_paced_async_stream_is_exact(monkeypatch):
    """An asyncio consumer paces on the loop's timer (engine/async_stream.py): the same events."""
    import asyncio

    monkeypatch.setattr(pacing, "PACE_MAX_PERIOD_S", 1.0)
    tok = default_tokenizer()
    ids = script_ids(with_eos=False)
    params = SamplingParams(max_tokens=len(ids), temperature=0, ignore_eos=True)
    with engine.Engine(ScriptedModel(ids, tok.vocab_size, step_seconds=0.001), tok, max_model_len=256,
                       speculative=None) as eng:
        due = _CountedDue(eng._core)

        async def run():
            return [e async for e in eng.astream("Go.", params)]

        events = asyncio.run(run())
        assert [t for e in events for t in e.token_ids] == ids
        assert "".join(e.text for e in events) == tok.decode(ids)
        assert due.paced > 0
