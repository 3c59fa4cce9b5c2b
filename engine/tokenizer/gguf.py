"""The vocabulary embedded in a GGUF file, turned into a `tokenizers.Tokenizer`.

Only the key/value header is read (never the tensors), with engine/gguf_file.py's reader.

Vocabulary types, as llama.cpp names them in `tokenizer.ggml.model`:
  "gpt2"   byte-level BPE: tokens + merges, pre-tokenizer regexes chosen by `tokenizer.ggml.pre`
           (gguf_bpe.py);
  "llama"  SentencePiece BPE: tokens + scores, U+2581 for spaces, `<0xNN>` byte fallback
           (gguf_spm.py);
  "gemma4" SentencePiece-style BPE: tokens + merges on raw UTF-8, U+2581 for spaces
           (gguf_bpe.py);
  "bert"   WordPiece in llama.cpp's phantom-space form, BERT's normalizer and [CLS]/[SEP]
           post-processor (gguf_wpm.py).
Token types (`tokenizer.ggml.token_type`, adjusted by llama.cpp's text heuristics in
gguf_special.py) follow llama.cpp: control and unknown tokens become special added tokens
(parsed in text, dropped by decode(skip_special_tokens=True)), user-defined tokens become
non-special added tokens (parsed in text, always rendered).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from ..errors import ModelFileError
from ..gguf_file import read_gguf_metadata
from .gguf_special import ADDED_TYPES, TokenType, fim_token_ids, header_id, llamacpp_special_tokens, text_ids
from .tokenizer import Tokenizer

__all__ = ["GGUFVocab", "TokenType", "load_gguf_tokenizer", "load_gguf_vocab", "vocab_from_metadata"]


@dataclass
class GGUFVocab:
    """A GGUF vocabulary converted: the backend plus what the Tokenizer wrapper needs."""
    backend: HFTokenizer  # or, for "llama" vocabularies, a gguf_spm.SpmBackend
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: list[int]
    add_bos: bool
    chat_template: str | None
    strip: AsciiStrip | None = None  # text preparation for LSTRIP/RSTRIP tokens, when the model has any
    missing_byte_id: int | None = None  # backend id for bytes the vocabulary lacks; encode drops it
    fim_token_ids: dict[str, int] | None = None  # fill-in-the-middle role -> id (gguf_special.fim_token_ids)
    token_texts: list[str] | None = None  # id -> text of the vocabulary (Tokenizer.token_texts)


def token_types(metadata: dict, num_tokens: int) -> list[int]:
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        return [TokenType.NORMAL] * num_tokens
    if len(types) < num_tokens:
        raise ValueError(f"tokenizer.ggml.token_type has {len(types)} entries for {num_tokens} tokens")
    return list(types[:num_tokens])


def unique_token_texts(tokens: list[str]) -> list[str]:
    """llama.cpp renames empty tokens "[EMPTY_<id>]"; duplicates keep the last id as theirs does."""
    return [text if text else f"[EMPTY_{i}]" for i, text in enumerate(tokens)]


def strip_attributes(metadata: dict, tokens: list[str], types: list[int],
                     ids: dict[str, int] | None = None) -> tuple[set[int], set[int]]:
    """(lstrip ids, rstrip ids): llama.cpp sets these per model name, not from the file
    (llama-vocab.cpp, "set attributes by model/tokenizer/architecture name")."""
    name = str(metadata.get("general.name") or "").lower()
    pre = str(metadata.get("tokenizer.ggml.pre") or "")
    arch = str(metadata.get("general.architecture") or "")
    ids = text_ids(tokens) if ids is None else ids
    lstrip_ids: set[int] = set()
    rstrip_ids: set[int] = set()
    if any(p in pre for p in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or \
            any(a in arch for a in ("nomic-bert-moe", "jina-bert-v3")):
        lstrip_ids.update(ids[t] for t in ("<mask>",) if t in ids)
    elif "phi-3" in name or "phi3" in name:
        special_types = (TokenType.CONTROL, TokenType.USER_DEFINED, TokenType.UNKNOWN)
        rstrip_ids.update(i for i, t in enumerate(types) if t in special_types)
        rstrip_ids.update(ids[t] for t in ("</s>",) if t in ids)
        rstrip_ids.difference_update(ids[t] for t in ("<unk>", "<s>", "<|endoftext|>") if t in ids)
    elif "modern-bert" in name:
        lstrip_ids.update(ids[t] for t in ("[MASK]",) if t in ids)
    return lstrip_ids, rstrip_ids


class AsciiStrip:
    """llama.cpp's LSTRIP/RSTRIP token attributes: the ASCII whitespace (C `isspace`) right before an
    LSTRIP token's text or right after an RSTRIP token's text is dropped before tokenizing.

    Done on the text rather than with `tokenizers`' AddedToken lstrip/rstrip, which strip any
    Unicode whitespace (U+00A0, U+3000, ...) and so would differ from llama.cpp."""

    _SPACE = "[ \t\n\v\f\r]+"

    def __init__(self, lstrip_texts: list[str], rstrip_texts: list[str]):
        def alternation(texts):
            return "|".join(re.escape(t) for t in sorted(set(texts), key=len, reverse=True))

        self.texts = tuple(set(lstrip_texts) | set(rstrip_texts))
        self.after = re.compile(f"({alternation(rstrip_texts)}){self._SPACE}") if rstrip_texts else None
        self.before = re.compile(f"{self._SPACE}(?=(?:{alternation(lstrip_texts)}))") if lstrip_texts else None

    def __call__(self, text: str) -> str:
        if not any(t in text for t in self.texts):
            return text
        if self.after is not None:
            text = self.after.sub(r"\1", text)
        if self.before is not None:
            text = self.before.sub("", text)
        return text


def add_typed_tokens(backend: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    """Register control/unknown tokens as special added tokens, user-defined ones as plain added tokens."""
    kinds = np.asarray(types, dtype=np.int64)  # one pass in numpy: a Python loop took ~0.2 s over 262k ids
    added = [AddedToken(tokens[i], special=int(kinds[i]) != TokenType.USER_DEFINED, normalized=False)
             for i in np.flatnonzero(np.isin(kinds, ADDED_TYPES)).tolist()]
    if added:
        backend.add_tokens(added)


def bos_settings(metadata: dict, num_tokens: int, default_add_bos: bool) -> tuple[int | None, bool]:
    """(bos_token_id, add_bos) from the header."""
    bos_id = header_id(metadata, "tokenizer.ggml.bos_token_id", num_tokens)
    add_bos = metadata.get("tokenizer.ggml.add_bos_token")
    add_bos = default_add_bos if add_bos is None else bool(add_bos)
    return bos_id, add_bos and bos_id is not None


def load_gguf_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A Tokenizer over a GGUF file's embedded vocabulary, with llama.cpp's ids."""
    vocab = load_gguf_vocab(path)
    return Tokenizer(
        vocab.backend, bos_token_id=vocab.bos_token_id, eos_token_ids=vocab.eos_token_ids,
        add_bos=vocab.add_bos, chat_template=vocab.chat_template, vocab_size=vocab.vocab_size,
        prepare_text=vocab.strip, dropped_token_id=vocab.missing_byte_id, fim_token_ids=vocab.fim_token_ids,
        token_texts=vocab.token_texts,
    )


