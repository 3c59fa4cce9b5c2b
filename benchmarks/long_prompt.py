"""A long prompt arrives while 4 streams decode: do the streams stall, does a short request wait?

Four greedy streams decode on the default model; an 8,000-token prompt arrives; a short
request is sent while the long prompt is being prefilled. Modes (--modes), each a fresh engine:
  default    the engine's defaults (chunked prefill under a per-tick time target)
  chunked    256-token chunks: max_num_batched_tokens 256, no time target (issue 29's case)
  whole      a token budget that takes the whole prompt in one tick
Reported per mode:
- inter-token gaps of the 4 streams (p50 / p99 / max) before the long prompt and during its prefill
- ticks during the prefill and the fewest tokens any stream got in them: equal counts mean no
  stream ever waited longer than one tick (a tick that left a stream out would show as fewer)
- time to first token of the short request sent during the prefill
- the long prompt's prefill time (submission to its first token), and its ratio to the whole run

Targets: default max gap during the prefill <= 0.5 s, short TTFT <= 1 s, prefill time <= 1.5x
the whole-prompt run (issue 29: 256-token chunks <= 1.1x). Timings only; nothing is asserted.
--trees A,B runs every (repeat, mode) once per tree, each in a child process importing that
tree's engine (this script's measurement either way), interleaved: before/after comparisons.

    .venv/bin/python benchmarks/long_prompt.py [--long-tokens 8000] [--repeats 1] [--modes chunked,whole]
        [--trees /path/to/before,/path/to/after] [--activations int16|int8]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

if __name__ == "__main__" and os.environ.get("LONG_PROMPT_TREE"):  # a child: that tree's engine first
    sys.path.insert(0, os.environ["LONG_PROMPT_TREE"])

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json  # noqa: E402
from engine import Engine  # noqa: E402
from engine.loader import default_model_path, load_model  # noqa: E402
from engine.params import SamplingParams  # noqa: E402
from engine.tokenizer import load_tokenizer  # noqa: E402

MODES = {"default": "default (chunked, time target)", "chunked": "256-token chunks, no time target",
         "whole": "whole prompt in one tick"}

TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines were "
    "programmed by rewiring; then came stored programs, assemblers, compilers and operating systems. "
)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def make_engine(model, tok, mode: str, long_tokens: int) -> Engine:
    if mode == "default":
        return Engine(model, tok, max_model_len=8192, kv_cache_tokens=16384, speculative=None)
    budget = 256 if mode == "chunked" else long_tokens + 64
    return Engine(model, tok, max_model_len=8192, kv_cache_tokens=16384, max_num_batched_tokens=budget,
                  target_tick_seconds=None, speculative=None)


def run_once(model, tok, mode: str, long_tokens: int, before_s: float, short_delay_s: float) -> dict:
    ids = tok.encode(TEXT * (long_tokens // 20 + 1), add_special_tokens=False)
    long_prompt = ids[:long_tokens]
    stream_params = SamplingParams(max_tokens=1800, temperature=0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    eng = make_engine(model, tok, mode, long_tokens)
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
    ticks_at_submit = eng.stats()["num_ticks"]
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
    ticks_during = eng.stats()["num_ticks"] - ticks_at_submit
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
    tokens_during = [sum(1 for x in s if t_long < x <= t_first) for s in stamps]
    before = gaps(t_ready, t_long)
    return {
        "before": {"p50": percentile(before, 0.5), "p99": percentile(before, 0.99), "max": max(before, default=0)},
        "during": {"p50": percentile(during, 0.5), "p99": percentile(during, 0.99), "max": max(during, default=0)},
        "num_gaps_during": len(during),
        "ticks_during": ticks_during,
        "min_stream_tokens_during": min(tokens_during),
        "short_ttft": result.get("short_ttft", float("nan")),
        "short_sent_after": result.get("short_sent_after", float("nan")),
        "prefill_s": t_first - t_long,
        "num_ticks": num_ticks,
    }


def routes() -> dict:
    """The kernels' instruction set and this tree's prefill attention path."""
    from engine.models import attention, fused

    try:
        from cext import cpu as isa_switch
    except ImportError:  # a tree from before cext.cpu
        from cext import fused as isa_switch
    is_fused = fused.default_enabled()
    in_place = is_fused and hasattr(fused, "prefill_attention") and \
        "num_prefill_seqs" in attention.AttentionPlan.__dataclass_fields__
    tiles = in_place and "tiles" in attention.AttentionPlan.__dataclass_fields__ and isa_switch.allows("amx_bf16")
    return {"isa": isa_switch.get_isa() if is_fused else None,
            "prefill_attention": ("C kernel in place" + (", AMX tiles" if tiles else "")) if in_place
            else "SDPA per sequence"}


def model_options(args) -> dict:
    """load_model's options: none for the default activations (a tree from before the option loads)."""
    return {} if args.activations == "int16" else {"activations": args.activations}


def child_main(args) -> None:
    """One (mode) run in this process; prints its result as one JSON line on stdout."""
    path = default_model_path()
    model, tok = load_model(path, **model_options(args)), load_tokenizer(path)
    Engine(model, tok).generate(["warm up"], SamplingParams(max_tokens=2, temperature=0))
    r = run_once(model, tok, args.child, args.long_tokens, args.before_seconds, args.short_delay)
    print(json.dumps({**r, "routes": routes()}), flush=True)


