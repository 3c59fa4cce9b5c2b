"""The server on Ray Serve (webapp.ray_serve): a local Ray started here, 2 ScriptedModel replicas.

One Ray instance for the whole module (start-up is slow); its teardown always shuts Ray down.
Every wait is bounded (client timeouts, wait_until), and a watchdog ends the process with a
traceback dump if the module ever runs past WATCHDOG_S.
"""
from __future__ import annotations

import faulthandler
import json
import os
import re
import threading

import httpx
import openai
import pytest
import ray  # noqa: E402  (ray[serve]: requirements-ray.txt)
from ray import serve  # noqa: E402

from tests.ray_fixtures import serve_port  # noqa: E402
from tests.server_fixtures import LiveServer, parse_sse, scripted_engine, wait_until  # noqa: E402
from webapp.ray_serve import DeployError, EngineSpec, deploy  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WATCHDOG_S = 420
API_KEY = "test-key"
MAX_NUM_SEQS = 4  # per replica: max_ongoing_requests
MAX_MODEL_LEN = 4096  # the Ray replicas and the single server alike (the errors name it)
SECONDS_PER_TICK = 0.005  # long streams last a few seconds: time to kill a replica mid-way
SYSTEM = ("You are a careful assistant for a shipping company. Answer in two sentences, cite the order "
          "number, never invent tracking data, and say so when you do not know. ") * 4
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def ray_url():
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = REPO + (os.pathsep + old_path if old_path else "")  # replicas import this tree
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = serve_port()
    try:
        spec = EngineSpec("tests.ray_fixtures:scripted_replica_engine",
                          {"seconds_per_tick": SECONDS_PER_TICK, "max_num_seqs": MAX_NUM_SEQS,
                           "max_model_len": MAX_MODEL_LEN}, model_name="default")
        deploy(spec, "127.0.0.1", port, num_replicas=2, num_cpus_per_replica=1, api_key=API_KEY,
               max_queued_requests=2)
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            faulthandler.cancel_dump_traceback_later()
            if old_path is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = old_path


@pytest.fixture(scope="module")
def single():
    eng = scripted_engine(max_model_len=MAX_MODEL_LEN)
    with LiveServer(eng, api_key=API_KEY) as server:
        yield server
    eng.close()


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _chunks(stream) -> list[dict]:
    """The streamed chunks as dicts, without what differs between any two runs (ids, timestamps)."""
    return [chunk.model_dump(exclude={"id", "created"}) for chunk in stream]


def test_openai_client_streams_what_the_single_server_streams(ray_url, single):
    ray_client, single_client = _client(ray_url), _client(single.base_url)
    chat = dict(model="default", messages=MESSAGES, temperature=0, logprobs=True, top_logprobs=2,
                stop=["中文"], max_tokens=100, stream=True, stream_options={"include_usage": True})
    expected = _chunks(single_client.chat.completions.create(**chat))
    assert len(expected) > 10 and expected[-1]["usage"]["completion_tokens"] > 0
    assert _chunks(ray_client.chat.completions.create(**chat)) == expected
    text = dict(model="default", prompt=["Once", [1, 2, 3]], n=2, max_tokens=12, temperature=0, logprobs=1,
                echo=False, stream=True)
    assert _chunks(ray_client.completions.create(**text)) == _chunks(single_client.completions.create(**text))
    one_shot = dict(model="default", messages=MESSAGES, temperature=0, max_tokens=30)
    got = ray_client.chat.completions.create(**one_shot).model_dump(exclude={"id", "created"})
    assert got == single_client.chat.completions.create(**one_shot).model_dump(exclude={"id", "created"})


def test_errors_and_auth_are_the_single_servers(ray_url, single):
    cases = [
        ("/v1/chat/completions", {"messages": MESSAGES, "temperature": -1}, {"Authorization": f"Bearer {API_KEY}"}),
        ("/v1/completions", {"prompt": "x" * 10, "max_tokens": 5000}, {"Authorization": f"Bearer {API_KEY}"}),
        ("/v1/chat/completions", {"messages": MESSAGES}, {"Authorization": "Bearer wrong"}),
        ("/v1/completions", b"{not json", {"Authorization": f"Bearer {API_KEY}"}),
    ]
    for path, body, headers in cases:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        got = httpx.post(ray_url + path, content=content, headers=headers, timeout=30)
        status, _, raw = single.request("POST", path, content, headers)
        assert (got.status_code, got.json()) == (status, json.loads(raw)), path
    assert httpx.get(ray_url + "/health", timeout=30).json() == {"status": "ok"}
    models = httpx.get(ray_url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30).json()
    assert models["data"][0]["id"] == "default" and models["data"][0]["max_model_len"] == MAX_MODEL_LEN


