"""The decode-only steady state end to end: its events equal the general path's, event for event.

A tick where nothing waits and every running sequence decodes one token takes the scheduler's
steady-state path (cext.tick decode_*) and, when no row needs a grammar, logits processing or
logprobs, the one-call output loop (cext.emit). ``logit_bias={0: 0.0}`` changes no logit but gives
each request a logits adjuster, so the same workload then runs every row through the general
per-token path (EngineCore._process_token): the plain reference here.
"""
import dataclasses

import pytest

import engine
from engine.loader import default_model_path
from engine.params import SamplingParams
from engine.testing import ScriptedModel

TEXT = "Hello, world! 안녕하세요 👩‍👩‍👧‍👦 The quick brown fox jumps over the lazy dog. 中文测试。" * 3


@pytest.fixture(scope="module")
def tok():
    return engine.load_tokenizer(default_model_path())


def run_batch(tok, script, params_list, general: bool, defer: bool = False, stats: dict | None = None):
    """Every request submitted before the first tick (so they share the ticks); their events.
    ``defer``: every steady tick's output loop runs on the output worker beside the next forward
    (engine/core/output_worker.py), as it does for forwards of a real model's length."""
    model = ScriptedModel(script, tok.vocab_size)
    with engine.Engine(model, tok, max_model_len=512, kv_cache_tokens=8192, max_num_seqs=10) as eng:
        core = eng._core
        core.defer_min_forward_s = 0.0 if defer else float("inf")
        core.defer_min_rows = 1
        streams = []
        for i, params in enumerate(params_list):
            if general:
                params = dataclasses.replace(params, logit_bias={0: 0.0})
            streams.append(eng.stream(f"prompt {i}", params))
        # Per choice in order (stable sort): how an n > 1 request's choices interleave depends on
        # whether the engine thread ticked before the test thread had submitted every request.
        events = [sorted(((e.index, e.text, e.token_ids, e.finish_reason) for e in s), key=lambda e: e[0])
                  for s in streams]
        if stats is not None:
            bm = core.scheduler.block_manager
            stats.update(num_deferred=core._output.num_handed_off, num_generated=core.num_generated_tokens,
                         num_emitted=sum(len(e[2]) for evs in events for e in evs),
                         blocks_free=bm.num_free_blocks == bm.num_blocks)
        return events, core.scheduler.num_decode_ticks


def test_steady_state_events_equal_the_general_path(tok):
    script = tok.encode(TEXT, add_special_tokens=False)
    [eos] = tok.eos_token_ids[:1]
    many_stop_ids = tuple(range(100, 109)) + (script[30],)  # 10 ids: more than the tick's table holds
    params_list = [
        SamplingParams(max_tokens=len(script), temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=17, temperature=0),
        SamplingParams(max_tokens=60, temperature=0, stop=["fox", "세요"]),
        SamplingParams(max_tokens=60, temperature=0, stop=["lazy"], include_stop_str_in_output=True),
        SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[script[25]]),
        SamplingParams(max_tokens=60, temperature=0, stop_token_ids=list(many_stop_ids)),
        SamplingParams(max_tokens=40, temperature=0, n=2),
        SamplingParams(max_tokens=len(script), temperature=0, stop_token_ids=[eos], skip_special_tokens=False),
    ]
    plain, num_fast = run_batch(tok, script, params_list, general=False)
    general, _ = run_batch(tok, script, params_list, general=True)
    assert num_fast > 20  # the plain run took the steady-state path
    assert plain == general
    finish = [events[-1][3] for events in plain]
    assert finish[:6] == ["length", "length", "stop", "stop", "stop", "stop"]
    assert "".join(e[1] for e in plain[2]) == "Hello, world! 안녕하"  # cut before the earliest stop
    assert "".join(e[1] for e in plain[3]).endswith("lazy")
    assert [t for e in plain[5] for t in e[2]] == script[:31]  # stopped at the 10th stop id


