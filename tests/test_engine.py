"""The public Engine end to end with ScriptedModel and the default model's real tokenizer.

Invariants 2-4 of docs/architecture.md (streaming equals one-shot, stop strings, logprobs), abort,
concurrency, and failure isolation. No model compute: ScriptedModel emits a script.
"""
import threading
import time

import pytest

import engine
from engine.errors import EngineDead, EngineError
from engine.loader import default_model_path
from engine.params import SamplingParams
from engine.testing import ScriptedModel
from tests.server_fixtures import CountingModel

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "안녕하세요, 세계! 한국어 텍스트입니다.",
    "中文测试：你好，世界。日本語のテキストも。",
    "Emoji: 👩‍👩‍👧‍👦 family, 🇫🇷🇰🇷 flags, 👍🏽 thumbs, e\u0301 combining.",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code\n",
]


@pytest.fixture(scope="module")
def tok():
    return engine.load_tokenizer(default_model_path())


@pytest.fixture(autouse=True, params=["inline", "deferred"])
def output_loop(request, monkeypatch):
    """Every test twice: the steady ticks' output loop on the engine thread (ScriptedModel's forwards
    are too short to defer it) and on the output worker beside the next forward, as for a real model
    (engine/core/output_worker.py)."""
    if request.param == "deferred":
        monkeypatch.setattr("engine.core.runtime.DEFER_MIN_FORWARD_S", 0.0)
        monkeypatch.setattr("engine.core.runtime.DEFER_MIN_ROWS", 1)
    return request.param


def make_engine(tok, script, **options):
    options.setdefault("max_model_len", 4096)
    options.setdefault("kv_cache_tokens", 8192)
    return engine.Engine(ScriptedModel(script, tok.vocab_size), tok, **options)


def run_stream(eng, prompt, params):
    events = list(eng.stream(prompt, params))
    return events, "".join(e.text for e in events), [t for e in events for t in e.token_ids]


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_equals_one_shot_and_decode(tok, text):
    script = tok.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(script), temperature=0)
    with make_engine(tok, script) as eng:
        events, streamed, ids = run_stream(eng, "prompt", params)
        [done] = eng.generate(["prompt"], params)
    assert ids == script == done.token_ids
    assert streamed == done.text == tok.decode(script) == text
    assert events[-1].finish_reason == "length" and done.finish_reason == "length"
    assert all(e.finish_reason is None for e in events[:-1])
    assert done.usage.completion_tokens == len(script)
    assert done.prompt_token_ids == tok.encode("prompt")


def test_eos_stops_and_ignore_eos_runs_to_length(tok):
    [eos] = tok.eos_token_ids[:1]
    body = tok.encode("Paris is nice.", add_special_tokens=False)
    script = body + [eos] + body
    with make_engine(tok, script) as eng:
        done = eng.generate(["q"], SamplingParams(max_tokens=50, temperature=0))[0]
        assert done.finish_reason == "stop"
        assert done.token_ids == body + [eos]
        assert done.text == "Paris is nice."
        long = eng.generate(["q"], SamplingParams(max_tokens=len(script), temperature=0, ignore_eos=True))[0]
        assert long.finish_reason == "length" and long.token_ids == script


def test_stop_token_ids(tok):
    script = tok.encode("one two three four", add_special_tokens=False)
    with make_engine(tok, script) as eng:
        done = eng.generate(["q"], SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[script[2]]))[0]
    assert done.finish_reason == "stop"
    assert done.token_ids == script[:3]
    assert done.text == tok.decode(script[:2])


def _first_token_completing(tok, ids, stop):
    for k in range(1, len(ids) + 1):
        if stop in tok.decode(ids[:k]):
            return k
    return None


STOP_CASES = [
    ("The answer is 42. END and more text", ["END"]),
    ("abc stop1 def stop2", ["stop2", "stop1"]),  # earliest occurrence wins, not list order
    ("Korean 한국어 텍스트 끝 more", ["텍스트"]),  # multi-byte stop
    ("flags 🇫🇷🇰🇷 after", ["🇰🇷"]),  # stop made of characters that arrive in pieces
    ("xxxyz tail", ["xyz", "xxy"]),  # overlapping stops
    ("STOP at the start", ["STOP"]),
    ("no stop here at all", ["zzz"]),
]


