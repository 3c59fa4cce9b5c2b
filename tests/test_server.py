"""The HTTP server live on 127.0.0.1 (waitress, a free port) over a ScriptedModel engine."""
import json
import socket
import threading

import pytest

from tests.server_fixtures import SCRIPT_TEXT, LiveServer, parse_sse, script_ids, scripted_engine, wait_until
from webapp.sse_pump import SSEPump

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def server():
    eng = scripted_engine(max_model_len=256)
    with LiveServer(eng, max_body_bytes=64 * 1024) as live:
        yield live
    eng.close()


def chat_body(**fields):
    return {"model": "x", "messages": MESSAGES, "temperature": 0, **fields}


def streamed_text(events) -> str:
    assert events[-1] == "[DONE]"
    parts = []
    for e in events[:-1]:
        for choice in e["choices"]:
            parts.append(choice["delta"]["content"] if "delta" in choice else choice["text"])
    return "".join(parts)


def test_health_models_metrics(server):
    assert server.request("GET", "/health")[0] == 200
    status, models = 200, json.loads(server.request("GET", "/v1/models")[2])
    assert models["object"] == "list" and models["data"][0]["id"] == "default"
    server.post_json(CHAT, chat_body(max_tokens=3))
    status, headers, raw = server.request("GET", "/metrics")
    text = raw.decode()
    assert status == 200 and headers["content-type"].startswith("text/plain")
    model = 'model_name="default"'
    for name in ("llm:http_requests_total", "llm:generation_tokens_total", "llm:prompt_tokens_total",
                 "llm:time_to_first_token_seconds_bucket", "llm:inter_token_latency_seconds_bucket",
                 "llm:e2e_request_latency_seconds_bucket", "llm:request_queue_time_seconds_bucket",
                 "llm:num_requests_running", "llm:num_requests_waiting", "llm:kv_cache_usage_perc",
                 "llm:prefix_cache_queries_total", "llm:prefix_cache_hits_total", "llm:num_preemptions_total",
                 "llm:spec_decode_num_draft_tokens_total", "llm:spec_decode_num_accepted_tokens_total"):
        assert any(line.startswith(name + "{") and model in line for line in text.splitlines()), name
    assert 'llm:http_requests_total{endpoint="chat",model_name="default",status="ok"}' in text
    assert 'llm:request_success_total{finished_reason="length",model_name="default"}' in text


def test_chat_stream_equals_non_stream(server):
    status, full = server.post_json(CHAT, chat_body(logprobs=True, top_logprobs=2))
    assert status == 200
    choice = full["choices"][0]
    assert choice["message"]["content"] == SCRIPT_TEXT and choice["finish_reason"] == "stop"
    status, events = server.stream_events(CHAT, chat_body(logprobs=True, top_logprobs=2, stream=True,
                                                           stream_options={"include_usage": True}))
    assert status == 200
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in e["choices"][0]["delta"] for e in events[1:-2])
    assert streamed_text(events) == SCRIPT_TEXT
    streamed_lps = [c for e in events[:-2] for c in e["choices"][0]["logprobs"]["content"]]
    assert streamed_lps == choice["logprobs"]["content"]
    assert all(len(c["top_logprobs"]) == 2 for c in streamed_lps)
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    assert events[-2]["choices"] == [] and events[-2]["usage"] == full["usage"]
    assert full["usage"]["completion_tokens"] == len(streamed_lps)