def test_deferred_output_loop_gives_the_same_events(tok):
    """A steady tick's output loop on the output worker beside the next forward: a stop string it
    finds ends the row one tick late, with the same last event; the id the late tick computed is
    dropped (not emitted, not counted) and every block comes back."""
    script = tok.encode(TEXT, add_special_tokens=False)
    params_list = [
        SamplingParams(max_tokens=len(script), temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=60, temperature=0, stop=["fox", "세요"]),
        SamplingParams(max_tokens=60, temperature=0, stop=["lazy"], include_stop_str_in_output=True),
        SamplingParams(max_tokens=60, temperature=0, stop=["👧"]),  # cut inside a ZWJ emoji sequence
        SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[script[25]]),
        SamplingParams(max_tokens=41, temperature=0, stop=["jumps"]),  # the stop and the length in one tick
        SamplingParams(max_tokens=42, temperature=0, stop=["jumps"]),  # found late, in the length's tick
        SamplingParams(max_tokens=40, temperature=0, n=2, stop=["world"]),
        SamplingParams(max_tokens=33, temperature=0),
    ]
    stats: dict = {}
    deferred, num_fast = run_batch(tok, script, params_list, general=False, defer=True, stats=stats)
    general, _ = run_batch(tok, script, params_list, general=True)
    assert stats["num_deferred"] > 20 and num_fast > 20  # the worker ran most ticks' output
    assert deferred == general
    assert [events[-1][3] for events in deferred] == ["length"] + ["stop"] * 7 + ["length"]
    assert "".join(e[1] for e in deferred[5]) == "".join(e[1] for e in deferred[6]) == tok.decode(script[:41])[:-5]
    assert stats["num_generated"] == stats["num_emitted"]
    assert stats["blocks_free"]


def test_a_request_finishing_mid_batch_leaves_the_others_running(tok):
    script = tok.encode(TEXT, add_special_tokens=False)
    params_list = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in (5, 50, 9, 50)]
    plain, num_fast = run_batch(tok, script, params_list, general=False)
    assert num_fast > 0
    assert [sum(len(e[2]) for e in events) for events in plain] == [5, 50, 9, 50]
    assert all("".join(e[1] for e in events) == tok.decode(script[:k]) for events, k in zip(plain, (5, 50, 9, 50)))


@pytest.mark.parametrize("defer", [False, True])
def test_a_failing_output_row_fails_its_request_only(tok, monkeypatch, defer):
    """A row whose text pipeline raises (here: a patched TextStream, on the 6th token of the request
    with a marker stop string) fails that request; the rows around it in the same ticks carry on,
    whether the loop ran on the engine thread or on the output worker."""
    from engine.errors import EngineError
    from engine.text.text_stream import TextStream

    marker = "\x00never"
    calls: dict[int, int] = {}  # id of a marked stream -> its add calls
    real_init, real_add = TextStream.__init__, TextStream.add

    def init(self, tokenizer, skip_special_tokens=True, stop=(), include_stop_str_in_output=False):
        real_init(self, tokenizer, skip_special_tokens, stop, include_stop_str_in_output)
        if marker in stop:
            calls[id(self)] = 0

    def add(self, token_id):
        if id(self) in calls:
            calls[id(self)] += 1
            if calls[id(self)] == 6:
                raise RuntimeError("simulated text pipeline failure")
        return real_add(self, token_id)

    monkeypatch.setattr(TextStream, "__init__", init)
    monkeypatch.setattr(TextStream, "add", add)
    script = tok.encode(TEXT, add_special_tokens=False)
    with engine.Engine(ScriptedModel(script, tok.vocab_size), tok, max_model_len=512, kv_cache_tokens=8192) as eng:
        eng._core.defer_min_forward_s = 0.0 if defer else float("inf")
        eng._core.defer_min_rows = 1
        params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
        streams = [eng.stream(f"p{i}", dataclasses.replace(params, stop=[marker]) if i == 1 else params)
                   for i in range(3)]
        results = []
        for stream in streams:
            try:
                results.append([t for e in stream for t in e.token_ids])
            except EngineError as exc:
                results.append(str(exc))
        assert results[0] == results[2] == script[:30]
        assert "simulated text pipeline failure" in results[1]
        assert eng.is_alive() and eng.stats()["num_running"] == 0