@pytest.mark.parametrize("text, stops", STOP_CASES)
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings(tok, text, stops, include):
    script = tok.encode(text, add_special_tokens=False)
    full = tok.decode(script)
    params = SamplingParams(max_tokens=len(script), temperature=0, stop=stops, include_stop_str_in_output=include)
    with make_engine(tok, script) as eng:
        events, streamed, ids = run_stream(eng, "q", params)
    hits = [(full.find(s), s) for s in stops if s in full]
    if not hits:
        assert streamed == full and events[-1].finish_reason == "length"
        return
    pos, stop = min(hits)
    expected = full[: pos + len(stop)] if include else full[:pos]
    assert streamed == expected
    assert events[-1].finish_reason == "stop"
    # Generation stops at the token that completes the earliest stop.
    completing = min(_first_token_completing(tok, script, s) for s in stops if s in full)
    assert ids == script[:completing]


def test_stop_never_released_early(tok):
    """No streamed prefix ever passes the cut, even while a stop is only partly generated."""
    text = "alpha beta gamma delta"
    script = tok.encode(text, add_special_tokens=False)
    with make_engine(tok, script) as eng:
        events, streamed, _ = run_stream(eng, "q", SamplingParams(max_tokens=50, temperature=0, stop=["gamma"]))
    assert streamed == "alpha beta "
    sofar = ""
    for e in events:
        sofar += e.text
        assert "alpha beta ".startswith(sofar)


def test_stream_ending_mid_character(tok):
    script = tok.encode("🙂🙂", add_special_tokens=False)
    assert len(script) > 2  # a byte-level BPE splits the emoji over several tokens
    cut = script[:-1]
    with make_engine(tok, script) as eng:
        [done] = eng.generate(["q"], SamplingParams(max_tokens=len(cut), temperature=0))
        _, streamed, _ = run_stream(eng, "q", SamplingParams(max_tokens=len(cut), temperature=0))
    assert done.text == streamed == tok.decode(cut)
    assert "\ufffd" in done.text


def test_logprobs_one_per_token_streamed_and_one_shot(tok):
    script = tok.encode(TEXTS[3], add_special_tokens=False)
    params = SamplingParams(max_tokens=len(script), temperature=0, logprobs=True, top_logprobs=3)
    with make_engine(tok, script) as eng:
        events, _, ids = run_stream(eng, "q", params)
        [done] = eng.generate(["q"], params)
    streamed_lps = [lp for e in events for lp in e.logprobs]
    for e in events:
        assert len(e.logprobs) == len(e.token_ids)
    assert [lp.token_id for lp in streamed_lps] == ids == [lp.token_id for lp in done.logprobs]
    for a, b in zip(streamed_lps, done.logprobs):
        assert a.logprob == pytest.approx(b.logprob) and a.top == b.top
    for lp in done.logprobs:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id
        assert bytes(lp.bytes).decode("utf-8", errors="replace") == lp.token
    assert b"".join(bytes(lp.bytes) for lp in done.logprobs).decode("utf-8") == done.text


def test_prompt_logprobs_aligned(tok):
    script = tok.encode("ok", add_special_tokens=False)
    prompt = "Some prompt text to score"
    with make_engine(tok, script) as eng:
        [done] = eng.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2))
    assert len(done.prompt_logprobs) == len(done.prompt_token_ids)
    assert done.prompt_logprobs[0] is None
    for tid, lp in zip(done.prompt_token_ids[1:], done.prompt_logprobs[1:]):
        assert lp.token_id == tid and len(lp.top) == 2


def test_abort_mid_stream(tok):
    script = tok.encode("word " * 50, add_special_tokens=False)
    with make_engine(tok, script) as eng:
        stream = eng.stream("q", SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True))
        first = next(stream)
        eng.abort(stream.request_id)
        rest = list(stream)
        assert rest[-1].finish_reason == "abort"
        assert sum(len(e.token_ids) for e in [first] + rest) < 2000
        # The engine keeps serving after an abort, and the aborted request's blocks are free.
        [done] = eng.generate(["q"], SamplingParams(max_tokens=5, temperature=0))
        assert done.token_ids == script[:5]
        assert eng.stats()["num_running"] == 0


def test_closing_the_iterator_aborts(tok):
    script = tok.encode("word " * 10, add_special_tokens=False)
    with make_engine(tok, script) as eng:
        stream = eng.stream("q", SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True))
        next(stream)
        stream.close()
        [done] = eng.generate(["q"], SamplingParams(max_tokens=3, temperature=0))
        assert done.finish_reason == "length"


def test_many_threads_at_once(tok):
    script = tok.encode(TEXTS[1] + TEXTS[2], add_special_tokens=False)
    results, errors = {}, []
    with make_engine(tok, script, max_num_seqs=8) as eng:
        def worker(i):
            try:
                n = 5 + i % 20
                _, text, ids = run_stream(eng, f"prompt {i}", SamplingParams(max_tokens=n, temperature=0))
                results[i] = (text, ids, n)
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(24)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors
    assert len(results) == 24
    for text, ids, n in results.values():
        assert ids == script[:n] and text == tok.decode(script[:n])