def test_completions_stream_equals_non_stream(server):
    body = {"prompt": "Once upon a time", "temperature": 0, "max_tokens": 6, "logprobs": 1}
    status, full = server.post_json(COMPLETIONS, body)
    assert status == 200 and full["object"] == "text_completion"
    assert full["choices"][0]["finish_reason"] == "length" and full["usage"]["completion_tokens"] == 6
    status, events = server.stream_events(COMPLETIONS, {**body, "stream": True})
    assert streamed_text(events) == full["choices"][0]["text"]
    tokens = [t for e in events[:-1] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert tokens == full["choices"][0]["logprobs"]["tokens"]
    offsets = [t for e in events[:-1] for t in e["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == full["choices"][0]["logprobs"]["text_offset"]


def test_stop_string(server):
    status, full = server.post_json(CHAT, chat_body(stop=["Quoted", "zzz"]))
    assert full["choices"][0]["message"]["content"] == SCRIPT_TEXT[: SCRIPT_TEXT.index("Quoted")]
    assert full["choices"][0]["finish_reason"] == "stop"
    status, events = server.stream_events(CHAT, chat_body(stop="Quoted", stream=True))
    assert streamed_text(events) == SCRIPT_TEXT[: SCRIPT_TEXT.index("Quoted")]


BAD_INPUT = [
    # (body, expected status, expected error code or param)
    (b"{", 400, None),
    (b"\xff\xfe not utf-8", 400, None),
    (b'[{"role": "user"}]', 400, None),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 7}]}, 400, "messages[0].content"),
    (chat_body(max_tokens=-5), 400, "max_tokens"),
    (chat_body(max_tokens="ten"), 400, "max_tokens"),
    (chat_body(temperature=-1), 400, "temperature"),
    (chat_body(n=0), 400, "n"),
    (chat_body(n=1000), 400, "n"),
    (chat_body(n="3"), 400, "n"),
    (chat_body(logit_bias="junk"), 400, "logit_bias"),
    (chat_body(logit_bias={"abc": 1}), 400, "logit_bias"),
    (chat_body(logit_bias={"5": 150}), 400, "logit_bias"),
    (chat_body(logit_bias={"5": "x"}), 400, "logit_bias"),
    (chat_body(logit_bias={"999999": 1}), 400, "logit_bias"),  # beyond the vocabulary
    (chat_body(presence_penalty=2.5), 400, "presence_penalty"),
    (chat_body(presence_penalty="high"), 400, "presence_penalty"),
    (chat_body(frequency_penalty=-3), 400, "frequency_penalty"),
    (chat_body(frequency_penalty=[0]), 400, "frequency_penalty"),
    (chat_body(repetition_penalty=0), 400, "repetition_penalty"),
    (chat_body(repetition_penalty=-1.5), 400, "repetition_penalty"),
    (chat_body(min_p=2), 400, "min_p"),
    (chat_body(min_p=True), 400, "min_p"),
    (chat_body(min_tokens=-1), 400, "min_tokens"),
    (chat_body(min_tokens="1"), 400, "min_tokens"),
    (chat_body(allowed_token_ids=[]), 400, "allowed_token_ids"),
    (chat_body(allowed_token_ids=[10**7]), 400, "allowed_token_ids"),
    (chat_body(prompt_logprobs=-1), 400, "prompt_logprobs"),
    (chat_body(prompt_logprobs=21, stream=True), 400, "prompt_logprobs"),
    (chat_body(best_of=4), 400, "best_of"),
    (chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}), 400,
     "response_format"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), 400,
     "tools[0].function.parameters"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f"}}],
               tool_choice={"type": "function", "function": {"name": "g"}}), 400, "tool_choice"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}}}],
               tool_choice="required"), 400, "tools"),
    (chat_body(tool_choice="required"), 400, "tool_choice"),
    (chat_body(guided_json={"type": "integer", "minimum": "zero"}), 400, "guided_json"),
    (chat_body(guided_regex="[a-z"), 400, "guided_regex"),
    (chat_body(guided_choice=[]), 400, "guided_choice"),
    (chat_body(guided_grammar="start: undefined_rule"), 400, "guided_grammar"),
    (chat_body(structured_outputs={"grammar": "root ::= (\"x\""}), 400, "structured_outputs.grammar"),
    (chat_body(guided_regex="a+", guided_choice=["a"]), 400, "guided_choice"),
    (chat_body(use_beam_search=True), 400, "use_beam_search"),
    (chat_body(max_tokens=10**9), 400, "context_length_exceeded"),
    (chat_body(messages=[{"role": "user", "content": "word " * 300}], max_tokens=10), 400,
     "context_length_exceeded"),
    (b'{"messages": [{"role": "user", "content": "' + b"a" * 70_000 + b'"}]}', 413, "request_too_large"),
]


