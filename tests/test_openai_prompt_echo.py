"""echo with logprobs, prompt_logprobs in streams and the rank of a sampled token outside the
top logprobs: through the official openai client against the live server (ScriptedModel), and
the in-process API."""
import math

import openai
import pytest

from engine.params import SamplingParams
from tests.server_fixtures import LiveServer, default_tokenizer, script_ids, scripted_engine

PROMPT = "Hi there, friend"


@pytest.fixture(scope="module")
def engine():
    eng = scripted_engine(max_model_len=512)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def client(engine):
    with LiveServer(engine) as server, openai.OpenAI(base_url=server.base_url + "/v1", api_key="none",
                                                     max_retries=0, timeout=60) as c:
        yield c


def _concat_stream_logprobs(chunks) -> tuple[str, dict]:
    text, merged = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                for key in merged:
                    merged[key] += getattr(choice.logprobs, key)
    return text, merged


def test_echo_with_logprobs_covers_the_prompt_then_the_completion(client):
    tok = default_tokenizer()
    prompt_ids = tok.encode(PROMPT)
    kwargs = dict(model="default", prompt=PROMPT, temperature=0, max_tokens=3, echo=True, logprobs=2)
    reply = client.completions.create(**kwargs)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert choice.text == PROMPT + tok.decode(script_ids()[:3])
    assert len(lp.tokens) == len(prompt_ids) + 3
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets
    # the echoed part is the engine's prompt logprobs (vLLM's prompt_logprobs of the same request)
    plain = client.completions.create(model="default", prompt=PROMPT, temperature=0, max_tokens=3,
                                      extra_body={"prompt_logprobs": 2})
    prompt_lps = plain.choices[0].model_extra["prompt_logprobs"]
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt_ids)
    for i in range(1, len(prompt_ids)):
        assert lp.token_logprobs[i] == pytest.approx(prompt_lps[i][str(prompt_ids[i])]["logprob"])
        assert lp.token_logprobs[i] == pytest.approx(-math.log(tok.vocab_size), abs=1e-4)  # a flat prompt row
        assert len(lp.top_logprobs[i]) <= 3  # top 2, and the prompt token itself when outside them
    assert "prompt_logprobs" not in choice.model_extra or choice.model_extra["prompt_logprobs"] is None
    # streamed: the same text and logprobs, the prompt's in the first chunk
    chunks = list(client.completions.create(stream=True, **kwargs))
    text, merged = _concat_stream_logprobs(chunks)
    assert text == choice.text
    assert merged == {key: getattr(lp, key) for key in merged}
    assert len(chunks[0].choices[0].logprobs.tokens) == len(prompt_ids)


def test_streamed_prompt_logprobs_arrive_with_the_first_chunk(client):
    kwargs = dict(model="default", prompt=PROMPT, temperature=0, max_tokens=2, n=2,
                  extra_body={"prompt_logprobs": 1})
    expected = client.completions.create(**kwargs).choices[0].model_extra["prompt_logprobs"]
    assert expected[0] is None and all(entry for entry in expected[1:])
    chunks = list(client.completions.create(stream=True, **kwargs))
    seen = {}
    for chunk in chunks:
        for choice in chunk.choices:
            lps = choice.model_extra.get("prompt_logprobs")
            if choice.index not in seen:
                seen[choice.index] = lps
            else:
                assert lps is None  # only the first chunk of a choice carries them
    assert seen == {0: expected, 1: expected}

    messages = [{"role": "user", "content": "Say hello."}]
    chat_kwargs = dict(model="default", messages=messages, temperature=0, max_tokens=2,
                       extra_body={"prompt_logprobs": 1})
    chat_expected = client.chat.completions.create(**chat_kwargs).model_extra["prompt_logprobs"]
    chat_chunks = list(client.chat.completions.create(stream=True, **chat_kwargs))
    assert chat_chunks[0].model_extra["prompt_logprobs"] == chat_expected
    assert chat_chunks[0].choices[0].delta.role == "assistant"
    assert all(c.model_extra.get("prompt_logprobs") is None for c in chat_chunks[1:])
    assert sum(c.choices[0].delta.role == "assistant" for c in chat_chunks if c.choices) == 1


def test_a_sampled_token_outside_the_top_logprobs_has_its_rank(engine, client):
    tok = default_tokenizer()
    forced = tok.encode(" Paris", add_special_tokens=False)[0]
    params = SamplingParams(temperature=0, max_tokens=2, logprobs=True, top_logprobs=2, logit_bias={forced: 100})
    done = engine.generate([PROMPT], params)[0]
    first = done.logprobs[0]
    assert done.token_ids[0] == forced
    assert forced not in [t for t, _, _, _ in first.top]
    assert first.rank > 2  # among the model's own (raw) logprobs it is not in the top 2
    assert all(lp.rank is not None and lp.rank >= 1 for lp in done.logprobs)
    # over HTTP the legacy top_logprobs hold the sampled token too (OpenAI: up to logprobs + 1 entries)
    reply = client.completions.create(model="default", prompt=PROMPT, temperature=0, max_tokens=1, logprobs=2,
                                      logit_bias={str(forced): 100})
    top = reply.choices[0].logprobs.top_logprobs[0]
    assert len(top) == 3 and top[tok.decode([forced])] == pytest.approx(first.logprob)
