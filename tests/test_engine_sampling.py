"""Sampling options and n > 1 through the public Engine (ScriptedModel, the real tokenizer)."""
import pytest

import engine
from engine.errors import InvalidParameterError
from engine.loader import default_model_path
from engine.params import SamplingParams
from engine.testing import ScriptedModel

SCRIPT = [100, 200, 300, 400, 500]


@pytest.fixture(scope="module")
def tok():
    return engine.load_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def eng(tok):
    script = SCRIPT + [min(tok.eos_token_ids)]
    with engine.Engine(ScriptedModel(script, tok.vocab_size), tok, max_model_len=512, kv_cache_tokens=4096) as e:
        yield e


def ids_of(eng, params, prompt="hello there"):
    return eng.generate([prompt], params)[0].token_ids


def test_negative_bias_removes_a_token_and_positive_bias_forces_one(eng):
    assert ids_of(eng, SamplingParams(temperature=0, max_tokens=3)) == [100, 200, 300]
    # ScriptedModel puts peak/2 on the next script id: banning 200 at step 1 picks 300 there.
    got = ids_of(eng, SamplingParams(temperature=0, max_tokens=3, logit_bias={200: -100}))
    assert 200 not in got and got[0] == 100
    assert ids_of(eng, SamplingParams(temperature=0, max_tokens=3, logit_bias={7: 100})) == [7, 7, 7]


def test_min_tokens_suppresses_eos_until_reached(eng, tok):
    eos = min(tok.eos_token_ids)
    plain = ids_of(eng, SamplingParams(temperature=0, max_tokens=20))
    assert plain[-1] == eos and len(plain) == len(SCRIPT) + 1
    got = ids_of(eng, SamplingParams(temperature=0, max_tokens=20, min_tokens=9))
    assert eos not in got[:9] and len(got) >= 9


def test_frequency_penalty_breaks_a_repetition(eng):
    # After the script the model repeats its last id (EOS ignored); a strong penalty moves off it.
    params = dict(temperature=0, max_tokens=30, ignore_eos=True)  # 20 - (2 * count + 2) < 0 from count 10
    plain = ids_of(eng, SamplingParams(**params))
    penalized = ids_of(eng, SamplingParams(**params, frequency_penalty=2.0, presence_penalty=2.0))
    assert len(set(penalized)) > len(set(plain))


def test_bad_words_are_never_generated(tok):
    words = ["Paris", "France"]
    script = tok.encode(" Paris is in France", add_special_tokens=False) + [min(tok.eos_token_ids)]
    with engine.Engine(ScriptedModel(script, tok.vocab_size), tok, max_model_len=256) as eng:
        plain = eng.generate(["x"], SamplingParams(temperature=0, max_tokens=8))[0].text
        banned = eng.generate(["x"], SamplingParams(temperature=0, max_tokens=8, bad_words=words))[0].text
    assert "Paris" in plain and "France" in plain
    assert "Paris" not in banned and "France" not in banned


def test_logit_bias_ids_are_checked_against_the_vocabulary(eng, tok):
    with pytest.raises(InvalidParameterError) as err:
        eng.generate(["x"], SamplingParams(logit_bias={tok.vocab_size: 1.0}))
    assert err.value.param == "logit_bias"


def test_n_choices_are_distinct_reproducible_and_prefill_once(tok):
    script = list(range(1000, 1040))
    model = ScriptedModel(script, tok.vocab_size, peak=1.0)  # flat enough that draws differ
    with engine.Engine(model, tok, max_model_len=512, kv_cache_tokens=4096, block_size=16) as eng:
        prompt = list(range(1, 70))
        params = SamplingParams(temperature=1.5, max_tokens=8, n=3, seed=42)
        before = eng.stats()["num_prefix_cache_hit_tokens"]
        first = eng.generate([prompt], params)
        hits = eng.stats()["num_prefix_cache_hit_tokens"] - before
        again = eng.generate([prompt], params)
    assert [c.index for c in first] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in first}) == 3
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    # the two followers took every full block of the leader's prompt from the cache
    assert hits >= 2 * (len(prompt) // 16) * 16


def test_n_streams_carry_the_index_and_abort_stops_all(eng):
    stream = eng.stream("hi", SamplingParams(temperature=0, max_tokens=4, n=2))
    events = list(stream)
    assert {e.index for e in events} == {0, 1}
    assert all(e.request_id == stream.request_id for e in events)
    assert [e.finish_reason for e in events if e.finish_reason] == ["length", "length"]
    stream = eng.stream("hi", SamplingParams(temperature=0, max_tokens=400, n=3, ignore_eos=True))
    next(stream)
    stream.close()
    assert eng.generate(["x"], SamplingParams(temperature=0, max_tokens=2))[0].token_ids == [100, 200]


def test_submit_batch_indexes_prompts_then_choices(eng, tok):
    stream = eng.submit_batch([tok.encode("a"), tok.encode("b c")], SamplingParams(temperature=0, max_tokens=2, n=2))
    done = stream.collect_choices()
    assert [c.index for c in done] == [0, 1, 2, 3]
    assert [c.prompt_token_ids for c in done] == [tok.encode("a")] * 2 + [tok.encode("b c")] * 2
    assert all(c.token_ids == [100, 200] for c in done)