@pytest.mark.parametrize("body, status, detail", BAD_INPUT)
def test_bad_input_gets_openai_error_and_server_keeps_serving(server, body, status, detail):
    got, headers, raw = server.request("POST", CHAT, body)
    assert got == status
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert "Traceback" not in error["message"]
    if detail is not None:
        assert detail in (error["param"], error["code"])
    ok, full = server.post_json(CHAT, chat_body(max_tokens=2))
    assert ok == 200 and full["usage"]["completion_tokens"] == 2


BAD_COMPLETIONS = [
    ({"prompt": ["a", 5]}, "prompt"),
    ({"prompt": [[1, 2], [-1]]}, "prompt[1]"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "x", "suffix": "tail"}, "suffix"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
    ({"prompt": "x", "guided_json": "{oops"}, "guided_json"),
    ({"prompt": "x", "guided_regex": "(a"}, "guided_regex"),
    ({"prompt": ["x"] * 3, "n": 100}, "n"),
]


@pytest.mark.parametrize("body, param", BAD_COMPLETIONS)
def test_bad_completions_input_names_the_field(server, body, param):
    got, _, raw = server.request("POST", COMPLETIONS, body)
    assert got == 400 and json.loads(raw)["error"]["param"] == param


def test_harmless_values_of_unimplemented_fields_are_accepted(server):
    status, full = server.post_json(CHAT, chat_body(max_tokens=2, response_format={"type": "text"}, tools=[],
                                                    tool_choice="none", user="u", metadata={"k": "v"}, store=False))
    assert status == 200 and full["usage"]["completion_tokens"] == 2


def test_schema_lists_every_declared_field(server):
    status, _, raw = server.request("GET", "/v1/schema")
    schema = json.loads(raw)
    assert status == 200
    chat = schema["chat"]["properties"]
    assert {"logit_bias", "presence_penalty", "n", "min_p", "response_format"} <= set(chat)
    assert chat["response_format"]["anyOf"][0]["properties"]["type"] == {"const": "text"}
    assert "echo" in schema["completions"]["properties"] and "messages" not in schema["completions"]["properties"]


def test_wrong_method_and_path_are_json_errors(server):
    status, _, raw = server.request("GET", CHAT)
    assert status == 405 and json.loads(raw)["error"]["code"] == "method_not_allowed"
    status, _, raw = server.request("GET", "/v1/nothing")
    assert status == 404 and json.loads(raw)["error"]["type"] == "invalid_request_error"


def test_concurrent_streams(server):
    results = [None] * 8

    def run(k):
        results[k] = server.stream_events(CHAT, chat_body(stream=True))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for status, events in results:
        assert status == 200 and streamed_text(events) == SCRIPT_TEXT


def _open_stream(port: int, body: dict) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    return sock


def _read_until(sock: socket.socket, marker: bytes, data: bytes = b"") -> bytes:
    while marker not in data:
        piece = sock.recv(65536)
        if not piece:
            break
        data += piece
    return data


def test_first_chunk_arrives_before_generation_ends():
    eng = scripted_engine(gated=True)
    model = eng.model
    model.hold(1)  # one tick: the prefill, which samples the first token; then generation waits
    try:
        with LiveServer(eng) as live:
            sock = _open_stream(live.port, chat_body(stream=True))
            head = _read_until(sock, b"data: ")
            head = _read_until(sock, b"\n\n", head[head.index(b"data: "):])
            assert b'"content":"Hello"' in head  # the first token, delivered ...
            assert eng.stats()["num_running"] == 1  # ... while the request is still generating
            model.open()
            rest = _read_until(sock, b"data: [DONE]", head)
            assert b'"finish_reason":"stop"' in rest
            sock.close()
    finally:
        model.open()
        eng.close()


