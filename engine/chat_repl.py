"""The interactive chat of ``python -m engine chat`` / ``llm-engine chat``.

One line per turn, with readline editing and history (kept in ~/.llm_engine_history, or
$LLM_ENGINE_HISTORY) on a terminal. Ctrl-C during a reply stops it (the request is aborted,
what was said so far stays in the conversation) and returns to the prompt; Ctrl-C at the
prompt clears the line; Ctrl-D, an empty line or /quit leaves. Commands:

    /reset               forget the conversation (the system message stays)
    /system [TEXT]       set the system message (no TEXT: remove it); the conversation restarts
    /params              show the sampling parameters
    /params KEY=VALUE .. change them (temperature=0.7 max_tokens=64 top_p=0.9 seed=1 ...)
    /help                this list
"""
from __future__ import annotations

import dataclasses
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from .params import SamplingParams

PROMPT = "> "
HISTORY_LENGTH = 1000
COMMANDS_HELP = __doc__[__doc__.index("    /reset"):].rstrip()


def _parse_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    return text


class ChatSession:
    """A conversation with an engine: ``handle(line)`` runs one line (a turn or a command) and
    returns False when the user leaves. ``write`` receives everything shown (stdout by default)."""

    def __init__(self, eng, params: SamplingParams, system: str | None = None,
                 write: Callable[[str], None] | None = None):
        self.eng = eng
        self.params = params
        self.system = system
        self.messages: list[dict] = []
        self._write = write or _stdout_write

    @property
    def conversation(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages

    def handle(self, line: str) -> bool:
        text = line.strip()
        if not text or text in ("/quit", "/exit"):
            return False
        if text.startswith("/"):
            self.command(text)
        else:
            self.turn(text)
        return True

    def command(self, text: str) -> None:
        name, _, rest = text.partition(" ")
        rest = rest.strip()
        if name == "/reset":
            self.messages.clear()
            self._write("(conversation cleared)\n")
        elif name == "/system":
            self.system = rest or None
            self.messages.clear()
            self._write(f"(system message {'set' if rest else 'removed'}; conversation cleared)\n")
        elif name == "/params":
            if rest:
                self.set_params(rest)
            self._write(self.describe_params() + "\n")
        elif name == "/help":
            self._write(COMMANDS_HELP + "\n")
        else:
            self._write(f"unknown command {name}; /help lists them\n")

    def set_params(self, assignments: str) -> None:
        changes = {}
        for item in assignments.split():
            key, sep, value = item.partition("=")
            if not sep:
                self._write(f"error: expected KEY=VALUE, got {item!r}\n")
                return
            changes[key] = _parse_value(value)
        try:
            self.params = dataclasses.replace(self.params, **changes)
        except TypeError as exc:  # an unknown field
            self._write(f"error: {exc}\n")
        except ValueError as exc:
            self._write(f"error: {exc}\n")

    def describe_params(self) -> str:
        p = self.params
        return (f"max_tokens={p.max_tokens} temperature={p.temperature} top_p={p.top_p} "
                f"top_k={p.top_k} seed={p.seed}")

    def turn(self, text: str) -> str:
        """Stream the reply to one user message; Ctrl-C stops it (the request is aborted)."""
        self.messages.append({"role": "user", "content": text})
        stream = self.eng.stream_chat(self.conversation, self.params)
        pieces: list[str] = []
        is_thinking = False  # a reasoning template's <think> block is shown between markers
        try:
            for event in stream:
                if event.reasoning_content:
                    if not is_thinking:
                        self._write("[thinking] ")
                        is_thinking = True
                    self._write(event.reasoning_content)
                if event.text and is_thinking:
                    self._write(" [/thinking]\n")
                    is_thinking = False
                self._write(event.text)
                pieces.append(event.text)
        except KeyboardInterrupt:
            stream.close()  # aborts the request: its KV blocks are freed at the next tick
            self._write(" [stopped]")
        finally:
            stream.close()
        self._write("\n")
        reply = "".join(pieces)
        self.messages.append({"role": "assistant", "content": reply})
        return reply


def _stdout_write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _history_path() -> Path:
    return Path(os.environ.get("LLM_ENGINE_HISTORY", Path.home() / ".llm_engine_history"))


def run_repl(session: ChatSession) -> int:
    """Read lines until the user leaves. On a terminal, readline gives editing and history."""
    is_tty = sys.stdin.isatty() and sys.stdout.isatty()
    readline = None
    if is_tty:
        # Ctrl-C must stop a reply even when this process was started with SIGINT ignored (a
        # shell's background job inherits SIG_IGN, and Python then installs no handler of its own).
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            import readline
        except ImportError:  # not on every platform
            readline = None
    history = _history_path()
    if readline is not None:
        readline.set_history_length(HISTORY_LENGTH)
        try:
            readline.read_history_file(history)
        except OSError:
            pass
    try:
        while True:
            try:
                line = input(PROMPT)
            except EOFError:
                if is_tty:
                    sys.stdout.write("\n")
                return 0
            except KeyboardInterrupt:  # at the prompt: drop the line, ask again
                sys.stdout.write("\n")
                continue
            if not session.handle(line):
                return 0
    finally:
        if readline is not None:
            try:
                readline.write_history_file(history)
            except OSError:
                pass
