"""Aggregate decode throughput of the engine beside the raw model loop, and the host cost per token.

1. Default model, concurrency 1, 4, 16, 32: greedy requests of a 16-token prompt and 32
   new tokens. Three numbers per size, measured in the same run:
   - raw: ``benchmarks/decode.py``'s loop (static batch, decode steps only, prefill untimed);
   - engine decode: tokens/s through ``Engine.stream`` (what ``generate`` wraps) from the
     moment every request has its first token to the last token: the same work as raw;
   - engine generate: ``Engine.generate`` wall time, prefill included.
   Target: engine decode >= 0.9x raw at every size.
2. ``ScriptedModel`` (no compute), concurrency 1 and 64, 256 tokens each: tokens/s per stream
   and microseconds per generated token: the engine's pure host cost.

    .venv/bin/python benchmarks/throughput.py [--sizes 1,4,16,32] [--repeats 3] [--skip-model]
"""
from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json
from benchmarks.decode import raw_decode_tok_s
from engine import Engine
from engine.loader import default_model_path, load_model
from engine.params import SamplingParams
from engine.testing import ScriptedModel
from engine.tokenizer import load_tokenizer


def random_prompts(vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num)]


def engine_decode_tok_s(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Tokens/s once every request decodes (each stream consumed on its own thread)."""
    stamps: list[list[float]] = [[] for _ in prompts]
    streams = [eng.stream(p, params) for p in prompts]

    def consume(i: int) -> None:
        for event in streams[i]:
            now = time.perf_counter()
            stamps[i].extend([now] * len(event.token_ids))

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t_all_started = max(s[0] for s in stamps)
    t_end = max(s[-1] for s in stamps)
    num_tokens = sum(1 for s in stamps for x in s if x > t_all_started)
    return num_tokens / (t_end - t_all_started)


def engine_generate_tok_s(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> float:
    start = time.perf_counter()
    out = eng.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(c.token_ids) for c in out) / elapsed


def model_part(args, results: dict) -> list[list]:
    path = default_model_path()
    model, tok = load_model(path), load_tokenizer(path)
    params = SamplingParams(max_tokens=args.steps, temperature=0, ignore_eos=True)
    rows = []
    with Engine(model, tok, max_model_len=2048, max_num_seqs=max(args.sizes), speculative=None) as eng:
        eng.generate(random_prompts(model.vocab_size, 2, args.prompt_len, 99),
                     SamplingParams(max_tokens=4, temperature=0))
        raw_decode_tok_s(model, 1, num_steps=4, prompt_len=args.prompt_len)  # warm-up
        for size in args.sizes:
            raw, dec, gen = [], [], []
            for r in range(args.repeats):  # interleaved, so load changes hit all three alike
                raw.append(raw_decode_tok_s(model, size, args.steps, args.prompt_len, seed=r))
                prompts = random_prompts(model.vocab_size, size, args.prompt_len, seed=1000 + r)
                dec.append(engine_decode_tok_s(eng, prompts, params))
                gen.append(engine_generate_tok_s(eng, prompts, params))
            ratio = statistics.median(dec) / statistics.median(raw)
            results["model"].append({"concurrency": size, "raw_tok_s": summarize(raw),
                                     "engine_decode_tok_s": summarize(dec),
                                     "engine_generate_tok_s": summarize(gen), "decode_ratio": ratio,
                                     "samples": {"raw": raw, "decode": dec, "generate": gen}})
            rows.append([size, fmt_stats(summarize(raw)), fmt_stats(summarize(dec)), f"{ratio:.2f}",
                         fmt_stats(summarize(gen))])
            print(rows[-1], flush=True)
    return rows


def scripted_part(args, results: dict) -> list[list]:
    tok = load_tokenizer(default_model_path())
    script = tok.encode("The quick brown fox jumps over the lazy dog. " * 40,
                        add_special_tokens=False)[: args.scripted_tokens]
    model = ScriptedModel(script, tok.vocab_size)
    params = SamplingParams(max_tokens=args.scripted_tokens, temperature=0, ignore_eos=True)
    rows = []
    with Engine(model, tok, max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=1024,
                speculative=None) as eng:
        eng.generate([[1, 2, 3]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
        for size in (1, 64):
            rates = []
            for r in range(args.repeats):
                prompts = random_prompts(tok.vocab_size, size, args.prompt_len, seed=r)
                start = time.perf_counter()
                out = eng.generate(prompts, params)
                elapsed = time.perf_counter() - start
                rates.append(sum(len(c.token_ids) for c in out) / elapsed / size)
            us_per_token = [1e6 / (r * size) for r in rates]
            results["scripted"].append({"concurrency": size, "tok_s_per_stream": summarize(rates),
                                        "us_per_token": summarize(us_per_token)})
            rows.append([size, fmt_stats(summarize(rates), ".0f"),
                         fmt_stats(summarize([r * size for r in rates]), ".0f"),
                         fmt_stats(summarize(us_per_token), ".1f")])
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,4,16,32")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--scripted-tokens", type=int, default=256)
    parser.add_argument("--skip-model", action="store_true")
    args = parser.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",")]
    results: dict = {"steps": args.steps, "prompt_len": args.prompt_len, "repeats": args.repeats,
                     "model": [], "scripted": []}
    if not args.skip_model:
        rows = model_part(args, results)
        print_table(["concurrency", "raw tok/s", "engine decode tok/s", "engine/raw", "engine generate tok/s"], rows,
                    title=f"Default model, {args.prompt_len}-token prompts, {args.steps} new tokens, medians of "
                          f"{args.repeats} (min-max); target engine/raw >= 0.9")
    rows = scripted_part(args, results)
    print_table(["concurrency", "tok/s per stream", "tok/s total", "us per token"], rows,
                title=f"ScriptedModel (no compute), {args.scripted_tokens} tokens per request: host cost")
    results["environment"] = environment()
    print(f"JSON: {write_json('throughput', results)}")
    return results


if __name__ == "__main__":
    main()