def test_client_disconnect_aborts_request_and_frees_kv():
    eng = scripted_engine(gated=True, with_eos=False)
    model = eng.model
    model.hold(2)
    try:
        with LiveServer(eng) as live:
            sock = _open_stream(live.port, chat_body(stream=True, max_tokens=500, ignore_eos=True))
            _read_until(sock, b"\n\n", _read_until(sock, b"data: "))
            assert eng.stats()["num_running"] == 1 and eng.stats()["kv_usage"] > 0
            sock.close()
            num_before = model.num_forwards
            for _ in range(20):  # let the engine run one tick at a time until the abort lands
                if wait_until(lambda: eng.stats()["num_running"] == 0, timeout=0.5):
                    break
                model.allow(1)
            stats = eng.stats()
            assert stats["num_running"] == 0 and stats["num_waiting"] == 0
            assert stats["kv_usage"] == 0.0
            # aborted within a few ticks (1-2 measured), not generated on to max_tokens
            assert model.num_forwards - num_before <= 5
            metrics = live.request("GET", "/metrics")[2].decode()
            assert 'llm:http_requests_total{endpoint="chat",model_name="default",status="abort"} 1.0' in metrics
    finally:
        model.open()
        eng.close()


def test_full_waiting_queue_answers_429():
    eng = scripted_engine(gated=True, max_num_seqs=1, max_waiting=1)
    model = eng.model
    model.hold(0)
    results = {}
    try:
        with LiveServer(eng) as live:
            def run(name):
                results[name] = live.post_json(CHAT, chat_body(max_tokens=3))

            first = threading.Thread(target=run, args=("running",))
            first.start()
            assert wait_until(lambda: eng.stats()["num_running"] == 1)
            second = threading.Thread(target=run, args=("waiting",))
            second.start()
            assert wait_until(lambda: eng.stats()["num_waiting"] == 1)
            status, headers, raw = live.request("POST", CHAT, chat_body(max_tokens=3))
            assert status == 429 and int(headers["retry-after"]) >= 1
            assert json.loads(raw)["error"]["type"] == "rate_limit_error"
            model.open()
            first.join(30)
            second.join(30)
            assert results["running"][0] == 200 and results["waiting"][0] == 200
    finally:
        model.open()
        eng.close()


def test_api_key_required_on_v1_only():
    eng = scripted_engine()
    try:
        with LiveServer(eng, api_key="sekret") as live:
            assert live.request("GET", "/v1/models")[0] == 401
            status, _, raw = live.request("GET", "/v1/models", headers={"Authorization": "Bearer wrong"})
            assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
            assert live.request("POST", CHAT, chat_body())[0] == 401
            assert live.request("GET", "/v1/models", headers={"Authorization": "Bearer sekret"})[0] == 200
            status, full = live.post_json(CHAT, chat_body(max_tokens=2), headers={"Authorization": "Bearer sekret"})
            assert status == 200
            assert live.request("GET", "/health")[0] == 200
            assert live.request("GET", "/")[0] == 200
    finally:
        eng.close()


def test_dead_engine_gives_503():
    eng = scripted_engine()
    with LiveServer(eng) as live:
        assert live.request("GET", "/health")[0] == 200
        eng.close()
        status, _, raw = live.request("GET", "/health")
        assert status == 503 and json.loads(raw)["error"]["type"] == "server_error"
        assert live.request("POST", CHAT, chat_body())[0] == 503
        assert live.request("GET", "/metrics")[0] == 200


