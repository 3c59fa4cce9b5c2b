"""Sampling options, n > 1, batched prompts, echo and the tokenizer endpoints through the official
openai client (and plain HTTP for vLLM's extra routes), against the live server."""
import json

import openai
import pytest

from tests.server_fixtures import SCRIPT_TEXT, LiveServer, default_tokenizer, script_ids, scripted_engine

MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def live():
    eng = scripted_engine(max_model_len=512)
    with LiveServer(eng) as server:
        yield server
    eng.close()


@pytest.fixture(scope="module")
def client(live):
    with openai.OpenAI(base_url=live.base_url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def chat_tokens(client, **kwargs) -> list[str]:
    reply = client.chat.completions.create(model="default", messages=MESSAGES, temperature=0, logprobs=True,
                                           **kwargs)
    return [lp.token for lp in reply.choices[0].logprobs.content]


def test_minus_100_bias_removes_a_token_the_greedy_answer_had(client):
    ids = script_ids()
    plain = chat_tokens(client, max_tokens=4)
    biased = chat_tokens(client, max_tokens=4, logit_bias={str(ids[0]): -100})
    assert plain[0] != biased[0] and plain[0] not in biased
    assert biased[0] == plain[1]  # the script's runner-up


def test_plus_100_bias_forces_a_token(client):
    forced = default_tokenizer().encode(" Paris", add_special_tokens=False)[0]
    reply = client.completions.create(model="default", prompt="The capital of France is", temperature=0,
                                      max_tokens=3, logit_bias={str(forced): 100})
    assert reply.choices[0].text == default_tokenizer().decode([forced] * 3)


def test_penalties_and_min_p_are_honoured(client):
    num_tokens = len(script_ids()) + 14  # past the script the model repeats EOS; 20 - (2 * 10 + 2) < 0
    plain = chat_tokens(client, max_tokens=num_tokens, extra_body={"ignore_eos": True})
    penalized = chat_tokens(client, max_tokens=num_tokens, frequency_penalty=2.0, presence_penalty=2.0,
                            extra_body={"ignore_eos": True, "min_p": 0.1, "repetition_penalty": 1.2})
    assert plain[: len(script_ids()) - 1] == penalized[: len(script_ids()) - 1]  # the script first
    assert len(set(penalized)) > len(set(plain))  # then the penalties move off the repeated id


def test_n3_with_a_seed_gives_three_distinct_reproducible_choices(client):
    kwargs = dict(model="default", messages=MESSAGES, n=3, seed=7, temperature=20.0, max_tokens=6)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3
    assert texts == [c.message.content for c in again.choices]
    assert first.usage.completion_tokens == 18


def test_n2_streams_each_choice_with_its_index(client):
    stream = client.chat.completions.create(model="default", messages=MESSAGES, n=2, temperature=0,
                                            max_tokens=200, stream=True)
    texts, roles, finish = {0: [], 1: []}, {0: [], 1: []}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index].append(choice.delta.content or "")
            roles[choice.index].append(choice.delta.role)
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert ["".join(texts[i]) for i in (0, 1)] == [SCRIPT_TEXT, SCRIPT_TEXT]
    assert roles[0][0] == roles[1][0] == "assistant" and finish == {0: "stop", 1: "stop"}


