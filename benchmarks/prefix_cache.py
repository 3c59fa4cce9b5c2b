"""Prefix caching: time to first token of a request that shares a 2,000-token system prompt.

A chat app sends the same long system prompt with every conversation. The first request
computes it; with prefix caching the second request reuses its full KV blocks and only
computes its own tail. Both runs use the default model and default engine settings; each
repeat uses a fresh system prompt so that the first request is always cold.

    .venv/bin/python benchmarks/prefix_cache.py [--system-tokens 2000] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
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
        with Engine(model, tok, enable_prefix_caching=caching) as eng:
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
    print(f"JSON: {write_json('prefix_cache', results)}")
    return results


if __name__ == "__main__":
    main()