def test_chat_page_is_served(server):
    status, headers, raw = server.request("GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html") and b"/static/app.js" in raw
    status, headers, raw = server.request("GET", "/static/app.js")
    assert status == 200 and b"/v1/chat/completions" in raw


def test_parse_sse_helper_rejects_garbage():
    with pytest.raises(AssertionError):
        parse_sse(b"event: x\n\n")


def test_failed_tick_is_reported_in_band_and_server_keeps_serving():
    eng = scripted_engine(gated=True)
    model = eng.model
    real_forward = model.forward

    num_calls = [0]

    def failing_forward(batch, kv_cache):
        num_calls[0] += 1
        if num_calls[0] == 3:  # one failed tick: it fails the requests in it, not the engine
            raise RuntimeError("simulated kernel failure")
        return real_forward(batch, kv_cache)

    model.forward = failing_forward
    try:
        with LiveServer(eng) as live:
            status, events = live.stream_events(CHAT, chat_body(stream=True))
            assert status == 200 and events[-1] == "[DONE]"
            assert events[-2]["error"]["type"] == "server_error"
            assert "simulated kernel failure" in events[-2]["error"]["message"]
            assert "Traceback" not in json.dumps(events[-2])
            assert all("choices" in e for e in events[:-2]) and len(events) > 2
            assert live.request("GET", "/health")[0] == 200  # everyone else keeps being served
            status, full = live.post_json(CHAT, chat_body())
            assert status == 200 and full["choices"][0]["message"]["content"] == SCRIPT_TEXT
    finally:
        eng.close()


def test_cli_builds_engine_and_serves_on_localhost_by_default(monkeypatch):
    import engine
    import engine.startup
    import webapp
    from webapp.__main__ import main

    calls = {}

    class FakeEngine:
        def close(self):
            calls["closed"] = True

    def fake_from_pretrained(model=None, progress=False, **options):
        calls["model"], calls["options"], calls["progress"] = model, options, progress
        return FakeEngine()

    def fake_serve(eng, **kwargs):
        calls["serve"] = kwargs

    def fake_bind(host, port):  # the port is taken before the model loads
        assert "model" not in calls
        calls["bind"] = (host, port)
        return "bound-socket"

    monkeypatch.setattr(engine.Engine, "from_pretrained", staticmethod(fake_from_pretrained))
    monkeypatch.setattr(webapp, "serve", fake_serve)
    monkeypatch.setattr(engine.startup, "bind_listen_socket", fake_bind)
    main(["--max-model-len", "2048", "--max-num-seqs", "4", "--kv-cache-tokens", "8192", "--api-key", "k",
          "--dtype", "bfloat16"])
    assert calls["model"] is None and calls["progress"] is True
    assert calls["options"] == {"dtype": "bfloat16", "max_model_len": 2048, "max_num_seqs": 4, "kv_cache_tokens": 8192}
    assert calls["bind"] == ("127.0.0.1", 8000) and calls["serve"]["sock"] == "bound-socket"
    assert calls["serve"]["api_key"] == "k" and calls["serve"]["model_name"] == "SmolLM2-135M-Instruct"
    assert calls["closed"]


