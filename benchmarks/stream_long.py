"""End to end with ScriptedModel: does per-token engine cost grow with output length?

Streams 4,096 generated tokens of real mixed text (Korean, CJK, emoji, English, code)
through Engine.stream with the default model's tokenizer and no model compute, and
compares tok/s over tokens 0-512 with tokens 3,584-4,096 (target ratio >= 0.95).
Options on: stop strings (never matching) and logprobs, to load the whole path.

    .venv/bin/python benchmarks/stream_long.py [--repeats 5] [--tokens 4096]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import engine
from engine.loader import default_model_path
from engine.params import SamplingParams
from engine.testing import ScriptedModel

MIXED = (
    "한국어 문장은 이렇게 생겼습니다. 中文的句子是这样的。日本語の文もあります。"
    "Emoji 👩‍👩‍👧‍👦🇰🇷🇫🇷👍🏽 and English prose about engines and tokens. "
    "def tick(state):\n    return [x * 2 for x in state if x]  # code\n"
)


def run_once(eng, num_tokens: int, params: SamplingParams) -> list[float]:
    stamps = []
    for event in eng.stream("Go.", params):
        now = time.perf_counter()
        stamps.extend([now] * len(event.token_ids))
    return stamps


def window_rate(stamps: list[float], start: int, end: int) -> float:
    return (end - start) / (stamps[end - 1] - stamps[start])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tok = engine.load_tokenizer(default_model_path())
    script = []
    while len(script) < args.tokens:
        script += tok.encode(MIXED, add_special_tokens=False)
    script = script[: args.tokens]
    model = ScriptedModel(script, tok.vocab_size)
    n = args.tokens
    variants = {
        "plain": SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
        "stop+logprobs": SamplingParams(
            max_tokens=n, temperature=0, ignore_eos=True, stop=["<never>", "ZZZ"], logprobs=True, top_logprobs=2
        ),
    }
    results = {}
    with engine.Engine(model, tok, max_model_len=n + 64, kv_cache_tokens=n + 256, speculative=None) as eng:
        run_once(eng, n, variants["plain"])  # warm-up
        for name, params in variants.items():
            early, late = [], []
            for _ in range(args.repeats):
                stamps = run_once(eng, n, params)
                early.append(window_rate(stamps, 0, 512))
                late.append(window_rate(stamps, n - 512, n))
            ratios = [lt / e for e, lt in zip(early, late)]
            results[name] = {
                "early_tok_s_median": statistics.median(early),
                "late_tok_s_median": statistics.median(late),
                "late_over_early_median": statistics.median(ratios),
                "late_over_early_min": min(ratios),
                "late_over_early_max": max(ratios),
            }
    print(f"{'variant':<16}{'tok/s 0-512':>14}{'tok/s last 512':>16}{'late/early (min-max)':>26}")
    for name, r in results.items():
        print(
            f"{name:<16}{r['early_tok_s_median']:>14.0f}{r['late_tok_s_median']:>16.0f}"
            f"{r['late_over_early_median']:>12.3f} ({r['late_over_early_min']:.3f}-{r['late_over_early_max']:.3f})"
        )
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "stream_long.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