def run_in_tree(tree: str, mode: str, args) -> dict:
    env = dict(os.environ, LONG_PROMPT_TREE=tree, PYTHONPATH=tree)
    argv = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--long-tokens",
            str(args.long_tokens), "--before-seconds", str(args.before_seconds),
            "--short-delay", str(args.short_delay), "--activations", args.activations]
    done = subprocess.run(argv, env=env, cwd=tree, stdout=subprocess.PIPE, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def describe(r: dict) -> str:
    brief = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()
             if k not in ("before", "during")}
    return (f"{brief} before {({k: round(v, 3) for k, v in r['before'].items()})} "
            f"during {({k: round(v, 3) for k, v in r['during'].items()})}")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long-tokens", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--modes", default="default,chunked,whole", help=f"any of {','.join(MODES)}")
    parser.add_argument("--trees", default=None,
                        help="comma-separated source trees to compare (child processes)")
    parser.add_argument("--before-seconds", type=float, default=3.0)
    parser.add_argument("--short-delay", type=float, default=1.0, help="seconds after the long prompt")
    parser.add_argument("--activations", default="int16", choices=["int16", "int8"],
                        help="the packed products' activation codes (load_model's activations)")
    parser.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child_main(args)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown or "whole" not in modes:
        raise SystemExit(f"--modes: unknown {unknown} (known: {', '.join(MODES)}); "
                         "'whole' is the ratios' base")
    trees = args.trees.split(",") if args.trees else [None]
    load_start = os.getloadavg()
    if trees == [None]:
        path = default_model_path()
        model, tok = load_model(path, **model_options(args)), load_tokenizer(path)
        Engine(model, tok).generate(["warm up"], SamplingParams(max_tokens=2, temperature=0))
    runs: dict[str, list[dict]] = {}
    for repeat in range(args.repeats):
        for tree_index in range(len(trees)):  # rotate which tree goes first
            tree = trees[(tree_index + repeat) % len(trees)]
            for mode in modes:
                key = f"{MODES[mode]}" + (f" [{Path(tree).name}]" if tree else "")
                if tree:
                    r = run_in_tree(tree, mode, args)
                else:
                    r = run_once(model, tok, mode, args.long_tokens, args.before_seconds, args.short_delay)
                    r["routes"] = routes()
                r["load_average"] = os.getloadavg()
                runs.setdefault(key, []).append(r)
                print(key, describe(r), flush=True)
    rows, summary = [], {}
    for name, rs in runs.items():
        s = {f"gap_{part}_{stat}": summarize([r[part][stat] for r in rs]) for part in ("before", "during")
             for stat in ("p50", "p99", "max")}
        s["short_ttft"] = summarize([r["short_ttft"] for r in rs])
        s["prefill_s"] = summarize([r["prefill_s"] for r in rs])
        summary[name] = s
        rows.append([
            name,
            "/".join(f"{s[f'gap_before_{stat}']['median']:.3f}" for stat in ("p50", "p99", "max")),
            "/".join(f"{s[f'gap_during_{stat}']['median']:.3f}" for stat in ("p50", "p99", "max")),
            " ".join(f"{r['min_stream_tokens_during']}/{r['ticks_during']}" for r in rs),
            fmt_stats(s["short_ttft"], ".2f"),
            fmt_stats(s["prefill_s"], ".1f"),
        ])
    for name, s in summary.items():  # each to the whole-prompt run of its own tree
        suffix = name[len(next(m for m in MODES.values() if name.startswith(m))):]
        base = summary[MODES["whole"] + suffix]
        s["ratio_to_whole"] = s["prefill_s"]["median"] / base["prefill_s"]["median"]
    for row, s in zip(rows, summary.values()):
        row.append(f"{s['ratio_to_whole']:.2f}x")
    env = environment()
    results = {"long_tokens": args.long_tokens, "repeats": args.repeats, "modes": modes, "trees": trees,
               "activations": args.activations,
               "runs": runs, "summary": summary, "load_average_start": load_start, "environment": env}
    print_table(
        ["run", "gap before p50/p99/max s", "gap during p50/p99/max s", "min stream tokens / ticks during",
         "short TTFT s", "long prefill s", "/ whole"], rows,
        title=f"{args.long_tokens}-token prompt arriving among 4 decoding streams (default model, {args.activations} "
              f"activations, medians of "
              f"{args.repeats}; min-max in parentheses; interleaved)",
    )
    print(f"routes: {sorted({json.dumps(r['routes']) for rs in runs.values() for r in rs})}")
    print("targets: default max gap during <= 0.5 s, short TTFT <= 1 s, default / whole <= 1.5x, "
          "256-token chunks / whole <= 1.1x with every stream served every tick")
    print(f"load average at the start {load_start}, at the end {env['load_average']} "
          f"({env['cpu_count']} CPUs; the machine is shared)")
    print(f"JSON: {write_json('long_prompt', results)}")
    return results


if __name__ == "__main__":
    main()
