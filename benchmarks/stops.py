"""Stop-string matching: cost per token, construction time and memory, the automaton
(engine.text.stops.StopMatcher) beside the quadratic matcher it replaced (tests/test_stops.py's
QuadraticStopMatcher, the reference model), side by side in one run.

Text: 4,096 token-sized pieces, the default model's tokenizer decoding mixed real text one
token at a time (IncrementalDetokenizer). Stops: 1, 16 and 256 strings of 8 and 4,096
characters, each a substring of that text with its last character changed, so that the
matcher holds long partial matches (up to 4,095 characters) but never stops: the worst
realistic case for the held text. Per configuration and repetition (interleaved):
- ns/token: one pass of ``push`` over all pieces, divided by the number of pieces (the
  automaton: median of 5 passes per repetition, see INNER_PASSES);
- +completes_with: the same with ``completes_with(piece + "\ufffd")`` before each push (what
  the engine adds per token while the detokenizer holds text);
- build ms: the constructor;
- peak MiB: tracemalloc peak of constructor + one pass (a separate, untimed run).
The old matcher is skipped where its prefix set would not fit (the estimate is printed).
Then the caps: a 4 MB stop list (three shapes) is rejected by SamplingParams, timed with
its tracemalloc peak; and the largest accepted lists (256 x 4,096, 1 x 131,072 characters).

    .venv/bin/python benchmarks/stops.py [--reps 9] [--old-limit-mib 1024]

Never asserts on time; writes benchmarks/results/stops.json and prints the JSON.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json  # noqa: E402
from engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from engine.loader import default_model_path  # noqa: E402
from engine.params import SamplingParams  # noqa: E402
from engine.text.stops import MAX_NUM_STOPS, MAX_STOP_LEN, MAX_TOTAL_STOP_LEN, StopMatcher  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402
from tests.test_stops import QuadraticStopMatcher  # noqa: E402

NUM_PIECES = 4096
NUM_STOPS = (1, 16, 256)
STOP_LENS = (8, 4096)
NEVER = "\u2400"  # not in the text: a stop ending with it never completes
PARAGRAPHS = [
    "The quick brown fox jumps over the lazy dog while the engine streams tokens one at a time.\n",
    "def detokenize(ids: list[int]) -> str:\n    return ''.join(d.add(i) for i in ids) + d.finish()\n",
    "Stop strings end generation: the text is cut before the earliest one, and never retracted.\n",
    "北京是中国的首都，上海是最大的城市。Ελληνικά, русский язык, emoji 👍🏽 and accents: café.\n",
]
MATCHERS = {"automaton": StopMatcher, "quadratic": QuadraticStopMatcher}
# Passes per repetition (their median is the repetition's figure): a pass of the automaton
# takes ~1 ms, less than a scheduler slice on a loaded machine; the old one takes 20 ms-2 s.
INNER_PASSES = {"automaton": 5, "quadratic": 1}


def token_pieces(num_pieces: int) -> list[str]:
    """Token-sized text pieces: the default model's tokenizer decoding text one token at a time."""
    tok = load_tokenizer(str(default_model_path()))
    ids, k = [], 0
    while len(ids) < num_pieces * 2:
        ids += tok.encode(f"[{k}] " + "".join(PARAGRAPHS[(k + j) % len(PARAGRAPHS)] for j in range(4)),
                          add_special_tokens=False)
        k += 1
    detok = IncrementalDetokenizer(tok)
    pieces = [p for p in (detok.add(i) for i in ids) if p]
    return pieces[:num_pieces]


def make_stops(text: str, num_stops: int, stop_len: int, seed: int) -> tuple[str, ...]:
    rng = random.Random(seed)
    stops = set()
    while len(stops) < num_stops:
        start = rng.randrange(len(text) - stop_len)
        stops.add(text[start : start + stop_len - 1] + NEVER)
    return tuple(sorted(stops))


def quadratic_mib(stops) -> float:
    """A lower bound of the old matcher's prefix set: every proper prefix, its characters at
    the string's width (1, 2 or 4 bytes) plus a 40-byte str header."""
    def width(s):
        top = max(map(ord, s))
        return 1 if top < 256 else 2 if top < 65536 else 4

    return sum(width(s) * len(s) * (len(s) - 1) / 2 + 40 * (len(s) - 1) for s in stops) / 2**20


def push_pass(matcher, pieces) -> float:
    """ns per piece of one pass of push."""
    push = matcher.push
    start = time.perf_counter_ns()
    for piece in pieces:
        push(piece)
    return (time.perf_counter_ns() - start) / len(pieces)


def completes_pass(matcher, pieces) -> float:
    """ns per piece of completes_with(piece + a held U+FFFD) before each push, as an engine
    does while the detokenizer holds text; the push is included."""
    push, completes_with = matcher.push, matcher.completes_with
    tentatives = [piece + "\ufffd" for piece in pieces]
    start = time.perf_counter_ns()
    for piece, tentative in zip(pieces, tentatives):
        completes_with(tentative)
        push(piece)
    return (time.perf_counter_ns() - start) / len(pieces)


