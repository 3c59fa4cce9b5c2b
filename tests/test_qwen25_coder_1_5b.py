"""The real Qwen2.5-Coder-1.5B-Instruct (Q4_K_M GGUF from 22 PyPI chunk wheels, `make testdata`),
end to end through the public API: it loads as Qwen2 (28 layers, 12 query heads over 2 KV heads),
its own chat template renders the reference prompt to llama.cpp's token ids, and the greedy reply
streamed by the engine is llama.cpp's greedy reply (tests/data/qwen15_llamacpp_greedy.json) up to
the first position where llama.cpp's two best tokens are within NEAR_TIE nats (int4 weights and
llama.cpp's int8 activations may order those either way)."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from model_fixtures import qwen15_gguf  # noqa: F401

import engine

REFERENCE = json.loads((Path(__file__).parent / "data" / "qwen15_llamacpp_greedy.json").read_text(encoding="utf-8"))
SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QUESTION = "Write a Python function that returns the n-th Fibonacci number."
NUM_TOKENS = 32
NEAR_TIE = 0.1


def test_qwen15_streams_llamacpps_greedy_reply(qwen15_gguf):  # noqa: F811
    [entry] = [e for e in REFERENCE if QUESTION in e["prompt"]]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    params = engine.SamplingParams(max_tokens=NUM_TOKENS, temperature=0)
    with engine.Engine.from_pretrained(qwen15_gguf, max_num_batched_tokens=64) as eng:
        c = eng.model.config
        assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads) == ("qwen2", 28, 12, 2)
        assert eng.tokenizer.encode_chat(messages) == entry["prompt_ids"]
        events = list(eng.stream_chat(messages, params))
        # A prompt longer than a tick's budget: its inner chunks have no logit rows, and the
        # head's refinement (a Q6_K head re-quantized to int8, without the strips) must take none
        # (every chunked prompt failed its request before)
        long_prompt = entry["prompt_ids"] * 4
        [done] = eng.generate([long_prompt], engine.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        assert len(done.token_ids) == 2 and done.finish_reason == "length"
        # Where the kernels take strips, the Q6_K head runs in its own codes (exact: not refined) and its
        # lookups read the file's rows
        from cext import cpu
        model = eng.model
        if "avx2" in cpu.features():
            assert model.head_proj.format == "q6" and not model.head_is_refined
            assert model.head_int8.exact_rows is not None
            ids = torch.tensor([0, 151935, 1234])
            assert torch.equal(model.head_rows(ids), model.head_proj.dequantize()[ids])
    token_ids = [t for ev in events for t in ev.token_ids]
    text = "".join(ev.text for ev in events)
    assert len(token_ids) == NUM_TOKENS and events[-1].finish_reason == "length"
    decisive = 0  # positions before llama.cpp's first near-tie must agree exactly
    while (decisive < NUM_TOKENS and entry["top5"][decisive][0][1] - entry["top5"][decisive][1][1] >= NEAR_TIE):
        decisive += 1
    assert decisive >= 8, "the reference reply ties too early to say anything"
    assert token_ids[:decisive] == entry["greedy_ids"][:decisive], (text, entry["greedy_text"])
    assert text == eng.tokenizer.decode(token_ids)
