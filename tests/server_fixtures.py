"""Live-server helpers for the webapp tests: a scripted engine, a gate on its ticks, a server on a free port.

Import from test modules (tests/conftest.py is not ours):
    from tests.server_fixtures import LiveServer, GatedModel, scripted_engine, wait_until
"""
from __future__ import annotations

import http.client
import json
import threading
import time

import engine
from engine.loader import default_model_path
from engine.testing import ScriptedModel
from webapp import make_server

SCRIPT_TEXT = 'Hello there! "Quoted" \\ back, tab\there, é, 😀 and 中文. The end.'
_TOKENIZER = None


def default_tokenizer():
    """The embedded model's tokenizer (loaded once per test session)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = engine.load_tokenizer(default_model_path())
    return _TOKENIZER


def script_ids(text: str = SCRIPT_TEXT, with_eos: bool = True) -> list[int]:
    tok = default_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    return ids + [min(tok.eos_token_ids)] if with_eos else ids


class CountingModel(ScriptedModel):
    """ScriptedModel that records how many sequences each forward carries (``sequences_per_forward``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sequences_per_forward: list[int] = []

    def forward(self, batch, kv_cache):
        self.sequences_per_forward.append(len(batch.array("query_starts")) - 1)
        return super().forward(batch, kv_cache)


class GatedModel:
    """A ScriptedModel whose ticks wait for permits: tests decide when generation may go on."""

    def __init__(self, token_ids: list[int], vocab_size: int):
        self.inner = ScriptedModel(token_ids, vocab_size)
        self.vocab_size = vocab_size
        self.max_model_len = None
        self._cond = threading.Condition()
        self._permits: int | None = None  # None: open, no waiting
        self.num_forwards = 0

    def make_kv_cache(self, num_blocks: int, block_size: int):
        return self.inner.make_kv_cache(num_blocks, block_size)

    def forward(self, batch, kv_cache):
        with self._cond:
            while self._permits is not None and self._permits <= 0:
                self._cond.wait(0.05)
            if self._permits is not None:
                self._permits -= 1
            self.num_forwards += 1
        return self.inner.forward(batch, kv_cache)

    def hold(self, num_ticks: int = 0) -> None:
        """From now on, run only num_ticks more ticks until allow()/open()."""
        with self._cond:
            self._permits = num_ticks
            self._cond.notify_all()

    def allow(self, num_ticks: int) -> None:
        with self._cond:
            self._permits = (self._permits or 0) + num_ticks
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._permits = None
            self._cond.notify_all()


def scripted_engine(text: str = SCRIPT_TEXT, gated: bool = False, with_eos: bool = True, peak: float | None = None,
                    **options):
    """peak: the scripted token's logit (ScriptedModel's default 20 leaves it p ~ 0.99985 at
    temperature 1, so a long unseeded script strays now and then; tests of what the text
    parses into pass 40: p ~ 1 - 2e-9)."""
    tok = default_tokenizer()
    ids = script_ids(text, with_eos)
    if gated:
        model = GatedModel(ids, tok.vocab_size)
    else:
        model = ScriptedModel(ids, tok.vocab_size) if peak is None else ScriptedModel(ids, tok.vocab_size, peak)
    options.setdefault("max_model_len", 1024)
    return engine.Engine(model, tok, **options)


class LiveServer:
    """The production server (webapp.make_server) on 127.0.0.1 and a free port, in a thread."""

    def __init__(self, eng, **options):
        self.engine = eng
        self.server = make_server(eng, "127.0.0.1", 0, **options)
        self.port = self.server.effective_port
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-server", daemon=True)

    def _run(self) -> None:
        # waitress's own run() never returns; closing its sockets from another thread while it
        # sits in select() raises EBADF in this thread. Poll in short slices until told to stop.
        while not self._stop.is_set():
            self.server.asyncore.loop(timeout=0.05, map=self.server._map, count=1)

    def __enter__(self) -> LiveServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.task_dispatcher.shutdown(timeout=5)  # handler threads first, then the loop, then the sockets
        self._stop.set()
        self._thread.join(5)
        self.server.close()

    def connection(self, timeout: float = 30) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def request(self, method: str, path: str, body=None, headers=None) -> tuple[int, dict, bytes]:
        """One request; body: dict (sent as JSON) or bytes. Returns (status, headers, raw body)."""
        conn = self.connection()
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
            conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
        finally:
            conn.close()

    def post_json(self, path: str, body, headers=None) -> tuple[int, dict]:
        status, _, raw = self.request("POST", path, body, headers)
        return status, json.loads(raw)

    def stream_events(self, path: str, body: dict, headers=None) -> tuple[int, list]:
        """POSTs a streaming request and parses its SSE body: list of chunk dicts, then "[DONE]"."""
        status, resp_headers, raw = self.request("POST", path, body, headers)
        if status != 200:
            return status, [json.loads(raw)]
        assert resp_headers["content-type"].startswith("text/event-stream")
        return status, parse_sse(raw)


def parse_sse(raw: bytes) -> list:
    events = []
    for block in raw.decode("utf-8").split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def wait_until(predicate, timeout: float = 20.0, interval: float = 0.01) -> bool:
    """Polls predicate until it is true; False if it never became true (the test then fails)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
