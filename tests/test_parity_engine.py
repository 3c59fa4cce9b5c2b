"""Parity with llama.cpp through the public API: teacher-forced via prompt_logprobs.

The reference holds llama.cpp's greedy continuation of the default model (Q4_1) and its
top-5 logprobs at each generated position. Bounds per the foundation issue.
"""
import json
from pathlib import Path

import pytest

import engine
from engine.params import SamplingParams

REFERENCE = json.loads((Path(__file__).parent / "data" / "smollm2_llamacpp_greedy.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_logprobs_match_llamacpp(dtype):
    with engine.Engine.from_pretrained(dtype=dtype, max_model_len=512, kv_cache_tokens=2048) as eng:
        prompts = [case["prompt_ids"] + case["greedy_ids"] for case in REFERENCE]
        done = eng.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))
    worst = 0.0
    for case, completion in zip(REFERENCE, done):
        num_prompt = len(case["prompt_ids"])
        for i, (ref_id, top5) in enumerate(zip(case["greedy_ids"], case["top5"])):
            ours = completion.prompt_logprobs[num_prompt + i]
            assert ours.token_id == ref_id
            ref_top3 = [t for t, _ in top5[:3]]
            our_top3 = [t for t, _, _, _ in ours.top]
            assert our_top3[0] in ref_top3, (case["prompt"][-40:], i)
            assert ref_id in our_top3, (case["prompt"][-40:], i)
            ref_lp = dict(map(tuple, top5))[ref_id]
            worst = max(worst, abs(ours.logprob - ref_lp))
            assert abs(ours.logprob - ref_lp) <= 0.35, (case["prompt"][-40:], i, ours.logprob, ref_lp)
    print(f"{dtype}: worst |logprob difference| = {worst:.3f}")