def test_batched_prompts_and_echo(client):
    tok = default_tokenizer()
    prompts = ["Once upon", "a time"]
    reply = client.completions.create(model="default", prompt=prompts, temperature=0, max_tokens=3, n=2)
    first3 = tok.decode(script_ids()[:3])
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert all(c.text == first3 for c in reply.choices)
    assert reply.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert reply.usage.completion_tokens == 12
    ids = tok.encode("token ids", add_special_tokens=False)
    echoed = client.completions.create(model="default", prompt=["Hi there", ids], temperature=0, max_tokens=2,
                                       echo=True)
    assert echoed.choices[0].text == "Hi there" + tok.decode(script_ids()[:2])
    assert echoed.choices[1].text == tok.decode(ids) + tok.decode(script_ids()[:2])
    stream = client.completions.create(model="default", prompt="Hi there", temperature=0, max_tokens=2, echo=True,
                                       stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == echoed.choices[0].text


def test_prompt_logprobs_over_http(live):
    tok = default_tokenizer()
    status, body = live.post_json("/v1/completions", {"prompt": "one two three", "max_tokens": 1,
                                                      "prompt_logprobs": 2, "temperature": 0})
    assert status == 200
    entries = body["choices"][0]["prompt_logprobs"]
    ids = tok.encode("one two three")
    assert entries[0] is None and len(entries) == len(ids)
    for token_id, entry in zip(ids[1:], entries[1:]):
        assert str(token_id) in entry and len(entry) in (2, 3)
        assert all(v["logprob"] <= 0 for v in entry.values())


def test_tokenize_detokenize_version(live):
    tok = default_tokenizer()
    status, body = live.post_json("/tokenize", {"prompt": "Hello world", "return_token_strs": True})
    assert status == 200 and body["tokens"] == tok.encode("Hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512 and "".join(body["token_strs"]) == tok.decode(body["tokens"], False)
    status, chat = live.post_json("/tokenize", {"messages": MESSAGES})
    assert chat["tokens"] == tok.encode_chat(MESSAGES, add_generation_prompt=True)
    status, bare = live.post_json("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False})
    assert len(bare["tokens"]) < len(chat["tokens"])
    status, back = live.post_json("/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "Hello world"}
    for path, bad, param in (("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"messages": "x"}, "messages"),
                             ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": "x"}, "tokens"),
                             ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
                             ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function"}]},
                              "tools[0].function")):
        status, err = live.post_json(path, bad)
        assert status == 400 and err["error"]["param"] == param
    status, _, raw = live.request("GET", "/version")
    assert status == 200 and json.loads(raw)["version"]


def test_cors_is_off_by_default_and_follows_allowed_origins(live):
    _, headers, _ = live.request("GET", "/v1/models", headers={"Origin": "https://a.example"})
    assert "access-control-allow-origin" not in headers
    eng = live.engine
    with LiveServer(eng, allowed_origins=["https://a.example"], api_key="k") as server:
        preflight = {"Origin": "https://a.example", "Access-Control-Request-Method": "POST",
                     "Access-Control-Request-Headers": "authorization, content-type"}
        status, headers, _ = server.request("OPTIONS", "/v1/chat/completions", headers=preflight)
        assert status == 204 and headers["access-control-allow-origin"] == "https://a.example"
        assert "POST" in headers["access-control-allow-methods"]
        status, headers, _ = server.request("GET", "/v1/models", headers={"Origin": "https://a.example",
                                                                          "Authorization": "Bearer k"})
        assert status == 200 and headers["access-control-allow-origin"] == "https://a.example"
        _, headers, _ = server.request("GET", "/v1/models", headers={"Origin": "https://evil.example",
                                                                     "Authorization": "Bearer k"})
        assert "access-control-allow-origin" not in headers


def test_bad_words_and_allowed_token_ids(client):
    tok = default_tokenizer()
    plain = client.completions.create(model="default", prompt="x", temperature=0, max_tokens=3).choices[0].text
    first_word = plain.split()[0] if plain.split() else plain
    banned = client.completions.create(model="default", prompt="x", temperature=0, max_tokens=3,
                                       extra_body={"bad_words": [first_word]}).choices[0].text
    assert first_word in plain and first_word not in banned
    only = tok.encode(" ok", add_special_tokens=False)
    allowed = client.completions.create(model="default", prompt="x", temperature=0, max_tokens=3,
                                        extra_body={"allowed_token_ids": only}).choices[0].text
    assert allowed == tok.decode(only * 3)
