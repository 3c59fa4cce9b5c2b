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


def run_batch(tok, script, params_list, general: bool):
    """Every request submitted before the first tick (so they share the ticks); their events."""
    model = ScriptedModel(script, tok.vocab_size)
    with engine.Engine(model, tok, max_model_len=512, kv_cache_tokens=8192, max_num_seqs=8) as eng:
        streams = []
        for i, params in enumerate(params_list):
            if general:
                params = dataclasses.replace(params, logit_bias={0: 0.0})
            streams.append(eng.stream(f"prompt {i}", params))
        # Per choice in order (stable sort): how an n > 1 request's choices interleave depends on
        # whether the engine thread ticked before the test thread had submitted every request.
        events = [sorted(((e.index, e.text, e.token_ids, e.finish_reason) for e in s), key=lambda e: e[0])
                  for s in streams]
        return events, eng._core.scheduler.num_decode_ticks


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


def test_a_request_finishing_mid_batch_leaves_the_others_running(tok):
    script = tok.encode(TEXT, add_special_tokens=False)
    params_list = [SamplingParams(max_tokens=k, temperature=0, ignore_eos=True) for k in (5, 50, 9, 50)]
    plain, num_fast = run_batch(tok, script, params_list, general=False)
    assert num_fast > 0
    assert [sum(len(e[2]) for e in events) for events in plain] == [5, 50, 9, 50]
    assert all("".join(e[1] for e in events) == tok.decode(script[:k]) for events, k in zip(plain, (5, 50, 9, 50)))
