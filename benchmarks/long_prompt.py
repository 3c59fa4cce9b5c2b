"""A long prompt arrives while 4 streams decode: do the streams stall, does a short request wait?

Four greedy streams decode on the default model; an 8,000-token prompt arrives; a short
request is sent while the long prompt is being prefilled. Reported, for the engine's
default settings (chunked prefill under a per-tick time target) beside a run whose token
budget takes the whole prompt in one tick:

- inter-token gaps of the 4 streams (p50 / p99 / max) before the long prompt and during its prefill
- time to first token of the short request sent during the prefill
- the long prompt's prefill time (submission to its first token)

Targets with the default settings: max gap during the prefill <= 0.5 s, short TTFT <= 1 s,
prefill time <= 1.5x the whole-prompt run. Timings only; nothing is asserted.

    .venv/bin/python benchmarks/long_prompt.py [--long-tokens 8000] [--repeats 1]
"""
from __future__ import annotations

import argparse
import statistics
import threading
import time

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json
from engine import Engine
from engine.loader import default_model_path, load_model
from engine.params import SamplingParams
from engine.tokenizer import load_tokenizer

TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines were "
    "programmed by rewiring; then came stored programs, assemblers, compilers and operating systems. "
)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def make_engine(model, tok, whole_prompt: bool, long_tokens: int) -> Engine:
    if not whole_prompt:
        return Engine(model, tok, max_model_len=8192, kv_cache_tokens=16384)
    return Engine(
        model, tok, max_model_len=8192, kv_cache_tokens=16384,
        max_num_batched_tokens=long_tokens + 64, target_tick_seconds=None,
    )


def run_once(model, tok, whole_prompt: bool, long_tokens: int, before_s: float, short_delay_s: float) -> dict:
    ids = tok.encode(TEXT * (long_tokens // 20 + 1), add_special_tokens=False)
    long_prompt = ids[:long_tokens]
    stream_params = SamplingParams(max_tokens=1800, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    eng = make_engine(model, tok, whole_prompt, long_tokens)
    stamps: list[list[float]] = [[] for _ in range(4)]
    stop = threading.Event()
    streams = [eng.stream(f"Stream {i}: tell me a long story about the sea.", stream_params) for i in range(4)]

    def consume(i: int) -> None:
        for event in streams[i]:
            now = time.perf_counter()
            stamps[i].extend([now] * len(event.token_ids))
            if stop.is_set():
                break

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    while min(len(s) for s in stamps) < 3:  # all four decoding
        time.sleep(0.01)
    time.sleep(before_s)
    t_long = time.perf_counter()
    long_stream = eng.stream(long_prompt, one)
    result: dict = {}

    def short_request() -> None:
        time.sleep(short_delay_s)
        t0 = time.perf_counter()
        for _ in eng.stream("What is 2 + 2?", one):
            result["short_ttft"] = time.perf_counter() - t0
            result["short_sent_after"] = t0 - t_long
            break

    short_thread = threading.Thread(target=short_request, daemon=True)
    short_thread.start()
    next(iter(long_stream))
    t_first = time.perf_counter()
    short_thread.join()
    stop.set()
    for s in streams:
        s.close()
    for t in threads:
        t.join(timeout=30)
    num_ticks = eng.stats()["num_ticks"]
    eng.close()

    def gaps(lo: float, hi: float) -> list[float]:
        out = []
        for s in stamps:
            inside = [x for x in s if lo <= x <= hi]
            out += [b - a for a, b in zip(inside, inside[1:])]
        return out

    t_ready = min(s[2] for s in stamps)
    # During: gaps that end after the long prompt arrived, up to its first token.
    during = []
    for s in stamps:
        during += [b - a for a, b in zip(s, s[1:]) if t_long < b <= t_first]
    before = gaps(t_ready, t_long)
    return {
        "before": {"p50": percentile(before, 0.5), "p99": percentile(before, 0.99), "max": max(before, default=0)},
        "during": {"p50": percentile(during, 0.5), "p99": percentile(during, 0.99), "max": max(during, default=0)},
        "num_gaps_during": len(during),
        "short_ttft": result.get("short_ttft", float("nan")),
        "short_sent_after": result.get("short_sent_after", float("nan")),
        "prefill_s": t_first - t_long,
        "num_ticks": num_ticks,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long-tokens", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--before-seconds", type=float, default=3.0)
    parser.add_argument("--short-delay", type=float, default=1.0, help="seconds after the long prompt")
    args = parser.parse_args(argv)
    path = default_model_path()
    model, tok = load_model(path), load_tokenizer(path)
    Engine(model, tok).generate(["warm up"], SamplingParams(max_tokens=2, temperature=0))
    runs = {"default (chunked, time target)": [], "whole prompt in one tick": []}
    for _ in range(args.repeats):
        for name, whole in (("default (chunked, time target)", False), ("whole prompt in one tick", True)):
            r = run_once(model, tok, whole, args.long_tokens, args.before_seconds, args.short_delay)
            runs[name].append(r)
            print(name,
                  {k: (round(v, 3) if isinstance(v, float) else v)
                   for k, v in r.items() if k not in ("before", "during")},
                  "before", {k: round(v, 3) for k, v in r["before"].items()},
                  "during", {k: round(v, 3) for k, v in r["during"].items()}, flush=True)
    rows = []
    summary = {}
    for name, rs in runs.items():
        s = {
            "gap_before_p50": summarize([r["before"]["p50"] for r in rs]),
            "gap_before_p99": summarize([r["before"]["p99"] for r in rs]),
            "gap_before_max": summarize([r["before"]["max"] for r in rs]),
            "gap_during_p50": summarize([r["during"]["p50"] for r in rs]),
            "gap_during_p99": summarize([r["during"]["p99"] for r in rs]),
            "gap_during_max": summarize([r["during"]["max"] for r in rs]),
            "short_ttft": summarize([r["short_ttft"] for r in rs]),
            "prefill_s": summarize([r["prefill_s"] for r in rs]),
        }
        summary[name] = s
        rows.append([
            name,
            f"{s['gap_before_p50']['median']:.3f}/{s['gap_before_p99']['median']:.3f}/{s['gap_before_max']['median']:.3f}",
            f"{s['gap_during_p50']['median']:.3f}/{s['gap_during_p99']['median']:.3f}/{s['gap_during_max']['median']:.3f}",
            fmt_stats(s["short_ttft"], ".2f"),
            fmt_stats(s["prefill_s"], ".1f"),
        ])
    names = list(runs)
    ratio = statistics.median(r["prefill_s"] for r in runs[names[0]]) / statistics.median(
        r["prefill_s"] for r in runs[names[1]])
    results = {"long_tokens": args.long_tokens, "repeats": args.repeats, "runs": runs, "summary": summary,
               "prefill_ratio_default_vs_whole": ratio, "environment": environment()}
    print_table(
        ["run", "gap before p50/p99/max s", "gap during p50/p99/max s", "short TTFT s", "long prefill s"], rows,
        title=f"{args.long_tokens}-token prompt arriving among 4 decoding streams (default model, medians of "
              f"{args.repeats}; min-max in parentheses)",
    )
    print(f"prefill time default / whole-prompt: {ratio:.2f}x (target <= 1.5x); "
          f"targets: max gap during <= 0.5 s, short TTFT <= 1 s")
    print(f"JSON: {write_json('long_prompt', results)}")
    return results


if __name__ == "__main__":
    main()