_RUN_FIELDS = {"id", "item_id", "created_at", "completed_at", "previous_response_id"}


def _without_ids(value):
    """A Responses object or event as a dict, without what differs between any two runs (ids, times)."""
    if hasattr(value, "model_dump"):
        value = value.model_dump()
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in _RUN_FIELDS}
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    return value


def test_responses_api_answers_as_the_single_server(ray_url, single):
    ray_client, single_client = _client(ray_url), _client(single.base_url)
    kwargs = dict(model="default", input="Say hello.", instructions="Be brief.", temperature=0,
                  max_output_tokens=100)
    expected = single_client.responses.create(**kwargs)
    got = ray_client.responses.create(**kwargs)
    assert got.id.startswith("resp_") and _without_ids(got) == _without_ids(expected)
    with single_client.responses.stream(**kwargs) as stream:
        expected_events = [_without_ids(e) for e in stream]
    with ray_client.responses.stream(**kwargs) as stream:
        events = [_without_ids(e) for e in stream]
        final = stream.get_final_response()
    assert len(events) > 10 and events == expected_events
    follow = ray_client.responses.create(model="default", input="Again.", previous_response_id=final.id,
                                         max_output_tokens=5)
    assert follow.usage.input_tokens > got.usage.input_tokens  # the stored conversation came first
    assert ray_client.responses.retrieve(follow.id).output_text == follow.output_text
    ray_client.responses.delete(follow.id)
    with pytest.raises(openai.NotFoundError):
        ray_client.responses.retrieve(follow.id)
    bad = {"input": [{"type": "function_call_output", "output": "1"}]}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    answer = httpx.post(ray_url + "/v1/responses", json=bad, headers=headers, timeout=30)
    status, _, raw = single.request("POST", "/v1/responses", json.dumps(bad).encode(), headers)
    assert (answer.status_code, answer.json()) == (status, json.loads(raw)) and status == 400