def _queued_stream(eng, num_ticks: int, max_tokens: int = 8):
    """A stream whose engine ran num_ticks ticks (one event each) that nobody has read yet."""
    import engine

    eng.model.hold(num_ticks)
    stream = eng.stream("Hi", engine.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    assert wait_until(lambda: stream._group.outputs.qsize() >= num_ticks)
    return stream


def test_ready_events_takes_the_queued_events_and_keeps_errors_in_order():
    eng = scripted_engine(gated=True)
    try:
        stream = _queued_stream(eng, 4)
        first = next(stream)
        later = stream.ready_events()
        assert len(later) == 3 and stream.ready_events() == []  # nothing queued: returns at once
        eng.model.open()
        rest = list(stream)
        ids = first.token_ids + [i for e in later + rest for i in e.token_ids]
        assert len(ids) == 8 and rest[-1].finish_reason == "length"
        assert stream.ready_events() == []

        # A failed tick after two good ones: ready_events stops before the error; next() raises it.
        real_forward = eng.model.inner.forward
        calls = [0]

        def failing(batch, kv_cache):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("simulated kernel failure")
            return real_forward(batch, kv_cache)

        eng.model.inner.forward = failing
        stream = _queued_stream(eng, 3)
        assert len(next(stream).token_ids) == 1 and len(stream.ready_events()) == 1
        with pytest.raises(Exception, match="simulated kernel failure"):
            next(stream)
        with pytest.raises(StopIteration):
            next(stream)
    finally:
        eng.close()


def _check_scripted_completion(eng, events, num_tokens: int) -> None:
    """A completions stream of the scripted text's first num_tokens tokens: text, usage, [DONE]."""
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == num_tokens
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == eng.tokenizer.decode(script_ids()[:num_tokens])


def _handoff(stream, send, backlog, is_disconnected):
    """A completions stream (usage on) for the pump, writing through ``send``."""
    from cext.chunk import ChunkWriter
    from webapp import sse_pump
    from webapp.metrics import RequestRecord

    return sse_pump.Handoff(stream, ChunkWriter("cmpl-1", "m", 1, False), RequestRecord("completions", 1), True,
                            None, send, backlog, is_disconnected)


def test_events_queued_behind_a_slow_handler_go_out_in_one_write():
    from cext.chunk import ChunkWriter
    from webapp.metrics import RequestRecord, ServerMetrics
    from webapp.sse import stream_chunks

    eng = scripted_engine(gated=True)
    try:
        stream = _queued_stream(eng, 5, max_tokens=7)
        metrics = ServerMetrics(eng, "m")
        record = RequestRecord("completions", 1)
        chunks = stream_chunks(stream, ChunkWriter("cmpl-1", "m", 1, False), record, metrics, include_usage=True)
        first = next(chunks)
        frames = parse_sse(first)
        assert len(frames) == 5  # the five queued events, one write
        eng.model.open()
        events = frames + [e for c in chunks for e in parse_sse(c)]
        _check_scripted_completion(eng, events, 7)
        assert record.num_generated == 7
    finally:
        eng.close()


@pytest.mark.parametrize("defer", [False, True])
def test_concurrent_streams_written_by_one_pump_thread_are_exact(defer):
    """Past its first chunk a waitress stream is written by the engine's one pump thread
    (webapp.sse_pump): every stream still gets exactly its own text, usage and [DONE]; also when
    the ticks' events are queued by the engine's output worker, which then wakes the pump."""
    eng = scripted_engine(gated=True, max_num_seqs=8)
    eng._core.defer_min_forward_s = 0.0 if defer else float("inf")
    eng._core.defer_min_rows = 1
    eng.model.hold(0)  # all eight wait, then start in one tick: each finds the others running
    want = eng.tokenizer.decode(script_ids()[:20])
    try:
        with LiveServer(eng, threads=24) as live:
            results = [None] * 8

            def run(i):
                results[i] = live.stream_events(CHAT, chat_body(stream=True, max_tokens=20,
                                                                stream_options={"include_usage": True}))

            threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
            for t in threads:
                t.start()
            assert wait_until(lambda: eng.stats()["num_running"] + eng.stats()["num_waiting"] == 8)
            pump = SSEPump.for_engine(eng)
            for _ in range(5):  # a tick at a time until every handler had a first chunk to hand off
                eng.model.allow(1)
                if wait_until(lambda: pump.num_handed_off == 8, timeout=5.0):
                    break
            eng.model.open()
            for t in threads:
                t.join(60)
            assert pump.num_handed_off == 8  # each stream went on in the pump after its first chunk
            assert (eng._core._output.num_handed_off > 10) == defer
            for status, events in results:
                assert status == 200 and events[-1] == "[DONE]"
                assert events[-2]["usage"]["completion_tokens"] == 20
                text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-2] if e["choices"])
                assert text == want
            metrics = live.request("GET", "/metrics")[2].decode()
            assert 'llm:http_requests_total{endpoint="chat",model_name="default",status="ok"} 8.0' in metrics
    finally:
        eng.close()


