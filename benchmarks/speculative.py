"""One stream with and without n-gram speculation, side by side in one run.

Two engines on the same model (plain, speculative="ngram"), greedy, one request at a time,
end to end through ``Engine.generate`` (prefill included) and decode-only (tok/s after the
first token, from the stream's event times). Tasks: code editing (rename a variable, add type
hints, translate comments, reformat: the output mostly copies the prompt) and open-ended chat.
Repeats interleave the two engines prompt by prompt; medians with min-max. Per task the
acceptance rate and the mean accepted length per proposal (accepted / proposals) come from
the speculative engine's counters. Outputs are checked equal token for token.

The machine is shared (several engineers, 2 cores): the load average is printed and recorded,
and the figures are indicative only.

``--proposer``: only the n-gram proposer's micro-benchmark (cext/ngram.pyx): the cost of one
proposal at an 8k-token context as a decode sees it (one id appended, then propose), median and
p99 over 2,000 steps, and the cold build of the index over the whole context.

Usage: ``python benchmarks/speculative.py [--model PATH] [--max-tokens 128] [--repeats 3] [-k 4]
[--proposer]``. Writes benchmarks/results/speculative.json (speculative_proposer.json).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json
from cext.ngram import NgramIndex
from engine import Engine, SamplingParams

CODE = '''def total_price(items, tax_rate, discount=None):
    # compute the sum of all items
    subtotal = 0
    for item in items:
        # price times quantity
        subtotal += item.price * item.quantity
    if discount is not None:
        # apply the discount before tax
        subtotal = subtotal - subtotal * discount
    tax = subtotal * tax_rate
    total = subtotal + tax
    return round(total, 2)
'''

TASKS = {
    "code-edit": [
        "Rename the variable subtotal to base_amount in this function. Answer with the code only.\n\n" + CODE,
        "Add type hints to this function. Answer with the code only.\n\n" + CODE,
        "Translate the comments of this function to French. Answer with the code only.\n\n" + CODE,
        "Reformat this function with 2-space indentation. Answer with the code only.\n\n" + CODE,
    ],
    "open-ended": [
        "Write a short story about a lighthouse keeper.",
        "What are the pros and cons of remote work?",
        "Explain how a bicycle stays upright.",
        "Give me ideas for a birthday party.",
    ],
}


def run_one(eng: Engine, prompt: str, max_tokens: int) -> tuple[list[int], float, float]:
    """-> (ids, end-to-end seconds, decode seconds after the first token)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    ids = eng.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    start = time.perf_counter()
    first = None
    out: list[int] = []
    for event in eng.stream(ids, params):
        if event.token_ids and first is None:
            first = time.perf_counter()
        out.extend(event.token_ids)
    end = time.perf_counter()
    return out, end - start, end - (first or end)


