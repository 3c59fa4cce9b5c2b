"""GGUF "gpt2" vocabularies: byte-level BPE with llama.cpp's pre-tokenizer regexes.

llama.cpp splits text with a list of regexes applied one after another: each regex cuts every
current fragment into its matches and the text between them (src/llama-vocab.cpp,
`llm_tokenizer_bpe`; src/unicode.cpp, `unicode_regex_split`). `tokenizers`' Split with behavior
"isolated" does exactly that, so each `tokenizer.ggml.pre` value maps to a Sequence of Splits
followed by a regex-free ByteLevel step.
"""
from __future__ import annotations

from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from .tokenizer import MISSING_BYTE

# Shared regexes, spelled as llama.cpp spells them. `$` there is the end of a fragment
# (ECMAScript, no multiline); in oniguruma `$` is the end of a line, so we write `\z`.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Written with escapes: several of these code points have canonical equivalents an editor may
# normalize away (U+1F7D vs U+03CE, U+212A KELVIN SIGN vs "K"). llama.cpp matches these
# category-free regexes with std::wregex after replacing every non-ASCII whitespace character by
# U+000B, so such a character matches `\s` but never an explicit range (U+3000 is inside
# "\u3000-\u3002" and "\u0800-\u4e00"); `&&[^\s]` takes whitespace out of those classes.
_DEEPSEEK_LLM_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-"
    "\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd"
    "\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d"
    "\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-"
    "\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d"
    "\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4"
    "\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e"
    "\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)
_DEEPSEEK_LLM_PUNCT = "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002&&[^\\s]]+"
_CJK_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff&&[^\\s]]+"


# llama.cpp pre-tokenizer types: the regexes applied in order.
_PRE_TYPES: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN35,),
    "starcoder": (r"\p{N}", _GPT2),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "deepseek-llm": (r"[\r\n]", _DEEPSEEK_LLM_LETTERS, _DEEPSEEK_LLM_PUNCT, r"\s+\z",
                      _CJK_HANGUL, r"\p{N}+"),
    "deepseek-coder": (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
    "chatglm4": (_LLAMA3,),
    "poro": (r" ?[^(\s|.,!?…。，、।۔،)]+",),
    "viking": (r" ?[^(\s|.,!?…。，、।۔،)]+", r"\p{N}"),
}

# `tokenizer.ggml.pre` value -> pre-tokenizer type (llama-vocab.cpp, `llama_vocab::impl::load`).
PRE_NAMES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"), "llama3"),
    "deepseek-llm": "deepseek-llm",
    "deepseek-coder": "deepseek-coder",
    "falcon": "falcon",
    **dict.fromkeys(("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
                     "a.x-4.0", "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe",
                     "mpt", "olmo", "jais", "trillion", "granite-docling", "exaone4"), "gpt2"),
    **dict.fromkeys(("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone",
                     "minerva-7b", "mellum2"), "starcoder"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "megrez", "hunyuan"),
                    "qwen2"),
    "qwen35": "qwen35",
    **dict.fromkeys(("chatglm-bpe", "glm4", "glm5"), "chatglm4"),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), "poro"),
    "viking": "viking",
}
# Llama 3 style pre values: a whole pre-token already in the vocabulary skips the merges
# (llama.cpp's `ignore_merges`, also set for glm4/glm5), and BOS is added by default.
_LLAMA3_NAMES = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                           "lfm2", "jina-v5-nano"})
_IGNORE_MERGES = _LLAMA3_NAMES | {"glm4", "glm5"}


def default_add_bos(pre: str | None) -> bool:
    """llama.cpp's add_bos for a "gpt2" vocabulary whose header has no tokenizer.ggml.add_bos_token."""
    return pre in _LLAMA3_NAMES


def supported_pre_names() -> list[str]:
    return sorted(PRE_NAMES)


def pre_tokenizer_for(pre: str | None):
    """(tokenizers pre-tokenizer, ignore_merges) for a `tokenizer.ggml.pre` value."""
    pre = "default" if pre is None or pre == "" else pre
    pre_type = PRE_NAMES.get(pre)
    if pre_type is None:
        raise ValueError(
            f"tokenizer.ggml.pre {pre!r} is not a supported pre-tokenizer "
            f"(supported: {', '.join(supported_pre_names())})"
        )
    regexes = _PRE_TYPES[pre_type]
    steps = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
    return pre_tokenizers.Sequence(steps), pre in _IGNORE_MERGES


def split_merge(merge: str) -> tuple[str, str]:
    """ "a b" -> ("a", "b"), splitting at the first space after position 0, as llama.cpp does."""
    position = merge.find(" ", 1)
    if position < 0:
        raise ValueError(f"tokenizer.ggml.merges entry {merge!r} has no space separating its two parts")
    return merge[:position], merge[position + 1:]


def build_bpe_backend(metadata: dict, tokens: list[str]) -> tuple[HFTokenizer, int | None]:
    """(backend, missing_byte_id). Some vocabularies lack byte symbols (SmolLM2 has 235 of 256).
    llama.cpp keeps such a byte as a symbol that blocks merges across it and then drops it; here it
    becomes an extra id past the vocabulary (the BPE unk token, so it blocks merges the same way),
    which the Tokenizer removes from its output. None when every byte symbol is present."""
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise ValueError("tokenizer.ggml.merges is missing (a 'gpt2' vocabulary needs its merges)")
    pre_tokenizer, ignore_merges = pre_tokenizer_for(metadata.get("tokenizer.ggml.pre"))
    vocab = {text: token_id for token_id, text in enumerate(tokens)}
    missing_byte_id = None
    if any(symbol not in vocab for symbol in pre_tokenizers.ByteLevel.alphabet()):
        missing_byte_id = len(tokens)
        vocab[MISSING_BYTE] = missing_byte_id
    model = models.BPE(vocab=vocab, merges=[split_merge(m) for m in merges], ignore_merges=ignore_merges,
                       unk_token=MISSING_BYTE if missing_byte_id is not None else None,
                       fuse_unk=False, byte_fallback=False)
    backend = HFTokenizer(model)
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    return backend, missing_byte_id


def build_gemma4_backend(metadata: dict, tokens: list[str]) -> HFTokenizer:
    """GGUF "gemma4": SentencePiece-style BPE. Spaces become U+2581, text splits only into runs of
    newlines and runs of everything else, merges run on raw UTF-8 characters, and characters no
    token covers come out as `<0xNN>` byte tokens (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_GEMMA4)."""
    merges = metadata.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise ValueError("tokenizer.ggml.merges is missing (a 'gemma4' vocabulary needs its merges)")
    vocab = {text: token_id for token_id, text in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=[split_merge(m) for m in merges], fuse_unk=False, byte_fallback=True)
    backend = HFTokenizer(model)
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend
