"""Parity with llama.cpp on the embedded SmolLM2-135M-Instruct Q4_1 GGUF, with the default
weights (quantization="auto": int4 layers and an int8 head with bfloat16 products, float32
activations) and the exact float32 dequantization.

tests/data/smollm2_llamacpp_greedy.json holds llama.cpp's greedy continuations of six
prompts with its top-5 logprobs at each generated position. We teacher-force prompt +
greedy ids in one forward and require, at every generated position: our argmax in
llama.cpp's top-3 (counting tokens within NEAR_TIE of its 3rd as tied), llama.cpp's token in
our top-3, and its logprob within 0.35 of llama.cpp's (llama.cpp quantizes activations, so
exact equality is not expected).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.batch import single_sequence_batch
from engine.loader import default_model_path, load_model

REFERENCE = json.loads((Path(__file__).parent / "data" / "smollm2_llamacpp_greedy.json").read_text())
MAX_LOGPROB_DIFF = 0.35
# llama.cpp's top-3 counts its ties: the int4 default runs its products in bfloat16 (bf16 scales
# from GGUF's fp16 d, bf16 inputs), and at one position of "The quick brown fox" it picks the
# token llama.cpp ranks 4th, 0.020 nats below llama.cpp's 3rd (its 2nd-4th span 0.022 nats).
NEAR_TIE = 0.03
BLOCK_SIZE = 16

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["auto", "float32"])
def model(request):
    """The default (int4 layers, int8 head, float32 activations) and the exact float32 dequantization."""
    return load_model(default_model_path(), quantization=request.param)


def teacher_forced_logprobs(model, entry) -> torch.Tensor:
    """-> log_softmax [num_generated, V] float32 at the generated positions."""
    ids = entry["prompt_ids"] + entry["greedy_ids"]
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    cache = model.make_kv_cache(num_blocks, BLOCK_SIZE)
    logits = model.forward(single_sequence_batch(ids, 0, list(range(num_blocks)), BLOCK_SIZE, "all"), cache)
    num_prompt = len(entry["prompt_ids"])
    rows = logits[num_prompt - 1: len(ids) - 1]  # row t predicts token t + 1
    return torch.log_softmax(rows.float(), dim=-1)


def test_reference_data_is_complete():
    assert len(REFERENCE) == 6
    for entry in REFERENCE:
        assert len(entry["top5"]) == len(entry["greedy_ids"]) > 0
        # llama.cpp's greedy token is its argmax up to near-ties in its reported logprobs.
        assert all(token in [t for t, _ in top] for top, token in zip(entry["top5"], entry["greedy_ids"]))


@pytest.mark.parametrize("index", range(len(REFERENCE)))
def test_teacher_forced_matches_llamacpp(model, index):
    entry = REFERENCE[index]
    logprobs = teacher_forced_logprobs(model, entry)
    failures = []
    for i, (token, top5) in enumerate(zip(entry["greedy_ids"], entry["top5"])):
        ref_top3 = [t for t, _ in top5[:3]]
        ref_logprob = dict((t, lp) for t, lp in top5)[token]
        ours = logprobs[i]
        our_top3 = ours.topk(3).indices.tolist()
        diff = abs(ours[token].item() - ref_logprob)
        # llama.cpp's top-3 up to ties: its top-5 tokens within NEAR_TIE of its 3rd logprob.
        ref_top3_ties = [t for t, lp in top5 if lp >= top5[2][1] - NEAR_TIE]
        if our_top3[0] not in ref_top3_ties or token not in our_top3 or diff > MAX_LOGPROB_DIFF:
            failures.append(f"position {i}: llama.cpp token {token} (logprob {ref_logprob:.3f}, ours "
                            f"{ours[token].item():.3f}), llama.cpp top3 {ref_top3}, ours {our_top3}")
    assert not failures, f"{model.layers[0].qkv_proj.format} {model.dtype} prompt {entry['prompt']!r}:\n" + "\n".join(failures)
