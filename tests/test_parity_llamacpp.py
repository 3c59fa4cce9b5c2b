"""Parity with llama.cpp on two real models: SmolLM2-135M-Instruct Q4_1 (the embedded default)
and Qwen2.5-Coder-0.5B-Instruct Q4_K_M (from `make testdata`).

tests/data/<model>_llamacpp_greedy.json holds llama.cpp's greedy continuations of six prompts
with its top-5 logprobs at each generated position (tests/data/qwen_llamacpp_gen.py made the
Qwen file with llama-cpp-python 0.3.36 built from its sdist). We teacher-force prompt + greedy
ids in one forward and require, at every generated position: our argmax in llama.cpp's top-3,
llama.cpp's token in our top-3, and its logprob within 0.35 of llama.cpp's (llama.cpp quantizes
activations, so exact equality is not expected).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.batch import single_sequence_batch
from engine.loader import default_model_path
from engine.loader.gguf_loader import load_gguf_state_dict
from engine.models import LlamaModel
from engine.tokenizer import load_tokenizer

DATA = Path(__file__).parent / "data"
TESTDATA = Path(__file__).resolve().parent.parent / ".cache" / "testdata"
QWEN_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
REFERENCES = {
    "smollm2": json.loads((DATA / "smollm2_llamacpp_greedy.json").read_text(encoding="utf-8")),
    "qwen": json.loads((DATA / "qwen_llamacpp_greedy.json").read_text(encoding="utf-8")),
}
MAX_LOGPROB_DIFF = 0.35
BLOCK_SIZE = 16

pytestmark = pytest.mark.slow


def model_path(name: str) -> str:
    """The GGUF file of a reference model; fails (not skips) when `make testdata` was not run."""
    if name == "smollm2":
        return default_model_path()
    path = TESTDATA / QWEN_FILE
    if not path.is_file():
        pytest.fail(f"{path} is missing: run `make testdata` (tests/fetch_testdata.py .cache/testdata) first")
    return str(path)


@pytest.fixture(scope="module", params=sorted(REFERENCES))
def gguf_weights(request):
    return request.param, load_gguf_state_dict(model_path(request.param))


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request, gguf_weights):
    name, (config, state_dict, freq_factors) = gguf_weights
    return name, LlamaModel(config, state_dict, dtype=request.param, rope_freq_factors=freq_factors)


def teacher_forced_logprobs(model, entry) -> torch.Tensor:
    """-> log_softmax [num_generated, V] float32 at the generated positions."""
    ids = entry["prompt_ids"] + entry["greedy_ids"]
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    cache = model.make_kv_cache(num_blocks, BLOCK_SIZE)
    logits = model.forward(single_sequence_batch(ids, 0, list(range(num_blocks)), BLOCK_SIZE, "all"), cache)
    num_prompt = len(entry["prompt_ids"])
    rows = logits[num_prompt - 1: len(ids) - 1]  # row t predicts token t + 1
    return torch.log_softmax(rows.float(), dim=-1)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_reference_data_is_complete(name):
    reference = REFERENCES[name]
    assert len(reference) == 6
    for entry in reference:
        assert len(entry["top5"]) == len(entry["greedy_ids"]) > 0
        # llama.cpp's greedy token is its argmax up to near-ties in its reported logprobs.
        assert all(token in [t for t, _ in top] for top, token in zip(entry["top5"], entry["greedy_ids"]))


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_reference_prompts_tokenize_alike(name):
    """Our tokenizer reads the prompts as llama.cpp did (special tokens parsed, nothing added)."""
    tokenizer = load_tokenizer(model_path(name))
    for entry in REFERENCES[name]:
        assert tokenizer.encode(entry["prompt"], add_special_tokens=False) == entry["prompt_ids"], entry["prompt"]


@pytest.mark.parametrize("index", range(6))
def test_teacher_forced_matches_llamacpp(model, index):
    name, model = model
    entry = REFERENCES[name][index]
    logprobs = teacher_forced_logprobs(model, entry)
    failures = []
    for i, (token, top5) in enumerate(zip(entry["greedy_ids"], entry["top5"])):
        ref_top3 = [t for t, _ in top5[:3]]
        ref_logprob = dict((t, lp) for t, lp in top5)[token]
        ours = logprobs[i]
        our_top3 = ours.topk(3).indices.tolist()
        diff = abs(ours[token].item() - ref_logprob)
        if our_top3[0] not in ref_top3 or token not in our_top3 or diff > MAX_LOGPROB_DIFF:
            failures.append(f"position {i}: llama.cpp token {token} (logprob {ref_logprob:.3f}, ours "
                            f"{ours[token].item():.3f}), llama.cpp top3 {ref_top3}, ours {our_top3}")
    assert not failures, f"{name} {model.dtype} prompt {entry['prompt']!r}:\n" + "\n".join(failures)
