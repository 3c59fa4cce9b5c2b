"""An Engine's life in a notebook: a collected engine stops its thread and frees its model and
KV cache, a second engine over the same model file shares the weights, reprs are readable
(Completion ids only on request), and generate(progress=True) counts requests as they finish.
"""
from __future__ import annotations

import gc
import os
import threading
import weakref

import pytest

import engine
from engine.loader import default_model_path
from engine.outputs import Completion, Usage
from engine.params import SamplingParams
from engine.testing import ScriptedModel


@pytest.fixture(scope="module")
def tok():
    return engine.load_tokenizer(default_model_path())


def engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "engine-core"]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_collected_engine_stops_its_thread_and_frees_its_model(tok):
    before = len(engine_threads())
    model = ScriptedModel(tok.encode("bye", add_special_tokens=False), tok.vocab_size)
    model_ref = weakref.ref(model)
    eng = engine.Engine(model, tok, max_model_len=256)
    del model
    assert eng.generate(["hi"], SamplingParams(max_tokens=2, temperature=0))[0].usage.completion_tokens == 2
    assert len(engine_threads()) == before + 1
    del eng  # as a re-run notebook cell drops the old engine; no close()
    gc.collect()
    assert len(engine_threads()) == before
    assert model_ref() is None


def test_close_then_collect_is_fine(tok):
    eng = engine.Engine(ScriptedModel([1], tok.vocab_size), tok, max_model_len=256)
    eng.close()
    eng.close()
    assert not eng.is_alive()
    del eng
    gc.collect()


@pytest.mark.slow
def test_a_second_engine_over_the_same_model_shares_it():
    """Re-running `eng = Engine.from_pretrained()` costs no second copy of the weights."""
    num_threads = len(engine_threads())
    eng = engine.Engine.from_pretrained(max_model_len=512, kv_cache_tokens=1024)
    model_ref = weakref.ref(eng.model)
    rss_first = rss_bytes()
    for _ in range(2):
        eng = engine.Engine.from_pretrained(max_model_len=512, kv_cache_tokens=1024)  # the old one goes
        gc.collect()
        assert eng.model is model_ref()
    rss_again = rss_bytes()
    assert len(engine_threads()) == num_threads + 1
    # No second copy of the weights (~ the file's size). Measured against the file, not against
    # the first load's growth: an earlier test in the process may have loaded the model already.
    assert rss_again - rss_first < os.path.getsize(default_model_path()) / 2
    del eng
    gc.collect()
    assert model_ref() is None and len(engine_threads()) == num_threads


# ---------------------------------------------------------------- reprs

def make_completion() -> Completion:
    return Completion(request_id="req-1", text="Paris <b>is</b> nice", token_ids=[11, 12, 13], finish_reason="stop",
                      logprobs=None, prompt_token_ids=[7, 8], prompt_logprobs=None, usage=Usage(2, 3))


def test_completion_repr_shows_text_reason_usage_and_no_ids():
    completion = make_completion()
    text = repr(completion)
    assert "Paris <b>is</b> nice" in text and "'stop'" in text and "completion_tokens=3" in text
    assert "11" not in text
    html = completion._repr_html_()
    assert "Paris &lt;b&gt;is&lt;/b&gt; nice" in html and "stop" in html and "2 prompt + 3 completion" in html
    assert "[11, 12, 13]" not in html
    assert "[11, 12, 13]" in completion.to_html(show_ids=True)
    assert "[7, 8]" in completion.describe(show_ids=True)


def test_completion_pretty_in_ipython():
    from IPython.lib.pretty import pretty

    text = pretty(make_completion())
    assert text.startswith("Completion") and "finish_reason: stop" in text and "[11, 12, 13]" not in text


def test_engine_repr_shows_model_kv_and_requests(tok):
    from IPython.lib.pretty import pretty

    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    # Paced (5 ms a forward): the request is still running while the reprs are made, however fast a tick is.
    with engine.Engine(ScriptedModel([5], tok.vocab_size, step_seconds=0.005), tok, max_model_len=256) as eng:
        stream = eng.stream("hello", params)
        next(stream)
        html = eng._repr_html_()
        text = pretty(eng)
        short = repr(eng)
        stream.close()
    for shown in (html, text):
        assert "ScriptedModel" in shown and "KV usage" in shown and "max_model_len" in shown
    assert "1 running" in text and "running" in short
    assert "closed" in repr(eng)


# ---------------------------------------------------------------- progress

def test_generate_progress_advances_as_requests_finish(tok, monkeypatch):
    """The short request finishes first and moves the bar while the long one still runs."""
    import tqdm.auto

    updates: list[int] = []

    class RecordingBar:
        def __init__(self, total, **kwargs):
            self.total = total

        def update(self, n=1):
            updates.append(eng.stats()["num_running"])

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", RecordingBar)
    script = tok.encode("x", add_special_tokens=False)
    long = SamplingParams(max_tokens=20000, temperature=0, ignore_eos=True)
    short = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    with engine.Engine(ScriptedModel(script, tok.vocab_size), tok, max_model_len=20100,
                       kv_cache_tokens=65536) as eng:
        done = eng.generate(["long", "short"], [long, short], progress=True)
    assert [c.usage.completion_tokens for c in done] == [20000, 2]  # results stay in prompt order
    assert updates[0] == 1  # the first tick of the bar came while the long request still ran
    assert len(updates) == 2


def test_a_stream_keeps_its_engine_alive(tok):
    """`for ev in Engine(...).stream(...)`: the engine is referenced only by its stream."""
    before = len(engine_threads())
    script = tok.encode("still here", add_special_tokens=False)
    stream = engine.Engine(ScriptedModel(script, tok.vocab_size), tok, max_model_len=256).stream(
        "hi", SamplingParams(max_tokens=len(script), temperature=0))
    gc.collect()
    assert "".join(event.text for event in stream) == "still here"
    del stream
    gc.collect()
    assert len(engine_threads()) == before
