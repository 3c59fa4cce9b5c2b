"""all-MiniLM-L6-v2 as the GGUF llama.cpp's own convert_hf_to_gguf.py (from the pinned
llama-cpp-python sdist) writes it (architecture "bert"): its WordPiece vocabulary gives the
tokenizer.json's ids and token types, and the engine's vectors equal the safetensors directory's."""

from __future__ import annotations

import numpy as np
import pytest
from embedding_fixtures import corpus, minilm_path
from family_fixtures import convert_to_gguf, converter  # noqa: F401 (a fixture)
from tokenizers import Tokenizer as HFTokenizer

from engine import Engine, ModelFileError, load_tokenizer

EXTRA_TEXTS = [
    "[CLS] literal special tokens [MASK] inside [SEP] a text",
    "Ünïcödé café naïve résumé",
    "日本語のテキストと中文文本 🙂🙂 emoji",
    "  leading spaces\t\ttabs\nnewlines  ",
    "supercalifragilisticexpialidocious" * 5,  # a word longer than WordPiece's 100 characters: [UNK]
    "x",
]


@pytest.fixture(scope="module")
def minilm_gguf(converter, tmp_path_factory):  # noqa: F811
    directory = tmp_path_factory.mktemp("minilm_gguf")
    return {kind: convert_to_gguf(converter, minilm_path(), directory / f"minilm-{kind}.gguf", kind)
            for kind in ("f32", "f16")}


@pytest.fixture(scope="module")
def texts():
    return corpus(200) + EXTRA_TEXTS


def test_wordpiece_from_gguf_matches_tokenizer_json(minilm_gguf, texts):
    ours = load_tokenizer(minilm_gguf["f32"]).backend
    ref = HFTokenizer.from_file(str(minilm_path() / "tokenizer.json"))
    ref.no_padding()
    ref.no_truncation()
    for text in texts:
        got, want = ours.encode(text), ref.encode(text)
        assert (got.ids, got.type_ids) == (want.ids, want.type_ids), text
        got, want = ours.encode(text, "a second text"), ref.encode(text, "a second text")
        assert (got.ids, got.type_ids) == (want.ids, want.type_ids), text
    assert ours.get_vocab() == ref.get_vocab()
    assert ours.encode(EXTRA_TEXTS[4]).ids == [101, 100, 102]  # [CLS] [UNK] [SEP]


@pytest.fixture(scope="module")
def directory_vectors(texts):
    with Engine.from_pretrained(minilm_path()) as eng:
        return eng.embed(texts, truncate=True)  # cut at sentence_bert_config's 256 tokens


@pytest.mark.parametrize("kind, min_cosine", [("f32", 0.99999), ("f16", 0.9999)])
def test_gguf_vectors_equal_the_directory(minilm_gguf, texts, directory_vectors, kind, min_cosine):
    with Engine.from_pretrained(minilm_gguf[kind]) as eng:
        assert eng.pooling == "mean" and eng.embedding_size == 384  # bert.pooling_type 1
        assert eng.model.max_model_len == 512  # the file's context length (max_seq_length is not stored)
        vectors = eng.embed(texts, truncate=256)
        assert eng.tokenizer.encode("Hello world") == [101, 7592, 2088]  # add_bos_token, as the directory's
    assert vectors.shape == directory_vectors.shape == (len(texts), 384)
    cosines = np.sum(vectors * directory_vectors, axis=1)
    assert cosines.min() >= min_cosine, (int(cosines.argmin()), float(cosines.min()))


def test_bert_gguf_refusals(minilm_gguf, tmp_path):
    data = minilm_gguf["f32"].read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFileError) as err:
        Engine.from_pretrained(truncated)
    assert "truncated.gguf" in str(err.value)
    with Engine.from_pretrained(minilm_gguf["f32"]) as eng:
        with pytest.raises(ValueError) as err:  # an embedding model serves no generation
            eng.generate(["Hello"])
        assert "embedding model" in str(err.value)
