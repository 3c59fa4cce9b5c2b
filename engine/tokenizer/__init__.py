"""Tokenizers: one `Tokenizer` over a `tokenizers.Tokenizer` (or, for a GGUF SentencePiece
vocabulary, our SpmBackend with the same methods), whatever the source.

    tok = load_tokenizer("model.gguf")   # or tokenizer.json, an HF model dir, a tokenizers.Tokenizer
    ids = tok.encode(text)               # special-token texts parsed, GIL released
    ids = tok.encode_chat(messages)      # chat template, then encode: the one chat prompt path

The package, one module per concern:

    tokenizer.py      the Tokenizer class (encode, decode, chat templates)
    chat_template.py  message validation and the sandboxed jinja2 renderer
    hf.py             Hugging Face sources: tokenizer.json + tokenizer_config.json
    gguf.py           a GGUF file's embedded vocabulary, with llama.cpp's ids:
      gguf_bpe.py       "gpt2" byte-level BPE and "gemma4" vocabularies
      gguf_spm.py       "llama" SentencePiece vocabularies (SpmBackend: encoded in C, cext/spm.pyx)
      gguf_wpm.py       "bert" WordPiece vocabularies
      gguf_special.py   llama.cpp's token types and special-token rules
    token_bytes.py    per-token bytes read off the decoder (the detokenizer's table)

The Hugging Face path imports no GGUF module; GGUF modules load only for a .gguf source.
"""
from __future__ import annotations

import os
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from ..errors import ModelFileError
from ..gguf_file import is_gguf_file
from . import hf
from .chat_template import ChatTemplateError, check_chat_template, validate_messages
from .tokenizer import Tokenizer

__all__ = ["ChatTemplateError", "Tokenizer", "load_tokenizer", "validate_messages"]


def load_tokenizer(source) -> Tokenizer:
    """A Tokenizer from a tokenizer.json path, an HF model dir, a .gguf file or a tokenizers.Tokenizer.

    A path whose files are malformed (a vocabulary or merges list the tokenizers library refuses,
    special-token ids outside the vocabulary, a chat template that does not compile) raises
    ModelFileError naming the file and the entry."""
    if isinstance(source, Tokenizer):
        return source
    if isinstance(source, HFTokenizer):
        return hf.from_backend(source)
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(
            "tokenizer source must be a path (tokenizer.json, a model directory, a .gguf file) "
            f"or a tokenizers.Tokenizer, got {type(source).__name__}"
        )
    path = Path(source)
    try:
        tokenizer = _from_path(path)
        if tokenizer.chat_template is not None:
            check_chat_template(tokenizer.chat_template)
    except ModelFileError:
        raise
    except ChatTemplateError as exc:
        where = "tokenizer.chat_template" if path.is_file() and is_gguf_file(path) else \
            "chat_template (tokenizer_config.json or chat_template.jinja)"
        raise ModelFileError(f"{path}: {where}: {exc}", str(path)) from None
    except (ValueError, OSError) as exc:  # a file that is not what it claims; the message names it
        message = " ".join(str(exc).split())
        message = message if message.startswith(str(path)) else f"{path}: {message}"
        raise ModelFileError(message, str(path)) from None
    return tokenizer


def _from_path(path: Path) -> Tokenizer:
    if path.is_dir():
        if (path / "tokenizer.json").is_file():
            return hf.from_directory(path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0])
        raise ValueError(f"{path}: no tokenizer.json in this model directory")
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    if is_gguf_file(path):
        return _from_gguf(path)
    if path.suffix == ".json":
        return hf.from_json_file(path)
    raise ValueError(f"{path}: not a tokenizer source (expected tokenizer.json, a model directory or a .gguf file)")


def _from_gguf(path: Path) -> Tokenizer:
    from .gguf import load_gguf_tokenizer  # the GGUF modules load only for GGUF sources

    return load_gguf_tokenizer(path)