def load_gguf_vocab(path: str | os.PathLike) -> GGUFVocab:
    """Read a GGUF file's vocabulary into a GGUFVocab. Errors (ModelFileError) name the file and
    the key or entry: the tokenizers library's own refusals are wrapped, naming the entry at fault."""
    path = os.fspath(path)
    metadata = read_gguf_metadata(path)
    try:
        return vocab_from_metadata(metadata)
    except ModelFileError:
        raise
    except Exception as e:  # the tokenizers library raises plain Exception ("Error while initializing BPE")
        detail = str(e) if isinstance(e, (ValueError, TypeError)) else _library_refusal(metadata, e)
        raise ModelFileError(f"{path}: {' '.join(detail.split())}", path) from None


def _library_refusal(metadata: dict, exc: Exception) -> str:
    """The tokenizers library's error, with the merges entry it refused when there is one (found
    only on this failure path: a merge whose parts or result are not tokens)."""
    message = f"the tokenizers library refuses the vocabulary ({exc})"
    tokens, merges = metadata.get("tokenizer.ggml.tokens"), metadata.get("tokenizer.ggml.merges")
    if isinstance(tokens, list) and isinstance(merges, list):
        vocab = set(unique_token_texts(tokens))
        for i, merge in enumerate(merges):
            left, _, right = str(merge).partition(" ")
            for part in (left, right, left + right):
                if part not in vocab:
                    return (f"tokenizer.ggml.merges[{i}] = {merge!r}: {part!r} is not in tokenizer.ggml.tokens; "
                            f"{message}")
    return message


