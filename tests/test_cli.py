"""The command line, run as a user runs it: `python -m engine chat|complete` in a subprocess.

Replies are checked against the same request made in-process through the public API
(greedy, so both are the default model's one answer). Also: Engine.generate(progress=True).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import engine
from engine.loader import default_model_path
from engine.params import SamplingParams
from engine.testing import ScriptedModel

REPO = Path(__file__).resolve().parents[1]
TIMEOUT = 600  # seconds; loading the default model on a busy machine
MAX_TOKENS = 8
QUESTION = "What is the capital of France?"
PROMPT = "Once upon a time"


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        cwd=REPO, input=stdin, capture_output=True, text=True, encoding="utf-8", env=env, timeout=TIMEOUT,
    )


@pytest.fixture(scope="module")
def default_engine():
    with engine.Engine.from_pretrained() as eng:
        yield eng


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


@pytest.mark.slow
def test_chat_one_message(default_engine):
    reply = default_engine.chat([{"role": "user", "content": QUESTION}], greedy()).text
    assert reply.strip()
    result = run_cli("chat", QUESTION, "--max-tokens", str(MAX_TOKENS))
    assert result.returncode == 0, result.stderr
    assert result.stdout == reply + "\n"


@pytest.mark.slow
def test_chat_with_system_message(default_engine):
    system = "You are a pirate. Answer briefly."
    messages = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    reply = default_engine.chat(messages, greedy()).text
    result = run_cli("chat", QUESTION, "--system", system, "--max-tokens", str(MAX_TOKENS))
    assert result.returncode == 0, result.stderr
    assert result.stdout == reply + "\n"


@pytest.mark.slow
def test_complete(default_engine):
    [done] = default_engine.generate([PROMPT], greedy())
    assert done.text
    result = run_cli("complete", PROMPT, "--max-tokens", str(MAX_TOKENS))
    assert result.returncode == 0, result.stderr
    assert result.stdout == PROMPT + done.text + "\n"


@pytest.mark.slow
def test_interactive_chat_keeps_the_conversation(default_engine):
    """Without a message, chat reads one turn per line from stdin; an empty line quits."""
    first, second = "Hi! My name is Ada.", "What is my name?"
    messages = [{"role": "user", "content": first}]
    reply1 = default_engine.chat(messages, greedy()).text
    messages += [{"role": "assistant", "content": reply1}, {"role": "user", "content": second}]
    reply2 = default_engine.chat(messages, greedy()).text
    result = run_cli("chat", "--max-tokens", str(MAX_TOKENS), stdin=f"{first}\n{second}\n\n")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"> {reply1}\n> {reply2}\n> "


@pytest.mark.parametrize(
    "args, field",
    [
        (["--temperature", "-1"], "temperature"),
        (["--temperature", "nan"], "temperature"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-p", "0"], "top_p"),
    ],
)
@pytest.mark.parametrize("command", ["chat", "complete"])
def test_bad_sampling_option_exits_nonzero_naming_it(command, args, field):
    result = run_cli(command, "hello", *args)
    assert result.returncode != 0
    assert field in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize(
    "args, word",
    [
        (["chat", "hi", "--dtype", "float16"], "dtype"),
        (["chat", "hi", "--max-tokens", "many"], "max-tokens"),
        (["translate", "hi"], "command"),
        ([], "command"),
    ],
)
def test_bad_arguments_exit_with_usage(args, word):
    result = run_cli(*args)
    assert result.returncode == 2
    assert word in result.stderr and "usage:" in result.stderr


@pytest.mark.parametrize("kind", ["missing", "not_a_model"])
def test_bad_model_path_is_a_clean_error(tmp_path, kind):
    """A typo in --model (or a file that is no model) gets an error naming the path, not a stack trace."""
    path = tmp_path / "no-such-model.gguf"
    if kind == "not_a_model":
        path.write_text("this is not a model\n")
    result = run_cli("chat", "hi", "--model", str(path))
    assert result.returncode != 0
    assert str(path) in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_complete_without_prompt_exits_nonzero():
    result = run_cli("complete", "--max-tokens", "2")
    assert result.returncode != 0
    assert "prompt" in result.stderr


def test_generate_with_progress_bar(capsys):
    tok = engine.load_tokenizer(default_model_path())
    script = tok.encode("Progress bars go to stderr.", add_special_tokens=False)
    params = SamplingParams(max_tokens=len(script), temperature=0)
    with engine.Engine(ScriptedModel(script, tok.vocab_size), tok, max_model_len=512) as eng:
        completions = eng.generate(["a", "b", [1, 2, 3]], params, progress=True)
        quiet = eng.generate(["a", "b", [1, 2, 3]], params)
    captured = capsys.readouterr()
    assert [c.text for c in completions] == [tok.decode(script)] * 3
    assert [c.token_ids for c in completions] == [c.token_ids for c in quiet] == [script] * 3
    assert [c.finish_reason for c in completions] == ["length"] * 3
    assert "3/3" in captured.err and "generate" in captured.err
    assert captured.out == ""