def peak_mib(fn) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def bench_configs(pieces, reps: int, old_limit_mib: float) -> list[dict]:
    text = "".join(pieces)
    results = []
    for num_stops in NUM_STOPS:
        for stop_len in STOP_LENS:
            stops = make_stops(text, num_stops, stop_len, seed=num_stops * 10_000 + stop_len)
            old_mib = quadratic_mib(stops)
            names = [n for n in MATCHERS if n == "automaton" or old_mib <= old_limit_mib]
            samples = {n: {"ns_per_token": [], "completes_ns_per_token": [], "build_ms": []} for n in names}
            for _ in range(reps):
                for name in names:  # interleaved: noise hits both alike
                    matcher = None  # free the previous matcher outside the timed build
                    start = time.perf_counter()
                    matcher = MATCHERS[name](stops, False)
                    samples[name]["build_ms"].append((time.perf_counter() - start) * 1e3)
                    for key, run_pass in (("ns_per_token", push_pass), ("completes_ns_per_token", completes_pass)):
                        passes = []
                        for _ in range(INNER_PASSES[name]):
                            passes.append(run_pass(matcher, pieces))
                            assert not matcher.is_stopped  # the stops never complete: every piece is matched
                            matcher.flush()  # back to the start state, as a new matcher
                        samples[name][key].append(statistics.median(passes))
            row = {"num_stops": num_stops, "stop_len": stop_len, "quadratic_estimated_mib": old_mib}
            for name in names:
                row[name] = {key: summarize(values) for key, values in samples[name].items()}
                row[name]["peak_mib"] = peak_mib(
                    lambda name=name, stops=stops: push_pass(MATCHERS[name](stops, False), pieces))
            results.append(row)
    return results


def bench_caps(reps: int) -> list[dict]:
    """4 MB stop lists are rejected (timed, with the peak); the largest accepted lists are built."""
    big = 4 * 2**20
    cases = {
        "4 MiB: 1,024 x 4,096 (count cap)": [f"{k:06d}".ljust(4096, "x") for k in range(1024)],
        "4 MiB: 256 x 16,384 (total cap)": [f"{k:06d}".ljust(16384, "x") for k in range(256)],
        "4 MiB: 1 x 4,194,304 (length cap)": ["x" * big],
        "accepted: 256 x 4,096": [f"{k:06d}".ljust(4096, "x") for k in range(MAX_NUM_STOPS)],
        "accepted: 1 x 131,072": ["ab" * (MAX_STOP_LEN // 2)],
    }
    rows = []
    for name, stops in cases.items():
        def build(stops=stops):
            try:
                return StopMatcher(tuple(SamplingParams(stop=stops).stop), False), None
            except ValueError as e:
                return None, str(e)

        times, matcher = [], None
        for _ in range(reps):
            matcher = None
            start = time.perf_counter()
            matcher, error = build()
            times.append((time.perf_counter() - start) * 1e3)
        rows.append({"case": name, "num_chars": sum(map(len, stops)), "ms": summarize(times),
                     "peak_mib": peak_mib(build), "rejected": error,
                     "num_nodes": None if matcher is None else matcher.num_nodes})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--old-limit-mib", type=float, default=1024.0,
                        help="skip the quadratic matcher where its prefix set would exceed this")
    args = parser.parse_args()
    pieces = token_pieces(NUM_PIECES)
    configs = bench_configs(pieces, args.reps, args.old_limit_mib)
    caps = bench_caps(args.reps)
    rows = []
    for row in configs:
        new, old = row["automaton"], row.get("quadratic")
        rows.append([
            row["num_stops"], row["stop_len"],
            fmt_stats(new["ns_per_token"], ".0f"),
            fmt_stats(old["ns_per_token"], ".0f") if old else f"skipped (~{row['quadratic_estimated_mib']:,.0f} MiB)",
            f"{old['ns_per_token']['median'] / new['ns_per_token']['median']:.1f}x" if old else "",
            fmt_stats(new["completes_ns_per_token"], ".0f"),
            fmt_stats(old["completes_ns_per_token"], ".0f") if old else "",
            fmt_stats(new["build_ms"], ".2f"), fmt_stats(old["build_ms"], ".1f") if old else "",
            f"{new['peak_mib']:.2f}", f"{old['peak_mib']:.1f}" if old else "",
        ])
    print_table(["stops", "len", "new ns/token", "old ns/token", "old/new",
                 "new +completes_with", "old +completes_with",
                 "new build ms", "old build ms",
                 "new peak MiB", "old peak MiB"], rows,
                title=f"Stop matching, {NUM_PIECES} token pieces of real text, medians (min-max) of {args.reps} reps")
    print_table(["stop list", "chars", "ms", "peak MiB", "result"],
                [[c["case"], f"{c['num_chars']:,}", fmt_stats(c["ms"], ".2f"), f"{c['peak_mib']:.2f}",
                  f"400: {c['rejected']}" if c["rejected"] else f"built, {c['num_nodes']:,} nodes"] for c in caps],
                title=f"Caps: {MAX_NUM_STOPS} strings, {MAX_STOP_LEN:,} chars each, {MAX_TOTAL_STOP_LEN:,} in all")
    report = {"num_pieces": NUM_PIECES, "num_chars": len("".join(pieces)), "reps": args.reps,
              "configs": configs, "caps": caps, "environment": environment()}
    write_json("stops", report)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
