"""The interactive chat: commands and Ctrl-C driven through ChatSession (ScriptedModel), and
once end to end on a pseudo-terminal with the default model (readline history, Ctrl-C stops
a reply and returns to the prompt, Ctrl-D leaves)."""
from __future__ import annotations

import fcntl
import os
import pty
import select
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

import engine
from engine.chat_repl import ChatSession
from engine.loader import default_model_path
from engine.params import SamplingParams
from engine.testing import ScriptedModel

REPO = Path(__file__).resolve().parents[1]
REPLY = "Bonjour! Paris is the capital."


@pytest.fixture(scope="module")
def tok():
    return engine.load_tokenizer(default_model_path())


@pytest.fixture
def eng(tok):
    script = tok.encode(REPLY, add_special_tokens=False)
    with engine.Engine(ScriptedModel(script, tok.vocab_size), tok, max_model_len=8192,
                       kv_cache_tokens=16384) as eng:
        yield eng


def make_session(eng, **kwargs):
    shown: list[str] = []
    reply_ids = engine.load_tokenizer(default_model_path()).encode(REPLY, add_special_tokens=False)
    params = SamplingParams(max_tokens=len(reply_ids), temperature=0)
    return ChatSession(eng, params, write=shown.append, **kwargs), shown


def test_turns_keep_the_conversation(eng):
    session, shown = make_session(eng, system="Be brief.")
    assert session.handle("Hi") and session.handle("And?")
    assert "".join(shown) == f"{REPLY}\n{REPLY}\n"
    assert [m["role"] for m in session.conversation] == ["system", "user", "assistant", "user", "assistant"]
    assert session.conversation[0]["content"] == "Be brief."


def test_reset_and_system(eng):
    session, shown = make_session(eng)
    session.handle("Hi")
    session.handle("/reset")
    assert session.conversation == []
    session.handle("Hi")
    session.handle("/system You are a pirate.")
    assert session.conversation == [{"role": "system", "content": "You are a pirate."}]
    session.handle("/system")
    assert session.conversation == [] and session.system is None


def test_params_show_and_change(eng):
    session, shown = make_session(eng)
    session.handle("/params temperature=0.5 max_tokens=7 seed=3")
    assert session.params.temperature == 0.5 and session.params.max_tokens == 7 and session.params.seed == 3
    assert "temperature=0.5" in shown[-1] and "max_tokens=7" in shown[-1]
    session.handle("/params temperature=-1")
    assert "temperature" in shown[-2] and shown[-2].startswith("error:")
    assert session.params.temperature == 0.5  # unchanged
    session.handle("/params colour=red")
    assert "colour" in shown[-2]
    session.handle("/nope")
    assert "unknown command" in shown[-1]
    assert session.handle("/quit") is False and session.handle("") is False


def test_ctrl_c_stops_the_reply_and_aborts_the_request(eng):
    """KeyboardInterrupt arriving mid-reply: the request is aborted, its KV freed, the partial
    reply stays in the conversation, and the session goes on."""
    pieces: list[str] = []

    def write(text: str) -> None:
        pieces.append(text)
        if len(pieces) == 3:
            raise KeyboardInterrupt

    session = ChatSession(eng, SamplingParams(max_tokens=5000, temperature=0, ignore_eos=True), write=write)
    assert session.handle("Tell me everything")
    assert pieces[-2:] == [" [stopped]", "\n"]
    partial = session.conversation[-1]["content"]
    assert session.conversation[-1]["role"] == "assistant" and 0 < len(partial) < len(REPLY) * 10
    deadline = time.monotonic() + 60
    while eng.stats()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = eng.stats()
    assert stats["num_running"] == 0 and stats["kv_usage"] == 0.0
    assert stats["num_generated_tokens"] < 5000


# ---------------------------------------------------------------- on a terminal

class Terminal:
    """A child process on a pseudo-terminal (its controlling tty: Ctrl-C sends SIGINT)."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.master, slave = pty.openpty()

        def become_session_leader():
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.process = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, cwd=REPO,
                                        preexec_fn=become_session_leader, close_fds=True)
        os.close(slave)
        self.output = b""

    def send(self, data: bytes) -> None:
        os.write(self.master, data)

    def expect(self, needle: bytes, timeout: float = 300, start: int = 0) -> int:
        deadline = time.monotonic() + timeout
        while needle not in self.output[start:]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"{needle!r} not seen; output so far: {self.output[-2000:]!r}")
            ready, _, _ = select.select([self.master], [], [], min(remaining, 1.0))
            if ready:
                try:
                    self.output += os.read(self.master, 4096)
                except OSError:  # the child closed the terminal
                    raise AssertionError(f"{needle!r} not seen before exit: {self.output[-2000:]!r}") from None
        return start + self.output[start:].index(needle) + len(needle)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(30)
        os.close(self.master)


@pytest.mark.slow
def test_terminal_session_ctrl_c_history_and_ctrl_d(tmp_path):
    history = tmp_path / "history"
    env = dict(os.environ, LLM_ENGINE_HISTORY=str(history), TERM="xterm", PYTHONIOENCODING="utf-8")
    term = Terminal([sys.executable, "-m", "engine", "chat", "--max-tokens", "2000", "--temperature", "0.8",
                     "--seed", "1"], env)
    try:
        at = term.expect(b"> ")
        term.send(b"Write a very long story about a dragon and a knight.\r")
        at = term.expect(b"\n", start=at)  # the echoed line
        time.sleep(0.5)
        at = term.expect(b" ", start=at)  # the reply has begun
        term.send(b"\x03")  # Ctrl-C
        at = term.expect(b"[stopped]", start=at)
        at = term.expect(b"> ", start=at)  # back at the prompt
        term.send(b"/params\r")
        at = term.expect(b"max_tokens=2000", start=at)
        at = term.expect(b"> ", start=at)
        term.send(b"\x1b[A\r")  # up arrow: the last line again, from readline's history
        at = term.expect(b"max_tokens=2000", start=at)
        at = term.expect(b"> ", start=at)
        term.send(b"\x04")  # Ctrl-D
        assert term.process.wait(60) == 0
    finally:
        term.close()
    assert b"Traceback" not in term.output
    lines = history.read_text().splitlines()  # kept for the next session
    assert "Write a very long story about a dragon and a knight." in lines and lines[-1] == "/params"
