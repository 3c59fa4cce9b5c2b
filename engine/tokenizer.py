"""Tokenizer: one object over a `tokenizers.Tokenizer`, whatever the source.

    tok = load_tokenizer("model.gguf")          # or tokenizer.json, an HF dir, a tokenizers.Tokenizer
    ids = tok.encode(text)                      # special-token texts ("<|im_start|>") parsed, GIL released
    text = tok.decode(ids)                      # skip_special_tokens=True drops special_token_ids
    prompt = tok.apply_chat_template(messages)  # sandboxed jinja2 (engine/chat_template.py)

`encode` prepends BOS itself when `add_bos` (the backend's post-processor is not used), so one
rule holds for GGUF and Hugging Face sources alike. For GGUF files the ids are llama.cpp's
(`llama_tokenize` with parse_special), including its per-model quirks (engine/gguf_*.py). It goes through `encode_batch_fast`, which
releases the GIL for the whole call (`encode` holds it), so a request thread tokenizing a long
prompt does not stall the engine thread.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import AddedToken, Tokenizer as HFTokenizer

from .chat_template import render_chat_template

__all__ = ["Tokenizer", "load_tokenizer"]


class Tokenizer:
    """Encode/decode and chat templates over `backend`, a `tokenizers.Tokenizer`."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: list[int] | tuple[int, ...] = (),
        add_bos: bool = False,
        chat_template: str | None = None,
        vocab_size: int | None = None,
        prepare_text=None,
        dropped_token_id: int | None = None,
    ):
        if not isinstance(backend, HFTokenizer):
            raise ValueError(f"backend must be a tokenizers.Tokenizer, got {type(backend).__name__}")
        self.backend = backend
        self.vocab_size = int(vocab_size) if vocab_size is not None else backend.get_vocab_size(with_added_tokens=True)
        for name, token_id in [("bos_token_id", bos_token_id)] + [("eos_token_ids", i) for i in eos_token_ids]:
            if token_id is not None and not (isinstance(token_id, int) and 0 <= token_id < self.vocab_size):
                raise ValueError(f"{name} {token_id!r} is not a token id of this vocabulary (size {self.vocab_size})")
        if add_bos and bos_token_id is None:
            raise ValueError("add_bos is set but bos_token_id is None")
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        # Optional str -> str applied before encoding (llama.cpp's per-model whitespace stripping
        # around some special tokens, see gguf_vocab.AsciiStrip).
        self.prepare_text = prepare_text
        # A backend id that stands for bytes the vocabulary cannot represent (past vocab_size);
        # encode removes it, as llama.cpp drops such bytes.
        self.dropped_token_id = dropped_token_id
        # Exactly what decode(skip_special_tokens=True) drops: the added tokens marked special.
        self.special_token_ids = frozenset(
            token_id for token_id, added in backend.get_added_tokens_decoder().items() if added.special
        )

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_token_id={self.bos_token_id}, "
                f"eos_token_ids={self.eos_token_ids}, add_bos={self.add_bos})")

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        return self.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else None

    def _finish_ids(self, ids: list[int], add_special_tokens: bool) -> list[int]:
        """Drop the stand-in id of unrepresentable bytes, then prepend BOS if asked."""
        dropped = self.dropped_token_id
        if dropped is not None and dropped in ids:
            ids = [i for i in ids if i != dropped]
        if add_special_tokens and self.add_bos:
            return [self.bos_token_id] + ids
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token texts are parsed. Releases the GIL while it works."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        if self.prepare_text is not None:
            text = self.prepare_text(text)
        (encoding,) = self.backend.encode_batch_fast([text], add_special_tokens=False)
        return self._finish_ids(encoding.ids, add_special_tokens)

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        if not isinstance(texts, (list, tuple)) or not all(isinstance(t, str) for t in texts):
            raise ValueError("texts must be a list of strings")
        if self.prepare_text is not None:
            texts = [self.prepare_text(t) for t in texts]
        encodings = self.backend.encode_batch_fast(list(texts), add_special_tokens=False)
        return [self._finish_ids(e.ids, add_special_tokens) for e in encodings]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary render as nothing (as in `tokenizers`)."""
        try:
            return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError):
            raise ValueError("ids must be a sequence of non-negative integers") from None

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        """Render OpenAI-style messages with the model's chat template (sandboxed jinja2).

        Raises ValueError (ChatTemplateError) for invalid messages, a missing template, or a
        template that fails or raises."""
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
        )

    def encode_chat(self, messages, add_generation_prompt: bool = True, tools=None) -> list[int]:
        """The prompt ids of a chat: the template applied, then encoded without added specials."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools)
        return self.encode(text, add_special_tokens=False)


# ---------------------------------------------------------------- loading


def load_tokenizer(source) -> Tokenizer:
    """A Tokenizer from a tokenizer.json path, an HF model dir, a .gguf file or a tokenizers.Tokenizer."""
    if isinstance(source, Tokenizer):
        return source
    if isinstance(source, HFTokenizer):
        return _from_backend(source, config={}, directory=None)
    if not isinstance(source, (str, os.PathLike)):
        raise ValueError(
            "tokenizer source must be a path (tokenizer.json, a model directory, a .gguf file) "
            f"or a tokenizers.Tokenizer, got {type(source).__name__}"
        )
    path = Path(source)
    if path.is_dir():
        return _from_hf_dir(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    if _is_gguf(path):
        return _from_gguf(path)
    if path.suffix == ".json":
        directory = path.parent
        config = _read_json(directory / "tokenizer_config.json") if path.name == "tokenizer.json" else {}
        return _from_backend(_read_backend(path), config=config or {}, directory=directory)
    raise ValueError(f"{path}: not a tokenizer source (expected tokenizer.json, a model directory or a .gguf file)")


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _from_gguf(path: Path) -> Tokenizer:
    from .gguf_vocab import load_gguf_vocab

    vocab = load_gguf_vocab(path)
    return Tokenizer(
        vocab.backend, bos_token_id=vocab.bos_token_id, eos_token_ids=vocab.eos_token_ids,
        add_bos=vocab.add_bos, chat_template=vocab.chat_template, vocab_size=vocab.vocab_size,
        prepare_text=vocab.strip, dropped_token_id=vocab.missing_byte_id,
    )


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
    try:
        return HFTokenizer.from_file(os.fspath(path))
    except Exception as e:  # tokenizers raises plain Exception for malformed files
        raise ValueError(f"{path}: not a valid tokenizer.json ({e})") from None


def _from_hf_dir(directory: Path) -> Tokenizer:
    tokenizer_json = directory / "tokenizer.json"
    if not tokenizer_json.is_file():
        ggufs = sorted(directory.glob("*.gguf"))
        if len(ggufs) == 1:
            return _from_gguf(ggufs[0])
        raise ValueError(f"{directory}: no tokenizer.json in this model directory")
    config = _read_json(directory / "tokenizer_config.json") or {}
    return _from_backend(_read_backend(tokenizer_json), config=config, directory=directory)


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


def _from_backend(backend: HFTokenizer, config: dict, directory: Path | None) -> Tokenizer:
    from .gguf_special import EOG_TEXTS
    from .gguf_vocab_bpe import MISSING_BYTE

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

    # A backend converted from GGUF by engine.gguf_vocab_bpe and saved keeps its missing-byte id.
    dropped_id = backend.token_to_id(MISSING_BYTE) if getattr(backend.model, "unk_token", None) == MISSING_BYTE else None

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
