"""Prefix caching: time to first token of a request that shares a 2,000-token system prompt.

A chat app sends the same long system prompt with every conversation. The first request
computes it; with prefix caching the second request reuses its full KV blocks and only
computes its own tail. Both runs use the default model and default engine settings; each
repeat uses a fresh system prompt so that the first request is always cold.

The restart row: an engine on a prefix_cache_dir prefills a long prompt (8,160 tokens, near
the default model's 8,192 context) cold, is closed (its blocks reach the disk), and a new
engine on the same directory answers the same prompt, its blocks read from disk. Cold and
restart alternate per repeat, each repeat with a fresh prompt. The new engine shares the
weights loaded in this process (a fresh KV cache, no memory prefix cache), and the files come
from the page cache, as after a quick restart of a server.

    .venv/bin/python benchmarks/prefix_cache.py [--system-tokens 2000] [--restart-tokens 8160] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json
from engine import Engine
from engine.loader import default_model_path, load_model
from engine.params import SamplingParams
from engine.tokenizer import load_tokenizer

SYSTEM = (
    "You are a support assistant for a bicycle shop. Policies: returns within thirty days with a receipt; "
    "repairs are quoted before work starts; helmets are not returnable once worn. Opening hours are nine to "
    "six on weekdays and ten to four on Saturdays. "
)


def ttft(eng: Engine, prompt: list[int]) -> float:
    start = time.perf_counter()
    stream = eng.stream(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    next(iter(stream))
    elapsed = time.perf_counter() - start
    stream.close()
    return elapsed


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--restart-tokens", type=int, default=8160, help="0: no restart row")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    path = default_model_path()
    model, tok = load_model(path), load_tokenizer(path)
    base = tok.encode(SYSTEM * (args.system_tokens // 40 + 2), add_special_tokens=False)
    user1 = tok.encode("\nUser: Can I return a worn helmet?\nAssistant:", add_special_tokens=False)
    user2 = tok.encode("\nUser: When are you open on Saturday?\nAssistant:", add_special_tokens=False)
    results: dict = {"system_tokens": args.system_tokens, "repeats": args.repeats, "runs": {}}
    rows = []
    for caching in (False, True):
        firsts, seconds, hits = [], [], []
        with Engine(model, tok, enable_prefix_caching=caching, speculative=None) as eng:
            ttft(eng, tok.encode("warm up", add_special_tokens=False))
            for r in range(args.repeats):
                system = tok.encode(f"Conversation {r}. ", add_special_tokens=False) + base
                system = system[: args.system_tokens]
                firsts.append(ttft(eng, system + user1))
                before = eng.stats()["num_prefix_cache_hit_tokens"]
                seconds.append(ttft(eng, system + user2))
                hits.append(eng.stats()["num_prefix_cache_hit_tokens"] - before)
        name = "on" if caching else "off"
        results["runs"][name] = {"first_ttft": summarize(firsts), "second_ttft": summarize(seconds),
                                 "cached_tokens_of_second": hits, "samples": {"first": firsts, "second": seconds}}
        rows.append([name, fmt_stats(summarize(firsts), ".2f"), fmt_stats(summarize(seconds), ".3f"),
                     statistics.median(hits)])
        print(rows[-1], flush=True)
    speedup = results["runs"]["off"]["second_ttft"]["median"] / results["runs"]["on"]["second_ttft"]["median"]
    results["second_ttft_speedup"] = speedup
    results["environment"] = environment()
    print_table(["prefix caching", "1st request TTFT s", "2nd request TTFT s", "2nd: cached tokens"], rows,
                title=f"{args.system_tokens}-token shared system prompt, default model,"
                      f" medians of {args.repeats} (min-max)")
    print(f"second-request TTFT, caching off / on: {speedup:.1f}x")
    if args.restart_tokens:
        results["restart"] = restart_row(tok, base, args.restart_tokens, args.repeats)
    print(f"JSON: {write_json('prefix_cache', results)}")
    return results


def restart_row(tok, base: list[int], num_tokens: int, repeats: int) -> dict:
    colds, restarts, hits = [], [], []
    text = tok.decode(base)
    long_base = tok.encode(text * (num_tokens // len(base) + 2), add_special_tokens=False)
    with tempfile.TemporaryDirectory(prefix="prefix-cache-bench-") as cache_dir:
        with Engine.from_pretrained(prefix_cache_dir=cache_dir) as eng:
            model = eng.model  # held: the engines below share the loaded weights
            ttft(eng, tok.encode("warm up", add_special_tokens=False))
        for r in range(repeats):
            prompt = (tok.encode(f"Document {r}. ", add_special_tokens=False) + long_base)[:num_tokens]
            with Engine.from_pretrained(prefix_cache_dir=cache_dir) as eng:
                colds.append(ttft(eng, prompt))
            with Engine.from_pretrained(prefix_cache_dir=cache_dir) as eng:
                restarts.append(ttft(eng, prompt))
                hits.append(eng.stats()["num_prefix_cache_disk_hit_tokens"])
            print(f"restart repeat {r}: cold {colds[-1]:.2f} s, after restart {restarts[-1]:.3f} s, "
                  f"{hits[-1]} tokens from disk", flush=True)
        del model
    speedup = statistics.median(colds) / statistics.median(restarts)
    print_table(["prompt tokens", "cold TTFT s", "TTFT after restart s", "tokens read from disk", "cold / restart"],
                [[num_tokens, fmt_stats(summarize(colds), ".2f"), fmt_stats(summarize(restarts), ".3f"),
                  statistics.median(hits), f"{speedup:.1f}x"]],
                title=f"restart on the same prefix_cache_dir, default model, medians of {repeats} (min-max)")
    return {"prompt_tokens": num_tokens, "cold_ttft": summarize(colds), "restart_ttft": summarize(restarts),
            "disk_hit_tokens": hits, "speedup": speedup, "samples": {"cold": colds, "restart": restarts}}


if __name__ == "__main__":
    main()
