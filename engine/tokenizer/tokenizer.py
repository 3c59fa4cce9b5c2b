"""The Tokenizer: one object over a `tokenizers.Tokenizer`, whatever the source.

    ids = tok.encode(text)                      # special-token texts ("<|im_start|>") parsed, GIL released
    text = tok.decode(ids)                      # skip_special_tokens=True drops special_token_ids
    prompt = tok.apply_chat_template(messages)  # sandboxed jinja2 (chat_template.py)
    ids = tok.encode_chat(messages)             # the chat prompt path: template, then encode

`encode` prepends BOS itself when `add_bos` (the backend's post-processor is not used), so one
rule holds for GGUF and Hugging Face sources alike. It goes through `encode_batch_fast`, which
releases the GIL for the whole call (`encode` holds it), so a request thread tokenizing a long
prompt does not stall the engine thread.

A backend is a `tokenizers.Tokenizer` or an object with the same methods the Tokenizer and the
detokenizer call (a GGUF SentencePiece vocabulary's gguf_spm.SpmBackend, which encodes in C).
"""
from __future__ import annotations

from tokenizers import Tokenizer as HFTokenizer

from .chat_template import check_template_kwargs, render_chat_template

__all__ = ["EOG_TEXTS", "FIM_TEXTS", "MISSING_BYTE", "Tokenizer"]

# Texts of tokens that end generation whatever the header or config says (llama.cpp's
# `special_eog_ids` loop); GGUF and Hugging Face sources both stop on them.
EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)
# Fill-in-the-middle tokens by role, and the texts llama.cpp recognises them by when the GGUF header
# names none (src/llama-vocab.cpp); a Hugging Face vocabulary is searched for the same texts.
# Roles: prefix, suffix, middle (the prompt's order), pad, repo and file separator (repo-level
# context; all three also end generation).
FIM_TEXTS = {
    "pre": ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>",
            "<|code_prefix|>", "<|prefix|>"),
    "suf": ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>",
            "<|code_suffix|>", "<|suffix|>"),
    "mid": ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>",
            "<|code_middle|>", "<|middle|>"),
    "pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    "rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "sep": ("<|file_sep|>",),
}
# The token a byte-level BPE backend built from GGUF uses for bytes its vocabulary lacks
# (gguf_bpe.py); the Tokenizer drops its id from encode's output, as llama.cpp drops the bytes.
MISSING_BYTE = "<engine:missing-byte>"


# What a backend that is not a tokenizers.Tokenizer must have (gguf_spm.SpmBackend).
BACKEND_METHODS = ("encode_batch_fast", "decode", "id_to_token", "token_to_id", "get_vocab_size",
                   "get_added_tokens_decoder", "decoder")


class Tokenizer:
    """Encode/decode and chat templates over `backend`, a `tokenizers.Tokenizer` (or a stand-in with
    BACKEND_METHODS)."""

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
        fim_token_ids: dict[str, int] | None = None,
        token_texts: list[str] | None = None,
    ):
        if not isinstance(backend, HFTokenizer) and not all(hasattr(backend, m) for m in BACKEND_METHODS):
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
        # around some special tokens, see gguf.AsciiStrip).
        self.prepare_text = prepare_text
        # A backend id that stands for bytes the vocabulary cannot represent (past vocab_size);
        # encode removes it, as llama.cpp drops such bytes.
        self.dropped_token_id = dropped_token_id
        self._token_texts = token_texts
        # Exactly what decode(skip_special_tokens=True) drops: the added tokens marked special.
        self.special_token_ids = frozenset(
            token_id for token_id, added in backend.get_added_tokens_decoder().items() if added.special
        )
        # Role ("pre", "suf", "mid", "pad", "rep", "sep": FIM_TEXTS) -> token id; None: found by text.
        self.fim_token_ids = self._find_fim_tokens() if fim_token_ids is None else dict(fim_token_ids)

    @property
    def token_texts(self) -> list[str] | None:
        """The list the vocabulary was built from (id -> text), when the loader has one, or one the
        backend builds on request (gguf_spm.SpmBackend keeps none): the per-id tables (TokenPieces)
        read it instead of one backend call per id, after a spot check."""
        if self._token_texts is not None:
            return self._token_texts
        return getattr(self.backend, "token_texts", None)

    def _find_fim_tokens(self) -> dict[str, int]:
        found = {}
        for role, texts in FIM_TEXTS.items():
            token_id = next((i for i in map(self.token_to_id, texts) if i is not None), None)
            if token_id is not None and token_id < self.vocab_size:
                found[role] = token_id
        return found

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

    def is_special_text(self, texts) -> bool:
        """True when one of ``texts`` is a single special token (dropped by skip_special_tokens)."""
        special = self.special_token_ids
        return any(self.token_to_id(text) in special for text in texts)

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        """Render OpenAI-style messages with the model's chat template (sandboxed jinja2).

        Raises ChatTemplateError (an engine.errors.InvalidParameterError whose ``param`` names the
        field) for invalid messages, a missing template, or a template that fails or raises."""
        return render_chat_template(
            self.chat_template, messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
        )

    def encode_chat(self, messages, add_generation_prompt: bool = True, tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None) -> list[int]:
        """The prompt ids of a chat: the template rendered, then encoded without adding BOS (a
        template writes its own). The one chat prompt path of the engine and the HTTP server.
        ``chat_template_kwargs``: more variables of the template (``{"enable_thinking": False}``),
        each one the template reads (else ChatTemplateError naming ``chat_template_kwargs.<key>``)."""
        extra = check_template_kwargs(self.chat_template, chat_template_kwargs)
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **extra)
        return self.encode(text, add_special_tokens=False)

