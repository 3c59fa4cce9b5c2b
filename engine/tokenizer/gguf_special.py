"""llama.cpp's token types and special-token heuristics for GGUF vocabularies (src/llama-vocab.cpp, `load`).

Besides the ids in the header, llama.cpp recognises end-of-turn, fill-in-the-middle and
end-of-generation tokens by their text, and forces such tokens to be control tokens even when the
file says "normal": Qwen2's vocabulary has "</s>" as an ordinary BPE token, yet llama.cpp parses
"</s>" in a prompt as one special token and stops generation on it. We apply the same rules, so
the token types we build the tokenizer from, and the stop ids, are llama.cpp's.
"""
from __future__ import annotations

from enum import IntEnum

from .tokenizer import EOG_TEXTS, FIM_TEXTS

__all__ = ["ADDED_TYPES", "TokenType", "header_id", "llamacpp_special_tokens"]


class TokenType(IntEnum):
    """llama.cpp's `llama_token_type` as stored in `tokenizer.ggml.token_type`."""
    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Token types parsed in text before the model's own split (`tokenizers` added tokens; the same set
# as llama.cpp's cache_special_tokens): gguf.add_typed_tokens, gguf_spm's encoder.
ADDED_TYPES = (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)

# header key -> texts llama.cpp looks for when the key is absent; the first token found becomes
# control. (llama.cpp walks a hash map, so with several candidates its pick is arbitrary; we take
# the first in this order.)
_DETECTED = {
    "tokenizer.ggml.eot_token_id": ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                                    "<|end_of_text|>", "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>",
                                    "<end_of_utterance>"),
    "tokenizer.ggml.eom_token_id": ("<|eom_id|>",),
    **{f"tokenizer.ggml.fim_{role}_token_id": texts for role, texts in FIM_TEXTS.items()},
}
_DEPRECATED_KEYS = {"tokenizer.ggml.fim_pre_token_id": "tokenizer.ggml.prefix_token_id",
                    "tokenizer.ggml.fim_suf_token_id": "tokenizer.ggml.suffix_token_id",
                    "tokenizer.ggml.fim_mid_token_id": "tokenizer.ggml.middle_token_id"}
# FIM pad/repo/separator tokens also end generation.
_EOG_KEYS = ("tokenizer.ggml.fim_pad_token_id", "tokenizer.ggml.fim_rep_token_id", "tokenizer.ggml.fim_sep_token_id")
# gpt-oss: always rendered, never special.
_USER_DEFINED_TEXTS = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def fim_key(role: str) -> str:
    """The GGUF header key of a fill-in-the-middle role ("pre" -> tokenizer.ggml.fim_pre_token_id)."""
    return f"tokenizer.ggml.fim_{role}_token_id"


def text_ids(tokens: list[str]) -> dict[str, int]:
    """{text: id} of a vocabulary, a duplicate text keeping its last id (as llama.cpp's map). The
    GGUF loader builds it once and hands it to each step (~80 ms a time on a 262k vocabulary)."""
    return {text: token_id for token_id, text in enumerate(tokens)}


def fim_token_ids(metadata: dict, tokens: list[str], ids: dict[str, int] | None = None) -> dict[str, int]:
    """Role -> id of the FIM tokens as llama.cpp finds them: the header's id, else the first text.
    ``ids``: text_ids(tokens), when the caller has it."""
    ids = text_ids(tokens) if ids is None else ids
    found = {}
    for role, texts in FIM_TEXTS.items():
        token_id = header_id(metadata, fim_key(role), len(tokens))
        if token_id is None:
            token_id = next((ids[t] for t in texts if t in ids), None)
        if token_id is not None:
            found[role] = token_id
    return found


def header_id(metadata: dict, key: str, num_tokens: int) -> int | None:
    """The token id the header stores under `key` (or its deprecated name), None when absent or
    not an id of this vocabulary."""
    value = metadata.get(key)
    if value is None and key in _DEPRECATED_KEYS:
        value = metadata.get(_DEPRECATED_KEYS[key])
    if value is None or not 0 <= int(value) < num_tokens:
        return None
    return int(value)


def llamacpp_special_tokens(metadata: dict, tokens: list[str], types: list[int],
                            ids: dict[str, int] | None = None) -> tuple[list[int], list[int]]:
    """(token types as llama.cpp ends up with, end-of-generation ids with the eos id first).

    `types` are TokenType values (plain ints, as the header stores them)."""
    num_tokens = len(tokens)
    types = list(types)
    ids = text_ids(tokens) if ids is None else ids

    def force_control(token_id: int) -> None:
        types[token_id] = TokenType.CONTROL

    found: dict[str, int | None] = {}
    for key, texts in _DETECTED.items():
        token_id = header_id(metadata, key, num_tokens)
        if token_id is None:
            token_id = next((ids[t] for t in texts if t in ids), None)
            if token_id is not None:
                force_control(token_id)
        found[key] = token_id

    eog_ids = [found[key] for key in _EOG_KEYS if found[key] is not None]
    for text in EOG_TEXTS:
        if text in ids:
            force_control(ids[text])
            eog_ids.append(ids[text])
    for text in _USER_DEFINED_TEXTS:
        if text in ids:
            types[ids[text]] = TokenType.USER_DEFINED
    eos_id = header_id(metadata, "tokenizer.ggml.eos_token_id", num_tokens)
    for token_id in (eos_id, found["tokenizer.ggml.eot_token_id"], found["tokenizer.ggml.eom_token_id"]):
        if token_id is not None:
            eog_ids.append(token_id)

    texts = {tokens[i] for i in eog_ids}
    # o200k_harmony / solar-open: "<|end|>" ends a message, not the generation.
    if "<|end|>" in texts and ({"<|return|>", "<|call|>"} <= texts or {"<|calls|>", "<|flush|>"} <= texts):
        eog_ids = [i for i in eog_ids if tokens[i] != "<|end|>"]
        types[ids["<|end|>"]] = TokenType.USER_DEFINED
    # Gemma 4 and PLaMo have an ordinary "</s>" token.
    if "</s>" in texts and texts & {"<|tool_response>", "<|plamo:eos|>"}:
        eog_ids = [i for i in eog_ids if tokens[i] != "</s>"]
        types[ids["</s>"]] = TokenType.NORMAL

    eog_ids = list(dict.fromkeys(eog_ids))
    if eos_id in eog_ids:
        eog_ids.remove(eos_id)
        eog_ids.insert(0, eos_id)
    return types, eog_ids
