"""Start-up fails fast and shows progress: model files and the port are checked before any
weights load, a user's mistake is one line and exit status 2, a truncated GGUF is named as
such, an HF directory without its tokenizer fails before its weights load, the server serves
on the socket bound first, and the load shows its stages (a bar on a terminal, log lines
otherwise)."""
from __future__ import annotations

import io
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

import engine
import engine.loader
from engine.errors import ModelFileError
from engine.loader import default_model_path
from engine.startup import LoadProgress, PortInUseError, bind_listen_socket, check_model_path
from engine.testing import ScriptedModel

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 300  # seconds; none of these load weights


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=TIMEOUT)


def assert_one_line_error(result: subprocess.CompletedProcess, *words: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    for word in words:
        assert word in lines[0]
    assert "loading" not in result.stderr  # failed before the load began


@pytest.fixture(scope="module")
def model_bytes() -> bytes:
    return Path(default_model_path()).read_bytes()


@pytest.fixture
def truncated_gguf(tmp_path, model_bytes) -> Path:
    path = tmp_path / "truncated.gguf"
    path.write_bytes(model_bytes[: len(model_bytes) * 2 // 3])  # a download cut short
    return path


@pytest.fixture
def hf_dir_without_tokenizer(tmp_path) -> Path:
    directory = tmp_path / "hf-model"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (directory / "model.safetensors").write_bytes(b"\0" * 16)
    return directory


# ---------------------------------------------------------------- check_model_path

def test_the_default_model_passes_the_check():
    check_model_path(default_model_path())


@pytest.mark.parametrize("keep", ["two_thirds", "header_only", "32_bytes"])
def test_a_truncated_gguf_is_named_as_such(tmp_path, model_bytes, keep):
    size = {"two_thirds": len(model_bytes) * 2 // 3, "header_only": 4096, "32_bytes": 32}[keep]
    path = tmp_path / "cut.gguf"
    path.write_bytes(model_bytes[:size])
    with pytest.raises(ModelFileError, match="truncated GGUF") as info:
        check_model_path(path)
    assert info.value.path == str(path) and str(path) in str(info.value)


def test_a_corrupt_tensor_table_is_named_as_such(tmp_path, model_bytes):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (2**62).to_bytes(8, "little") + model_bytes[16:4096])
    with pytest.raises(ModelFileError, match="corrupt GGUF"):
        check_model_path(path)


@pytest.mark.parametrize("kind", ["missing", "not_gguf", "empty_dir"])
def test_other_bad_paths(tmp_path, kind):
    path = tmp_path / "model.gguf"
    if kind == "not_gguf":
        path.write_text("hello")
    elif kind == "empty_dir":
        path = tmp_path / "dir"
        path.mkdir()
    with pytest.raises(ModelFileError) as info:
        check_model_path(path)
    assert str(info.value).startswith(str(path))


def test_hf_dir_without_tokenizer_fails_before_its_weights_load(hf_dir_without_tokenizer, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(engine.loader, "load_model", no_load)
    with pytest.raises(ModelFileError, match="tokenizer.json"):
        engine.Engine.from_pretrained(hf_dir_without_tokenizer)


def test_bad_gguf_fails_before_weights_in_from_pretrained(truncated_gguf, monkeypatch):
    monkeypatch.setattr(engine.loader, "load_model", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(ModelFileError, match="truncated GGUF"):
        engine.Engine.from_pretrained(truncated_gguf)


# ---------------------------------------------------------------- command lines

@pytest.mark.parametrize("module", ["webapp", "engine"])
def test_missing_and_truncated_models_are_one_line_errors(module, tmp_path, truncated_gguf):
    command = [] if module == "webapp" else ["chat", "hi"]
    missing = tmp_path / "nope.gguf"
    assert_one_line_error(run_module(module, *command, "--model", str(missing)), str(missing), "no such file")
    assert_one_line_error(run_module(module, *command, "--model", str(truncated_gguf)), "truncated GGUF")


def test_hf_dir_without_tokenizer_is_a_one_line_error(hf_dir_without_tokenizer):
    assert_one_line_error(run_module("webapp", "--model", str(hf_dir_without_tokenizer)), "tokenizer.json")


def test_bad_engine_option_is_a_one_line_error():
    assert_one_line_error(run_module("webapp", "--max-num-seqs", "0", "--port", "0"), "max_num_seqs")
    assert_one_line_error(run_module("webapp", "--port", "70000"), "--port")


def test_port_in_use_fails_before_the_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_module("webapp", "--port", str(port))
    assert_one_line_error(result, f"127.0.0.1:{port}", "in use")


def test_bind_listen_socket_errors_are_typed():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(PortInUseError, match="in use"):
            bind_listen_socket("127.0.0.1", taken.getsockname()[1])
    with pytest.raises(PortInUseError):
        bind_listen_socket("no-such-host.invalid", 8000)


def test_server_serves_on_the_socket_bound_first():
    import webapp

    tok = engine.load_tokenizer(default_model_path())
    sock = bind_listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with engine.Engine(ScriptedModel([1, 2], tok.vocab_size), tok, max_model_len=256) as eng:
        server = webapp.make_server(eng, sock=sock, threads=webapp.RESERVED_THREADS + 2)
        assert int(server.effective_port) == port
        stop = threading.Event()

        def run() -> None:  # as tests/server_fixtures.LiveServer: short slices, so closing is clean
            while not stop.is_set():
                server.asyncore.loop(timeout=0.05, map=server._map, count=1)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as response:
                assert response.status == 200
        finally:
            server.task_dispatcher.shutdown(timeout=5)
            stop.set()
            thread.join(30)
            server.close()


def test_python_m_webapp_freezes_its_start_up_heap_before_serving():
    """The server process moves its start-up objects out of the collector's scans (a full
    collection of them held the GIL for ~160 ms), then serves."""
    import re
    import time

    proc = subprocess.Popen([sys.executable, "-m", "webapp", "--port", "0"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    lines = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if "serving on http" in line:
                break
        log = "".join(lines)
        froze = re.search(r"froze (\d+) start-up objects", log)
        assert froze is not None and "serving on http" in log, log
        assert int(froze.group(1)) > 10_000  # the imports and the model's objects
        assert log.index("froze") < log.index("serving on http")
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stderr.close()


# ---------------------------------------------------------------- progress

def test_load_progress_logs_stages_when_not_a_terminal(caplog, monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    with caplog.at_level(logging.INFO, logger="engine"):
        with LoadProgress("model-x", num_stages=2) as load:
            load.stage("reading")
            load.stage("building")
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == "loading model-x"
    assert messages[1].startswith("  reading: ") and messages[2].startswith("  building: ")
    assert messages[3].startswith("loaded model-x in ")


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_load_progress_draws_a_bar_on_a_terminal(caplog, monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with caplog.at_level(logging.INFO, logger="engine"):
        with LoadProgress("model-x", num_stages=2) as load:
            load.stage("reading")
            load.stage("building")
    output = terminal.getvalue()
    assert "reading" in output and "building" in output and "loaded model-x: 2/2" in output
    assert not caplog.records  # the bar instead of log lines


def test_load_progress_is_silent_when_disabled(caplog, monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with caplog.at_level(logging.INFO, logger="engine"):
        with LoadProgress("model-x", num_stages=1, enabled=False) as load:
            load.stage("reading")
    assert terminal.getvalue() == "" and not caplog.records