def test_bad_requests_raise_value_error(tok):
    with make_engine(tok, [1, 2], max_model_len=64) as eng:
        with pytest.raises(ValueError, match="max_model_len"):
            eng.stream("word " * 100, SamplingParams(max_tokens=10))
        with pytest.raises(ValueError, match="max_model_len"):
            eng.stream("hi", SamplingParams(max_tokens=64))
        with pytest.raises(ValueError, match="prompt"):
            eng.stream([], SamplingParams())
        with pytest.raises(ValueError, match="token ids"):
            eng.stream([tok.vocab_size + 5], SamplingParams())
        with pytest.raises(ValueError, match="params"):
            eng.stream("hi", {"max_tokens": 3})
        with pytest.raises(ValueError, match="unknown engine option"):
            engine.Engine(ScriptedModel([1], tok.vocab_size), tok, max_batch=3)
        # Still serving.
        assert eng.generate(["hi"], SamplingParams(max_tokens=2, temperature=0))[0].token_ids == [1, 2]


class _PoisonModel(ScriptedModel):
    """Fails the forward of any batch holding the poison token: our own failure handling under test."""

    def __init__(self, script, vocab_size, poison, fatal=False):
        super().__init__(script, vocab_size)
        self.poison, self.fatal = poison, fatal

    def forward(self, batch, kv_cache):
        if bool((batch.input_ids == self.poison).any()):
            if self.fatal:
                raise SystemExit("simulated engine thread death")
            raise RuntimeError("simulated kernel failure")
        return super().forward(batch, kv_cache)


def test_a_failing_request_does_not_take_others_down(tok):
    script = tok.encode("fine output", add_special_tokens=False)
    with engine.Engine(_PoisonModel(script, tok.vocab_size, poison=7), tok, max_model_len=512) as eng:
        with pytest.raises(EngineError, match="simulated kernel failure"):
            list(eng.stream([7, 7, 7], SamplingParams(max_tokens=3)))
        [done] = eng.generate([[1, 2, 3]], SamplingParams(max_tokens=len(script), temperature=0))
        assert done.token_ids == script and eng.is_alive()


def test_dead_engine_thread_fails_every_waiter(tok):
    eng = engine.Engine(_PoisonModel([5], tok.vocab_size, poison=7, fatal=True), tok, max_model_len=512)
    waiting = eng.stream([1, 2], SamplingParams(max_tokens=400, temperature=0, ignore_eos=True))
    next(waiting)
    with pytest.raises(EngineDead):
        list(eng.stream([7], SamplingParams(max_tokens=3)))
    with pytest.raises(EngineDead):
        list(waiting)
    assert not eng.is_alive()
    with pytest.raises(EngineDead):
        eng.stream([1], SamplingParams(max_tokens=3))
    eng.close()


def test_generate_waits_for_ends_and_sees_failures(tok):
    """generate waits for each request's end notice, not its events: a failed request and a
    dead engine thread must still end it (with the error), never hang it."""
    script = tok.encode("fine output", add_special_tokens=False)
    params = SamplingParams(max_tokens=len(script), temperature=0)
    with engine.Engine(_PoisonModel(script, tok.vocab_size, poison=7), tok, max_model_len=512) as eng:
        with pytest.raises(EngineError, match="simulated kernel failure"):
            eng.generate([[1, 2, 3], [7, 7, 7]], params)
        assert [c.token_ids for c in eng.generate([[1, 2, 3], [4, 5]], params)] == [script, script]
    with engine.Engine(_PoisonModel([5], tok.vocab_size, poison=7, fatal=True), tok, max_model_len=512) as eng:
        with pytest.raises(EngineDead):
            eng.generate([[1, 2], [7]], SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))


def test_scripted_model_step_seconds(tok):
    """The paced double emits the same tokens (the pace is the only difference); bad paces are refused."""
    script = tok.encode("a paced reply", add_special_tokens=False)
    params = SamplingParams(max_tokens=len(script), temperature=0)
    with engine.Engine(ScriptedModel(script, tok.vocab_size, step_seconds=0.002), tok, max_model_len=512) as eng:
        [done] = eng.generate([[1, 2, 3]], params)
    assert done.token_ids == script
    for bad in (-0.001, float("nan")):
        with pytest.raises(ValueError, match="step_seconds"):
            ScriptedModel(script, tok.vocab_size, step_seconds=bad)


