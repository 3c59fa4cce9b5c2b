"""The real Gemma 3 270M (Q4_K_M GGUF from PyPI chunk wheels, `make testdata`): it loads as
Gemma 3 (18 layers, a full layer in 6, windows of 512, 262k SentencePiece vocabulary) and
the engine's greedy continuation is the exact float32 model's argmax, teacher-forced."""
from __future__ import annotations

import torch
from model_fixtures import gemma3_gguf  # noqa: F401

import engine
from engine.batch import single_sequence_batch
from engine.loader import load_model

PROMPT = "The capital of France is"
NUM_TOKENS = 16


def test_gemma3_270m_generates_its_exact_argmax(gemma3_gguf):  # noqa: F811
    with engine.Engine.from_pretrained(gemma3_gguf) as eng:
        [done] = eng.generate([PROMPT], engine.SamplingParams(max_tokens=NUM_TOKENS, temperature=0))
        prompt_ids = eng.tokenizer.encode(PROMPT)
    assert done.text.strip() and len(done.token_ids) == NUM_TOKENS
    exact = load_model(gemma3_gguf, quantization="float32")
    c = exact.config
    assert (c.architecture, c.num_layers, c.sliding_window, c.vocab_size) == ("gemma3", 18, 512, 262144)
    assert c.layer_types.count("full") == 3 and c.qk_norm == "head" and c.post_norms
    ids = prompt_ids + done.token_ids
    num_blocks = -(-len(ids) // 16)
    logits = exact.forward(single_sequence_batch(ids, 0, list(range(num_blocks)), 16, "all"),
                           exact.make_kv_cache(num_blocks, 16))  # [T, V]
    argmax = logits[len(prompt_ids) - 1: -1].argmax(dim=-1)  # the exact model's pick at each generated step
    top2 = logits[len(prompt_ids) - 1: -1].topk(2, dim=-1).values
    near_tie = (top2[:, 0] - top2[:, 1]) < 0.1  # quantized kernels may swap these
    agree = argmax == torch.tensor(done.token_ids)
    assert bool((agree | near_tie).all()), (done.text, agree.tolist())
