"""The seed's validation on Qwen2.5-0.5B in bf16: one long stream through HTTP vs the raw model loop.

    make testdata   # the Qwen2.5-Coder-0.5B-Instruct Q4_K_M file
    .venv/bin/python benchmarks/seed_validation.py [--tokens 4096] [--window 512] [--repeats 2] [--quick]
        [--model PATH] [--dtype bfloat16] [--quantization Q] [--num-threads N] [--option KEY=VALUE ...]

One stream at concurrency 1 generates --tokens tokens (greedy, EOS ignored) through the HTTP
server (webapp.make_server in a subprocess, as benchmarks/serving.py starts it; raw SSE bytes,
one chunk per token) and through the raw model loop (engine.model of an engine built with the
same options in this process, run on its own thread as the engine runs its forwards: no
scheduler, no detokenizer, a static block table; the same prompt ids, the same positions).
Decode tok/s over tokens 0-512 and over the last 512 tokens (3,584-4,096): the time from a
window's first token to its last. Target: HTTP within 10% of the raw loop in both windows.
Runs alternate HTTP / raw (interleaved); medians with min-max.
Writes benchmarks/results/seed_validation.json. Never asserts on time.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import environment, fmt_stats, on_own_thread, print_table, summarize, write_json  # noqa: E402
from benchmarks.vs_llamacpp import QWEN_PATH, add_engine_arguments, engine_options  # noqa: E402

PROMPT = "Write a long, detailed tutorial on implementing a hash map in C, with code."
TARGET_RATIO = 0.9
BLOCK_SIZE = 16


def window_rate(stamps: list[float], start: int, end: int) -> float:
    """Decode tok/s from token `start` to token `end - 1`."""
    return (end - 1 - start) / (stamps[end - 1] - stamps[start])


def raw_stamps(model, prompt_ids: list[int], num_tokens: int) -> list[float]:
    """Arrival time of each of num_tokens greedy tokens: one prefill, then one forward per token."""
    import torch

    from benchmarks.decode import decode_batch
    from engine.batch import single_sequence_batch

    num_blocks = -(-(len(prompt_ids) + num_tokens) // BLOCK_SIZE)
    cache = model.make_kv_cache(num_blocks, BLOCK_SIZE)
    block_tables = torch.arange(num_blocks, dtype=torch.int64).view(1, num_blocks)  # [1, num_blocks]
    batch = single_sequence_batch(prompt_ids, 0, list(range(num_blocks)), BLOCK_SIZE)
    next_ids = model.forward(batch, cache).argmax(dim=-1)  # [1]
    stamps = [time.perf_counter()]
    for step in range(num_tokens - 1):
        batch = decode_batch(next_ids, len(prompt_ids) + step, block_tables, BLOCK_SIZE)
        next_ids = model.forward(batch, cache).argmax(dim=-1)  # [1]
        stamps.append(time.perf_counter())
    return stamps


def http_stamps(port: int, num_tokens: int) -> list[float]:
    from benchmarks.serving import http_stream

    num_generated, _, arrivals = http_stream(port, PROMPT, num_tokens)
    if num_generated != num_tokens or len(arrivals) != num_tokens:
        raise RuntimeError(f"HTTP stream: {num_generated} tokens in {len(arrivals)} chunks, expected {num_tokens} "
                           "(one chunk per token)")
    return arrivals


def serve_child(model: str, options: dict) -> None:
    """Subprocess mode: serve an engine on a free port, print the port, run until stdin closes."""
    import engine
    from webapp import make_server

    eng = engine.Engine.from_pretrained(model, **options)
    server = make_server(eng, "127.0.0.1", 0)
    threading.Thread(target=server.run, daemon=True).start()
    print(server.effective_port, flush=True)
    sys.stdin.read()
    eng.close()


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(QWEN_PATH), help="a .gguf file (default: Qwen2.5-Coder-0.5B Q4_K_M)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="1 repeat")
    add_engine_arguments(parser, dtype="bfloat16")
    parser.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine-options", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
    if args.tokens < 2 * args.window:
        parser.error(f"--tokens must be at least 2 * --window ({2 * args.window})")
    return args


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.serve_child:
        return serve_child(args.model, json.loads(args.engine_options))
    if not Path(args.model).is_file():
        raise SystemExit(f"{args.model} is missing: run `make testdata`")
    import engine

    prompt_len_bound = 64
    options = engine_options(args, {"max_model_len": args.tokens + prompt_len_bound,
                                    "kv_cache_tokens": args.tokens + prompt_len_bound, "speculative": None})
    server = subprocess.Popen([sys.executable, __file__, "--serve-child", "--model", args.model,
                               "--engine-options", json.dumps(options)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        eng = engine.Engine.from_pretrained(args.model, **options)
        prompt_ids = eng.tokenizer.encode(PROMPT, add_special_tokens=True)
        if len(prompt_ids) > prompt_len_bound:
            raise SystemExit(f"the prompt has {len(prompt_ids)} tokens, more than {prompt_len_bound}")
        http_stamps(port, 8)  # warm-up, both sides
        on_own_thread(raw_stamps, eng.model, prompt_ids, 8)
        n, w = args.tokens, args.window
        windows = {f"tokens 0-{w}": (0, w), f"tokens {n - w}-{n}": (n - w, n)}
        rates = {side: {name: [] for name in windows} for side in ("http", "raw")}
        for repeat in range(args.repeats):
            sides = ("http", "raw") if repeat % 2 == 0 else ("raw", "http")
            for side in sides:
                stamps = (http_stamps(port, n) if side == "http"
                          else on_own_thread(raw_stamps, eng.model, prompt_ids, n))
                for name, (start, end) in windows.items():
                    rates[side][name].append(window_rate(stamps, start, end))
                print(f"  {side}: " + ", ".join(f"{name} {rates[side][name][-1]:.1f} tok/s" for name in windows),
                      file=sys.stderr, flush=True)
        eng.close()
    finally:
        server.stdin.close()
        server.wait(120)
    results = {"model": args.model, "engine_options": options, "tokens": n, "window": w, "repeats": args.repeats,
               "prompt_tokens": len(prompt_ids), "windows": {}}
    rows = []
    for name in windows:
        ratios = [h / r for h, r in zip(rates["http"][name], rates["raw"][name])]
        ratio = summarize(ratios)
        results["windows"][name] = {"http_tok_s": summarize(rates["http"][name]),
                                    "raw_tok_s": summarize(rates["raw"][name]), "http_over_raw": ratio}
        rows.append([name, fmt_stats(summarize(rates["http"][name])), fmt_stats(summarize(rates["raw"][name])),
                     fmt_stats(ratio, ".3f"), "met" if ratio["median"] >= TARGET_RATIO else "MISSED"])
    results["environment"] = environment()
    print_table(["window", "HTTP tok/s", "raw loop tok/s", "HTTP / raw", f">= {TARGET_RATIO}"], rows,
                title=f"{Path(args.model).name}, one {n}-token stream at concurrency 1, engine options {options}, "
                      f"{args.repeats} repeats; load average {results['environment']['load_average']}")
    print(f"JSON: {write_json('seed_validation', results)}")
    return results


if __name__ == "__main__":
    main()
