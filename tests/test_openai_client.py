"""The official openai client (pinned in requirements-test.txt) against the live server, unchanged."""
import openai
import pytest

from tests.server_fixtures import SCRIPT_TEXT, LiveServer, scripted_engine

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def live():
    eng = scripted_engine(max_model_len=512)
    with LiveServer(eng, api_key="test-key") as server:
        yield server
    eng.close()


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="test-key", max_retries=0, timeout=60) as c:
        yield c


def test_models(client):
    assert [m.id for m in client.models.list()] == ["default"]


def test_streaming_chat_with_logprobs_stop_and_usage(client):
    kwargs = dict(model="default", messages=MESSAGES, temperature=0, logprobs=True, top_logprobs=3,
                  stop=["中文", "never"], max_tokens=100)
    full = client.chat.completions.create(**kwargs)
    expected = SCRIPT_TEXT[: SCRIPT_TEXT.index("中文")]
    assert full.choices[0].message.content == expected
    assert full.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    texts, logprobs, finish, usage, roles = [], [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            roles.append(choice.delta.role)
            texts.append(choice.delta.content or "")
            if choice.logprobs is not None:
                logprobs.extend(choice.logprobs.content)
            finish = choice.finish_reason or finish
    assert "".join(texts) == expected
    assert roles[0] == "assistant" and finish == "stop"
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.completion_tokens == full.usage.completion_tokens == len(logprobs)
    assert [lp.token for lp in logprobs] == [lp.token for lp in full.choices[0].logprobs.content]
    assert [lp.logprob for lp in logprobs] == [lp.logprob for lp in full.choices[0].logprobs.content]
    assert all(len(lp.top_logprobs) == 3 and lp.top_logprobs[0].token == lp.token for lp in logprobs)
    assert bytes(b for lp in logprobs for b in lp.bytes).decode("utf-8").startswith(expected)


def test_completions(client):
    full = client.completions.create(model="default", prompt="Once", max_tokens=5, temperature=0, logprobs=2)
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 5
    assert len(full.choices[0].logprobs.tokens) == 5
    parts = [c.choices[0].text for c in client.completions.create(
        model="default", prompt="Once", max_tokens=5, temperature=0, stream=True)]
    assert "".join(parts) == full.choices[0].text == SCRIPT_TEXT[: len(full.choices[0].text)]


def test_completions_without_max_tokens_stop_at_16_tokens_chat_runs_on():
    script = " ".join(f"w{i}" for i in range(40))  # ~80 tokens, no EOS: only a limit ends it
    eng = scripted_engine(script, with_eos=False, max_model_len=256)
    try:
        with LiveServer(eng) as server, openai.OpenAI(base_url=server.base_url + "/v1", api_key="x",
                                                      max_retries=0, timeout=60) as c:
            done = c.completions.create(model="default", prompt="Once")
            assert done.usage.completion_tokens == 16 and done.choices[0].finish_reason == "length"
            chunks = list(c.completions.create(model="default", prompt="Once", stream=True))
            assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == done.choices[0].text
            batched = c.completions.create(model="default", prompt=["a", "b"])
            assert [ch.finish_reason for ch in batched.choices] == ["length", "length"]
            assert batched.usage.completion_tokens == 32
            rest = c.completions.create(model="default", prompt="Once", max_tokens=None)  # null: the context
            assert rest.usage.completion_tokens == 256 - rest.usage.prompt_tokens
            reply = c.chat.completions.create(model="default", messages=MESSAGES)  # chat: the rest of it
            assert reply.usage.completion_tokens == 256 - reply.usage.prompt_tokens
            assert reply.choices[0].finish_reason == "length"
    finally:
        eng.close()


def test_errors_become_client_exceptions(client, live):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=[], max_tokens=1)
    assert info.value.status_code == 400
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=100_000)
    assert info.value.code == "context_length_exceeded"
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


@pytest.mark.slow
def test_default_model_streamed_equals_non_streamed():
    import engine

    eng = engine.Engine.from_pretrained(max_model_len=512)
    try:
        with LiveServer(eng) as server, openai.OpenAI(base_url=server.base_url + "/v1", api_key="x",
                                                      max_retries=0, timeout=300) as c:
            kwargs = dict(model="m", messages=[{"role": "user", "content": "Name three colors."}],
                          temperature=0, max_tokens=24)
            full = c.chat.completions.create(**kwargs)
            streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
                **kwargs, stream=True) if ch.choices)
            assert full.choices[0].message.content and streamed == full.choices[0].message.content
    finally:
        eng.close()