def check_special_ids(metadata: dict, num_tokens: int) -> None:
    """Every tokenizer.ggml.*_token_id the header stores is an id of this vocabulary."""
    for key, value in metadata.items():
        if key.startswith("tokenizer.ggml.") and key.endswith("_token_id"):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < num_tokens:
                raise ValueError(f"{key} = {value!r} is not a token id of this vocabulary "
                                 f"({num_tokens} tokens)")


def vocab_from_metadata(metadata: dict) -> GGUFVocab:
    model_type = metadata.get("tokenizer.ggml.model")
    if model_type is None:
        raise ValueError("no embedded vocabulary (tokenizer.ggml.model is missing)")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ValueError("tokenizer.ggml.tokens is missing or empty")
    tokens = unique_token_texts(tokens)
    check_special_ids(metadata, len(tokens))
    ids = text_ids(tokens)
    types, eos_ids = llamacpp_special_tokens(metadata, tokens, token_types(metadata, len(tokens)), ids)
    missing_byte_id = None
    added_texts = tokens  # the texts add_typed_tokens registers
    if model_type == "bert":
        from .gguf_wpm import build_wpm_backend, wordpiece_tokens
        file_types = token_types(metadata, len(tokens))
        backend = build_wpm_backend(metadata, tokens, file_types)
        added_texts = wordpiece_tokens(tokens, file_types)
        add_bos_default = False
    elif model_type == "gpt2":
        from .gguf_bpe import build_bpe_backend, default_add_bos
        backend, missing_byte_id = build_bpe_backend(metadata, tokens)
        add_bos_default = default_add_bos(metadata.get("tokenizer.ggml.pre"))
    elif model_type == "gemma4":
        from .gguf_bpe import build_gemma4_backend
        backend = build_gemma4_backend(metadata, tokens)
        add_bos_default = True
    elif model_type == "llama":
        from .gguf_spm import build_spm_backend
        backend = build_spm_backend(metadata, tokens, types, ids)  # its added tokens included
        added_texts = None
        add_bos_default = True
    else:
        raise ValueError(
            f"tokenizer.ggml.model {model_type!r} is not supported (supported: 'gpt2' byte-level BPE, "
            "'llama' SentencePiece BPE, 'gemma4' SentencePiece-style BPE, 'bert' WordPiece)"
        )
    if added_texts is not None:
        add_typed_tokens(backend, added_texts, types)
    lstrip_ids, rstrip_ids = strip_attributes(metadata, tokens, types, ids)
    bos_id, add_bos = bos_settings(metadata, len(tokens), add_bos_default)
    if model_type == "gemma4" and bos_id is not None:
        add_bos = True  # llama.cpp overrides the file's flag for Gemma 4
    template = metadata.get("tokenizer.chat_template")
    return GGUFVocab(
        backend=backend,
        vocab_size=len(tokens),
        bos_token_id=bos_id,
        eos_token_ids=eos_ids,
        add_bos=add_bos,
        chat_template=template if isinstance(template, str) and template else None,
        strip=AsciiStrip([tokens[i] for i in lstrip_ids], [tokens[i] for i in rstrip_ids])
        if lstrip_ids or rstrip_ids else None,
        missing_byte_id=missing_byte_id,
        fim_token_ids=fim_token_ids(metadata, tokens, ids),
        # The BPE vocabularies are {tokens[i]: i} over unique texts; WordPiece renames its tokens; an
        # SpmBackend reads its texts off its own table (a list of 262k str is ~18 MB to keep).
        token_texts=tokens if model_type not in ("bert", "llama") else None,
    )
