"""Hugging Face sources: tokenizer.json with tokenizer_config.json (and generation_config.json /
config.json for ids) beside it, or a bare `tokenizers.Tokenizer`.

BOS, EOS ids, add_bos and the chat template come from tokenizer_config.json as transformers
reads them; added tokens declared only there are added to the backend, as transformers does.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from .tokenizer import EOG_TEXTS, MISSING_BYTE, Tokenizer

__all__ = ["from_backend", "from_directory", "from_json_file"]


def from_json_file(path: Path) -> Tokenizer:
    """A tokenizer.json file (its tokenizer_config.json beside it is read too) or another .json."""
    directory = path.parent
    config = _read_json(directory / "tokenizer_config.json") if path.name == "tokenizer.json" else {}
    return from_backend(_read_backend(path), config=config or {}, directory=directory)


def from_directory(directory: Path) -> Tokenizer:
    """A model directory with a tokenizer.json."""
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise ValueError(f"{directory}: no tokenizer.json in this model directory")
    config = _read_json(directory / "tokenizer_config.json") or {}
    return from_backend(_read_backend(tokenizer_json), config=config, directory=directory)


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON ({e})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _read_backend(path: Path) -> HFTokenizer:
    """The backend of a tokenizer.json, without the padding and truncation it may declare
    (all-MiniLM-L6-v2's pads and truncates every encoding to 128 ids): transformers applies
    neither unless a call asks, and the engine truncates where a request says so."""
    try:
        backend = HFTokenizer.from_file(os.fspath(path))
    except Exception as e:  # tokenizers raises plain Exception for malformed files
        raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from None
    backend.no_padding()
    backend.no_truncation()
    return backend


def _token_content(value) -> str | None:
    """tokenizer_config's "bos_token": a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _config_ids(config: dict | None, key: str) -> list[int]:
    value = (config or {}).get(key)
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template_from(config: dict, directory: Path | None) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if not template and directory is not None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return template if isinstance(template, str) and template else None


def _add_config_tokens(backend: HFTokenizer, config: dict) -> None:
    """Added tokens tokenizer_config.json declares that tokenizer.json lacks (transformers adds them too)."""
    known = {added.content for added in backend.get_added_tokens_decoder().values()}
    decoder = config.get("added_tokens_decoder")
    entries = sorted(decoder.items(), key=lambda item: int(item[0])) if isinstance(decoder, dict) else []
    missing = []
    for _, entry in entries:
        content = _token_content(entry)
        if content and content not in known:
            missing.append(AddedToken(
                content, special=bool(entry.get("special", True)), normalized=bool(entry.get("normalized", False)),
                lstrip=bool(entry.get("lstrip", False)), rstrip=bool(entry.get("rstrip", False)),
                single_word=bool(entry.get("single_word", False)),
            ))
            known.add(content)
    for value in config.get("additional_special_tokens") or ():
        content = _token_content(value)
        if content and content not in known:
            missing.append(AddedToken(content, special=True, normalized=False))
            known.add(content)
    if missing:
        backend.add_tokens(missing)


def from_backend(backend: HFTokenizer, config: dict | None = None, directory: Path | None = None) -> Tokenizer:
    """A Tokenizer over `backend`, with what `config` (tokenizer_config.json) and the JSON files in
    `directory` say about BOS, EOS, added tokens and the chat template."""
    config = config or {}
    if config:
        _add_config_tokens(backend, config)
    vocab_size = backend.get_vocab_size(with_added_tokens=True)
    bos_text = _token_content(config.get("bos_token"))
    bos_id = backend.token_to_id(bos_text) if bos_text else None
    if bos_text and bos_id is None:
        raise ValueError(f"tokenizer_config.json: bos_token {bos_text!r} is not in the vocabulary")

    eos_ids: list[int] = []
    eos_text = _token_content(config.get("eos_token"))
    if eos_text:
        eos_id = backend.token_to_id(eos_text)
        if eos_id is None:
            raise ValueError(f"tokenizer_config.json: eos_token {eos_text!r} is not in the vocabulary")
        eos_ids.append(eos_id)
    if directory is not None:
        for name in ("generation_config.json", "config.json"):
            eos_ids += _config_ids(_read_json(directory / name), "eos_token_id")
        if bos_id is None:
            for name in ("generation_config.json", "config.json"):
                ids = _config_ids(_read_json(directory / name), "bos_token_id")
                if ids:
                    bos_id = ids[0]
                    break
    # Chat-turn ends that llama.cpp also stops on, when they are special tokens here.
    for token_id, added in backend.get_added_tokens_decoder().items():
        if added.special and added.content in EOG_TEXTS:
            eos_ids.append(token_id)
    eos_ids = [i for i in dict.fromkeys(eos_ids) if 0 <= i < vocab_size]

    # A backend converted from GGUF by gguf_bpe.py and saved keeps its missing-byte id.
    keeps_missing_byte = getattr(backend.model, "unk_token", None) == MISSING_BYTE
    dropped_id = backend.token_to_id(MISSING_BYTE) if keeps_missing_byte else None

    prepended_id = _post_processor_prefix(backend)
    if bos_id is None:
        bos_id = prepended_id
    add_bos = config.get("add_bos_token")
    if not isinstance(add_bos, bool):
        add_bos = prepended_id is not None and prepended_id == bos_id
    if bos_id is None or not 0 <= bos_id < vocab_size:
        bos_id, add_bos = None, False
    return Tokenizer(
        backend, bos_token_id=bos_id, eos_token_ids=eos_ids, add_bos=add_bos,
        chat_template=_chat_template_from(config, directory), vocab_size=vocab_size, dropped_token_id=dropped_id,
    )


def _post_processor_prefix(backend: HFTokenizer) -> int | None:
    """The special token a tokenizer.json post-processor puts in front (Llama 3's BOS), if any."""
    if backend.post_processor is None:
        return None
    try:
        with_special = backend.encode("a", add_special_tokens=True).ids
        without = backend.encode("a", add_special_tokens=False).ids
    except Exception:  # a post-processor that cannot run on a single sequence
        return None
    if len(with_special) > len(without) and with_special[1:len(without) + 1] == without:
        return with_special[0]
    return None