def _pumps_asked_at_once(eng, num_threads: int) -> list:
    barrier = threading.Barrier(num_threads)
    pumps = []

    def ask():
        barrier.wait()
        pumps.append(SSEPump.for_engine(eng))

    threads = [threading.Thread(target=ask) for _ in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return pumps


def test_an_engine_has_one_pump_whoever_asks_first():
    """Handlers that ask for the pump at once get the same one, made once and woken by one tick
    listener; a dropped engine does not keep it."""
    import gc
    import weakref

    eng = scripted_engine()
    try:
        pumps = _pumps_asked_at_once(eng, 8)
        assert len(pumps) == 8 and all(p is pumps[0] for p in pumps)
        assert len(eng._core._tick_listeners) == 1
        pump_ref = weakref.ref(pumps[0])
    finally:
        eng.close()
    del eng, pumps
    gc.collect()
    assert pump_ref() is None


def test_pump_skips_a_backed_up_connection_and_keeps_its_events():
    """A connection whose socket holds more than BACKLOG_BYTES unsent is skipped (its events wait
    on their queue and go out together once it drains): the pump never blocks on one reader."""
    from webapp import sse_pump

    eng = scripted_engine(gated=True)
    try:
        stream = _queued_stream(eng, 5, max_tokens=7)
        sent, backlog = [], [sse_pump.BACKLOG_BYTES + 1]
        handoff = _handoff(stream, sent.append, lambda: backlog[0], lambda: False)
        assert handoff.pump() is False and sent == []  # backed up: nothing taken from the queue
        backlog[0] = 0
        assert handoff.pump() is False and len(parse_sse(sent[0])) == 5  # the five queued events, one write
        eng.model.open()
        assert wait_until(lambda: handoff.pump())
        assert handoff.status == "ok" and handoff.done.is_set()
        _check_scripted_completion(eng, [e for chunk in sent for e in parse_sse(chunk)], 7)
    finally:
        eng.close()


def _waitress_disconnect():
    from waitress.channel import ClientDisconnected

    return ClientDisconnected("client left")


@pytest.mark.parametrize("error, seen_gone, status", [
    (lambda: OSError("connection reset"), True, "abort"),
    (lambda: OSError("connection reset"), False, "abort"),  # the write's own error says it
    (_waitress_disconnect, False, "abort"),
    (lambda: RuntimeError("a bug in the write"), False, "error"),
])
def test_pump_ends_a_stream_whose_client_left_and_keeps_the_others(error, seen_gone, status):
    """A write that fails ends its stream: an abort when the client left (the channel says so, or
    the error is a socket's or waitress's ClientDisconnected), an error otherwise."""
    eng = scripted_engine(gated=True)
    try:
        stream = _queued_stream(eng, 3, max_tokens=50)

        def gone(data):
            raise error()

        handoff = _handoff(stream, gone, lambda: 0, lambda: seen_gone)
        assert handoff.pump() is True and handoff.status == status and handoff.done.is_set()
    finally:
        eng.model.open()
        eng.close()


def test_a_lone_stream_stays_on_its_handler_thread():
    """One stream alone gains nothing from the pump (one wake-up per token either way): it is not handed off."""
    eng = scripted_engine()
    try:
        with LiveServer(eng) as live:
            status, events = live.stream_events(CHAT, chat_body(stream=True, max_tokens=12))
            assert status == 200 and events[-1] == "[DONE]"
            assert SSEPump.for_engine(eng).num_handed_off == 0
    finally:
        eng.close()
