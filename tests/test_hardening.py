"""Overload, slow clients and limits (issue: hardening): the server always answers its probes,
rejects what it cannot take with a clear 4xx, and no request can fail another."""
import json
import socket
import threading
import time

import pytest

import engine
from engine.errors import EngineOverloaded, InvalidParameterError
from tests.server_fixtures import LiveServer, scripted_engine, wait_until

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(**fields):
    return {"model": "x", "messages": [{"role": "user", "content": "Say something."}], "temperature": 0, **fields}


def test_probes_answer_while_every_generation_slot_is_taken():
    eng = scripted_engine(gated=True)
    model = eng.model
    model.hold(0)
    results = []
    try:
        with LiveServer(eng, threads=10) as live:  # 10 threads - 8 reserved: 2 generation slots
            def run():
                results.append(live.post_json(CHAT, chat_body(max_tokens=3)))

            runners = [threading.Thread(target=run) for _ in range(2)]
            for t in runners:
                t.start()
            assert wait_until(lambda: eng.stats()["num_running"] + eng.stats()["num_waiting"] == 2)
            status, headers, raw = live.request("POST", CHAT, chat_body(max_tokens=3))
            assert status == 429 and int(headers["retry-after"]) >= 1
            assert "concurrent" in json.loads(raw)["error"]["message"]
            for path in ("/health", "/metrics", "/v1/models"):
                assert live.request("GET", path)[0] == 200
            model.open()
            for t in runners:
                t.join(30)
            assert [r[0] for r in results] == [200, 200]
            assert live.post_json(CHAT, chat_body(max_tokens=2))[0] == 200  # slots were given back
            metrics = live.request("GET", "/metrics")[2].decode()
            assert 'llm:http_requests_total{endpoint="chat",model_name="default",status="http_429"} 1.0' in metrics
    finally:
        model.open()
        eng.close()


def _raw_exchange(port: int, data: bytes, timeout: float = 10) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def test_oversized_bodies_get_json_413_at_any_size():
    eng = scripted_engine()
    try:
        with LiveServer(eng, max_body_bytes=1024) as live:
            status, headers, raw = live.request("POST", CHAT, b"x" * 2048)  # Flask's limit
            assert status == 413 and json.loads(raw)["error"]["code"] == "request_too_large"
            # Past the WSGI server's own limit it refuses from the headers alone, in JSON too.
            head = (f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {1 << 30}\r\n\r\n").encode()
            reply = _raw_exchange(live.port, head + b"{}")
            status_line, _, rest = reply.partition(b"\r\n")
            assert b" 413 " in status_line
            body = rest.split(b"\r\n\r\n", 1)[1]
            assert json.loads(body)["error"]["code"] == "request_too_large"
    finally:
        eng.close()


def test_connections_that_never_finish_their_headers_are_closed_and_lock_nobody_out():
    eng = scripted_engine()
    try:
        with LiveServer(eng, channel_timeout=1) as live:
            stalled = []
            for _ in range(50):
                sock = socket.create_connection(("127.0.0.1", live.port), timeout=10)
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
                stalled.append(sock)
            assert live.post_json(CHAT, chat_body(max_tokens=2))[0] == 200
            deadline = time.monotonic() + 15
            for sock in stalled:  # each is closed by the server once idle past the timeout
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                assert sock.recv(1024) == b""
                sock.close()
    finally:
        eng.close()


def test_requests_rejected_while_parsing_are_counted():
    eng = scripted_engine()
    try:
        with LiveServer(eng) as live:
            assert live.request("POST", CHAT, b"{not json")[0] == 400
            assert live.post_json(COMPLETIONS, {"model": "x"})[0] == 400
            metrics = live.request("GET", "/metrics")[2].decode()
            assert 'llm:http_requests_total{endpoint="chat",model_name="default",status="http_400"} 1.0' in metrics
            assert ('llm:http_requests_total{endpoint="completions",model_name="default",status="http_400"} 1.0'
                    in metrics)
    finally:
        eng.close()


def test_a_kv_cache_smaller_than_the_context_lowers_it_and_requests_fit():
    eng = scripted_engine(with_eos=False, kv_cache_tokens=100, max_model_len=1024)
    try:
        assert eng.max_model_len == 112  # whole blocks of 16
        with LiveServer(eng) as live:
            status, body = live.post_json(COMPLETIONS, {"model": "x", "prompt": [1, 2, 3], "ignore_eos": True,
                                                        "max_tokens": None})  # null: the rest of the context
            assert status == 200 and body["usage"]["completion_tokens"] == 112 - 3
            assert body["choices"][0]["finish_reason"] == "length"
            status, body = live.post_json(COMPLETIONS, {"model": "x", "prompt": [1] * 200})
            assert status == 400 and body["error"]["code"] == "context_length_exceeded"
            assert body["error"]["param"] == "prompt"
            status, body = live.post_json(COMPLETIONS, {"model": "x", "prompt": [1] * 10, "max_tokens": 200})
            assert status == 400 and body["error"]["param"] == "max_tokens"
            long_chat = chat_body(messages=[{"role": "user", "content": "word " * 300}])
            status, body = live.post_json(CHAT, long_chat)
            assert status == 400 and body["error"]["param"] == "messages"
            status, body = live.post_json(CHAT, chat_body(seed=2 ** 64))
            assert status == 400 and body["error"]["param"] == "seed"
    finally:
        eng.close()


def test_a_duplicate_request_id_is_rejected_and_the_original_runs_on():
    eng = scripted_engine(gated=True)
    eng.model.hold(0)
    try:
        original = eng.stream("hello", engine.SamplingParams(max_tokens=3, temperature=0), request_id="same")
        with pytest.raises(InvalidParameterError) as info:
            eng.stream("hello", engine.SamplingParams(max_tokens=3), request_id="same")
        assert info.value.param == "request_id"
        eng.model.open()
        done = original.collect()
        assert done.finish_reason in ("length", "stop") and done.token_ids
        # Once finished, the id is free again.
        assert eng.stream("hi", engine.SamplingParams(max_tokens=1), request_id="same").collect().token_ids
    finally:
        eng.model.open()
        eng.close()


def test_a_burst_never_admits_past_max_waiting():
    eng = scripted_engine(gated=True, max_num_seqs=1, max_waiting=4)
    eng.model.hold(0)
    streams, rejected = [], []
    lock = threading.Lock()
    try:
        streams.append(eng.stream("first", engine.SamplingParams(max_tokens=2)))
        assert wait_until(lambda: eng.stats()["num_running"] == 1)

        def submit():
            try:
                s = eng.stream("burst", engine.SamplingParams(max_tokens=2))
                with lock:
                    streams.append(s)
            except EngineOverloaded:
                with lock:
                    rejected.append(1)

        burst = [threading.Thread(target=submit) for _ in range(32)]
        for t in burst:
            t.start()
        for t in burst:
            t.join(30)
        assert len(streams) == 1 + 4 and len(rejected) == 28
        eng.model.open()
        assert all(s.collect().finish_reason == "length" for s in streams)
    finally:
        eng.model.open()
        eng.close()


def test_stats_after_close_report_nothing_running():
    eng = scripted_engine(gated=True)
    eng.model.hold(0)
    stream = eng.stream("hello", engine.SamplingParams(max_tokens=5))  # kept: dropping it aborts
    assert wait_until(lambda: eng.stats()["num_running"] == 1)
    eng.model.open()
    eng.close()
    del stream
    stats = eng.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0 and stats["kv_usage"] == 0.0