def bench_proposer(k: int, context: int = 8192, num_steps: int = 2000) -> dict:
    """Per-proposal cost at ``context`` ids (random ids of a 150k vocabulary, the second half a
    copy of the first, so most suffixes are found)."""
    rng = np.random.default_rng(0)
    half = rng.integers(0, 150_000, context // 2 + num_steps)
    ids = np.concatenate([half, half]).astype(np.int32)
    start_at = context - num_steps
    index = NgramIndex(k, 2, 4)
    t0 = time.perf_counter()
    index.propose(ids[:start_at])
    cold = time.perf_counter() - t0
    times, num_found = [], 0
    for n in range(start_at + 1, context + 1):
        view = ids[:n]
        t0 = time.perf_counter_ns()
        found = index.propose(view)
        times.append(time.perf_counter_ns() - t0)
        num_found += bool(found)
    times_us = np.asarray(times) / 1e3
    return {"context": context, "k": k, "median_us": float(np.median(times_us)),
            "p99_us": float(np.percentile(times_us, 99)), "max_us": float(times_us.max()),
            "cold_build_ms": cold * 1e3, "cold_ids": start_at, "found_fraction": num_found / num_steps}


def main_proposer(k: int) -> None:
    load_before = os.getloadavg()
    result = bench_proposer(k)
    load_after = os.getloadavg()
    print_table(["context", "k", "median us", "p99 us", "max us", "cold build ms", "found"],
                [[result["context"], k, f"{result['median_us']:.2f}", f"{result['p99_us']:.2f}",
                  f"{result['max_us']:.1f}", f"{result['cold_build_ms']:.2f}", f"{result['found_fraction']:.2f}"]],
                title="n-gram proposer (cext/ngram.pyx): one id appended + propose, n = 4..2")
    print(f"load average before {load_before}, after {load_after} (shared machine, 2 cores)")
    path = write_json("speculative_proposer", {"environment": environment(), "result": result,
                                               "load_average_before": load_before, "load_average_after": load_after})
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None,
                        help="GGUF file or HF directory (default: the embedded model)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--proposer", action="store_true", help="only the proposer's micro-benchmark")
    args = parser.parse_args()
    if args.proposer:
        main_proposer(args.num_speculative_tokens)
        return
    load_before = os.getloadavg()
    plain = Engine.from_pretrained(args.model)
    fast = Engine.from_pretrained(args.model, speculative="ngram",
                                  num_speculative_tokens=args.num_speculative_tokens)
    rows, results = [], {}
    try:
        run_one(plain, "Hello", 8), run_one(fast, "Hello", 8)  # warm-up
        for task, prompts in TASKS.items():
            e2e = {"plain": [], "ngram": []}
            dec = {"plain": [], "ngram": []}
            before = fast.stats()
            num_tokens, mismatches = 0, 0
            for _ in range(args.repeats):
                for prompt in prompts:  # interleaved, prompt by prompt
                    a, a_e2e, a_dec = run_one(plain, prompt, args.max_tokens)
                    b, b_e2e, b_dec = run_one(fast, prompt, args.max_tokens)
                    mismatches += a != b
                    num_tokens += len(a)
                    e2e["plain"].append(len(a) / a_e2e)
                    e2e["ngram"].append(len(b) / b_e2e)
                    if len(a) > 1:
                        dec["plain"].append((len(a) - 1) / a_dec)
                        dec["ngram"].append((len(b) - 1) / b_dec)
            after = fast.stats()
            drafts = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
            accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            proposals = fast._core.spec.num_proposals
            stats = {name: {m: summarize(v[m]) for m in v} for name, v in (("e2e", e2e), ("decode", dec))}
            ratio_e2e = [b / a for a, b in zip(e2e["plain"], e2e["ngram"])]
            ratio_dec = [b / a for a, b in zip(dec["plain"], dec["ngram"])]
            results[task] = {
                "tok_s": stats, "ratio_e2e": summarize(ratio_e2e), "ratio_decode": summarize(ratio_dec),
                "acceptance_rate": accepted / drafts if drafts else 0.0, "draft_tokens": drafts,
                "accepted_tokens": accepted, "mismatches": mismatches,
                "mean_tokens": num_tokens / len(e2e["plain"]),
            }
            rows.append([
                task, fmt_stats(stats["e2e"]["plain"]), fmt_stats(stats["e2e"]["ngram"]),
                fmt_stats(summarize(ratio_e2e), ".2f"), fmt_stats(stats["decode"]["plain"]),
                fmt_stats(stats["decode"]["ngram"]), fmt_stats(summarize(ratio_dec), ".2f"),
                f"{results[task]['acceptance_rate']:.2f}", f"{drafts}/{accepted}", mismatches,
            ])
            results[task]["cumulative_proposals"] = proposals
    finally:
        plain.close()
        fast.close()
    load_after = os.getloadavg()
    print_table(
        ["task", "e2e plain tok/s", "e2e ngram tok/s", "e2e ratio", "decode plain tok/s",
         "decode ngram tok/s", "decode ratio", "accept rate", "draft/accepted", "mismatches"],
        rows,
        title=f"one stream, greedy, max_tokens={args.max_tokens}, k={args.num_speculative_tokens}, "
              f"{args.repeats} repeats x 4 prompts, interleaved; medians (min-max)",
    )
    print(f"load average before {load_before}, after {load_after}: the machine is shared by several "
          "engineers (2 cores); figures are indicative only")
    spec_proposals = [results[t]["cumulative_proposals"] for t in TASKS]
    for task, prev, cur in zip(TASKS, [0] + spec_proposals[:-1], spec_proposals):
        accepted = results[task]["accepted_tokens"]
        n = cur - prev
        results[task]["proposals"] = n
        results[task]["mean_accepted_per_proposal"] = accepted / n if n else 0.0
        mean = results[task]["mean_accepted_per_proposal"]
        print(f"{task}: {n} proposals, mean accepted length {mean:.2f} "
              f"of up to {args.num_speculative_tokens}")
    path = write_json("speculative", {"args": vars(args), "environment": environment(),
                                      "load_average_before": load_before, "load_average_after": load_after,
                                      "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