def test_fill_in_the_middle_routes_answer_as_the_single_server(ray_url, single):
    """The replicas' vocabulary (SmolLM2) has no FIM tokens: suffix and /infill are the same 400s."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    cases = [("/v1/completions", {"prompt": "def f():", "suffix": "\n", "max_tokens": 4}),
             ("/infill", {"input_prefix": "def f():", "input_suffix": "\n"}),
             ("/infill", {"input_prefix": "a", "n_indent": 4}),
             ("/v1/completions", {"prompt": "Once", "suffix": "", "max_tokens": 3, "temperature": 0})]
    for path, body in cases:
        got = httpx.post(ray_url + path, json=body, headers=headers, timeout=30)
        status, _, raw = single.request("POST", path, json.dumps(body).encode(), headers)
        expected = json.loads(raw)
        if status == 200:
            got_body = got.json()
            assert got_body["choices"][0]["text"] == expected["choices"][0]["text"]
        else:
            assert (got.status_code, got.json()) == (status, expected) and status == 400, path


def test_prefix_sharing_requests_land_on_one_replica(ray_url):
    replica_ids = set()
    for turn in range(6):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Where is order {turn}?"}]
        response = httpx.post(ray_url + "/v1/chat/completions", timeout=30,
                              headers={"Authorization": f"Bearer {API_KEY}"},
                              json={"messages": messages, "max_tokens": 4, "temperature": 0})
        assert response.status_code == 200, response.text
        replica_ids.add(response.headers["x-replica-id"])
    assert len(replica_ids) == 1  # random choice among 2 replicas would split 6 requests 31 times in 32


def test_metrics_count_requests_at_the_ingress_and_sum_the_replicas_engine_stats(ray_url):
    def metric(text: str, name: str) -> float:
        line = next(line for line in text.splitlines() if line.startswith(f"llm:{name}{{"))
        return float(line.rsplit(" ", 1)[1])

    def scrape() -> str:
        return httpx.get(ray_url + "/metrics", timeout=30).text

    # engine counters come from the replicas' stats, which Ray refreshes every second
    assert wait_until(lambda: metric(scrape(), "prefix_cache_queries_total") > 0, timeout=30, interval=0.5)
    text = scrape()
    assert metric(text, "engine_alive") == 1.0
    assert re.search(r'^llm:http_requests_total\{[^}]*endpoint="chat"[^}]*status="ok"[^}]*\} [1-9]', text, re.M)
    assert metric(text, "time_to_first_token_seconds_count") > 0  # measured at the ingress
    assert metric(text, "request_queue_time_seconds_count") > 0  # reported by the replicas


def _long_stream_body(max_tokens: int = 900) -> dict:
    return {"messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}


def test_full_replica_queues_give_429_with_retry_after(ray_url):
    """2 replicas x MAX_NUM_SEQS running + 2 queued in the router: more requests are refused at once."""
    num_requests = 2 * MAX_NUM_SEQS + 2 + 4
    results: list[tuple[int, str | None]] = []
    lock = threading.Lock()

    def one(k: int) -> None:
        body = _long_stream_body(400)
        body["messages"] = [{"role": "user", "content": f"request {k}"}]
        with httpx.stream("POST", ray_url + "/v1/chat/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            response.read()
            with lock:
                results.append((response.status_code, response.headers.get("retry-after"),
                                response.json() if response.status_code != 200 else None))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(num_requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    refused = [r for r in results if r[0] == 429]
    assert len(results) == num_requests
    assert refused and all(r[1] == "1" and r[2]["error"]["code"] == "rate_limit_exceeded" for r in refused)
    assert all(r[0] in (200, 429) for r in results)
    # Ray counts a request as queued until a replica has taken it, so a burst is refused before
    # every replica slot fills (docs/scale-out.md): fewer than 2 x MAX_NUM_SEQS may run.
    assert sum(r[0] == 200 for r in results) >= 2


def _replica_stats(replica_id: str) -> dict:
    """One replica's engine stats, asked of that replica's actor as Serve's controller asks it
    (the deployment handle's router would send the call to the idler replica, never to the
    one busy with the stream under test)."""
    stats = ray.get(ray.get_actor(replica_id, namespace="serve").record_routing_stats.remote(), timeout=30)
    assert stats["replica_id"] == replica_id
    return stats


def test_client_leaving_mid_stream_aborts_the_request_on_its_replica(ray_url):
    body = _long_stream_body(3000)  # ~15 s at SECONDS_PER_TICK: a slow, loaded machine still sees it cut short
    with httpx.stream("POST", ray_url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        replica_id = response.headers["x-replica-id"]
        before = _replica_stats(replica_id)["num_generated_tokens"]
        next(line for line in response.iter_lines() if line.startswith("data: "))
    # the client is gone: the replica's engine stops the request long before its 3000 tokens
    assert wait_until(lambda: _replica_stats(replica_id)["num_running"] == 0, timeout=60, interval=0.2)
    assert _replica_stats(replica_id)["num_generated_tokens"] - before < 3000


def test_replica_killed_mid_stream_ends_in_band_then_next_request_succeeds(ray_url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", ray_url + "/v1/chat/completions", json=_long_stream_body(), headers=headers,
                      timeout=60) as response:
        assert response.status_code == 200
        replica_id = response.headers["x-replica-id"]
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["choices"][0]["delta"]["role"] == "assistant"
        ray.kill(ray.get_actor(replica_id, namespace="serve"), no_restart=True)
        rest = "\n\n".join(line for line in lines if line)
    events = parse_sse(rest.encode() + b"\n\n")
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == "engine_dead" and error["type"] == "server_error"
    assert not any("finish_reason" in str(e) and e["choices"][0]["finish_reason"] for e in events[:-2]
                   if isinstance(e, dict) and "choices" in e)
    # the official client raises the in-band error
    client = _client(ray_url)
    stream = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=5, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    # Ray replaces the dead replica: two replicas serve again
    def two_running() -> bool:
        app = serve.status().applications.get("llm-engine")
        deployment = app and app.deployments.get("EngineReplica")
        return bool(deployment) and deployment.replica_states.get("RUNNING", 0) == 2
    assert wait_until(two_running, timeout=120, interval=0.5)


def test_replica_that_cannot_load_its_model_fails_the_deployment(ray_url):
    port = int(ray_url.rsplit(":", 1)[1])
    spec = EngineSpec("tests.ray_fixtures:failing_engine", {})
    with pytest.raises(DeployError) as failure:
        deploy(spec, "127.0.0.1", port, app_name="broken", num_replicas=1, num_cpus_per_replica=0)
    assert "does not exist" in str(failure.value)


@pytest.mark.parametrize("argv, message", [
    (["--ray-replicas", "0"], "--ray-replicas must be a positive integer"),
    (["--ray-replicas", "2", "--allowed-origins", "*"], "--allowed-origins is not supported with Ray Serve"),
])
def test_cli_rejects_bad_ray_options_before_starting_ray(argv, message, capsys):
    from webapp.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--port", "0", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