def test_busy_wait_lasts_its_time_with_the_gil_released():
    """The paced double's spin (cext.cpu.busy_wait) ends no earlier than asked and lets other
    threads run Python meanwhile; a bad duration is refused."""
    from cext.cpu import busy_wait

    counted = []
    started = threading.Event()

    def count():
        started.set()
        while len(counted) < 10_000_000 and not stop.is_set():
            counted.append(1)

    stop = threading.Event()
    worker = threading.Thread(target=count)
    worker.start()
    started.wait()
    before = len(counted)
    start = time.perf_counter()
    busy_wait(0.05)
    elapsed = time.perf_counter() - start
    during = len(counted) - before
    stop.set()
    worker.join()
    assert elapsed >= 0.05
    assert during > 0  # the other thread held the GIL while this one spun
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="seconds"):
            busy_wait(bad)


def test_forward_batch_makes_tensors_of_numpy_arrays_without_copying():
    import numpy as np

    from engine.batch import ForwardBatch

    arrays = {name: np.arange(4, dtype=np.int64) for name in (
        "input_ids", "positions", "slot_mapping", "query_starts", "context_lens", "logit_rows", "prompt_lens")}
    batch = ForwardBatch(**arrays, block_tables=np.zeros((3, 2), dtype=np.int64), query_starts_list=[0, 1, 2, 3],
                         context_lens_list=[1, 1, 1], num_decode_seqs=3)
    assert batch.array("positions") is arrays["positions"]
    positions = batch.positions
    assert positions is batch.positions and positions.tolist() == [0, 1, 2, 3]
    arrays["positions"][0] = 9  # a view: the tensor sees the scheduler's array
    assert positions[0].item() == 9 and batch.array("positions")[0] == 9
    assert tuple(batch.block_tables.shape) == (3, 2) and batch.num_seqs == 3 and batch.num_tokens == 3


def test_forwards_trim_the_heap_at_most_once_an_interval(tok, monkeypatch):
    """After a forward, prompt chunk or decode tick, freed heap pages go back to the OS
    (malloc_trim: prompt chunks left the heap fragmented, decode ticks free more than they
    keep), at most once every TRIM_HEAP_INTERVAL_S."""
    from engine.core import runtime

    trims = []
    monkeypatch.setattr(runtime, "release_free_heap", lambda: trims.append(1))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    # No speculation: its proposals (prompt lookup finds the repeated 7s) would make the tick count
    # depend on the verify budget's measured step times.
    with make_engine(tok, [5], speculative=None) as eng:
        monkeypatch.setattr(runtime, "TRIM_HEAP_INTERVAL_S", 3600.0)
        eng.generate([[7] * 16], params)
        assert len(trims) == 1  # the first forward's (none before it), then none within the hour
        monkeypatch.setattr(runtime, "TRIM_HEAP_INTERVAL_S", 0.0)
        ticks = eng._core.num_ticks
        eng.generate([[7] * 1000], params)  # 1,000 tokens in 256-token chunks, then 19 decode ticks
        assert eng._core.num_ticks - ticks == 4 + 19
        deadline = time.monotonic() + 10  # the last tick trims after its output ended the request
        while len(trims) < 1 + 4 + 19 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(trims) == 1 + 4 + 19
        monkeypatch.setattr(runtime, "TRIM_HEAP_INTERVAL_S", 3600.0)
        eng.generate([[8] * 1000], params)
        assert len(trims) == 24  # the last trim was under an hour ago


def test_generate_hands_every_prompt_to_the_first_tick(tok):
    """generate submits its prompts at once: the first forward prefills all of them, in every run
    (one at a time, the engine thread woke on the first and could prefill it alone while the
    others were tokenized: other row counts, other rounding, other greedy ids on a real model).
    A list the engine cannot take whole is refused whole, before anything runs."""
    script = tok.encode("the same reply", add_special_tokens=False)
    params = SamplingParams(max_tokens=len(script), temperature=0)
    prompts = [TEXTS[i % len(TEXTS)] * 2 for i in range(6)]  # strings: tokenized on this thread, in turn
    model = CountingModel(script, tok.vocab_size)
    with engine.Engine(model, tok, max_model_len=1024, max_waiting=6, max_num_batched_tokens=4096) as eng:
        for _ in range(5):
            model.sequences_per_forward.clear()
            done = eng.generate(prompts, params)
            assert [c.token_ids for c in done] == [script] * len(prompts)
            assert model.sequences_per_forward[0] == len(prompts), model.sequences_per_forward
        with pytest.raises(engine.EngineOverloaded):
            eng.generate(prompts + prompts[:1], params)
        assert eng.stats()["num_waiting"] == 0 and eng.stats()["num_running"] == 0
        assert [c.token_ids for c in eng.generate(prompts[:2], params)] == [script] * 2
