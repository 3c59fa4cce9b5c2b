"""Speculative decoding side by side in one run: one stream, and N concurrent streams.

Variants on the same model and prompts, greedy: ``plain`` (no speculation), ``ngram``
(speculative="ngram"), ``draft`` (speculative="draft" with ``--draft-model``), and with
``--llama-cpp`` llama-cpp-python's plain ``Llama.generate`` and the same with
``LlamaPromptLookupDecoding(num_pred_tokens=k)`` (its prompt lookup), over the same prompt ids.
One stream: one request at a time, end to end (prefill included) and decode-only (tok/s after
the first token, from the stream's event times), the variants interleaved prompt by prompt.
``--streams N``: N requests at once through ``Engine.generate`` (the task's prompts repeated),
aggregate tok/s, variants interleaved (llama-cpp-python runs one sequence: no row). Tasks:
code editing (rename a variable, add type hints, translate comments, reformat: the output
mostly copies the prompt) and open-ended chat. Medians with min-max; ratios against plain per
prompt. Per task and variant the acceptance rate and the mean accepted length per proposal
(accepted / proposals) come from the engine's counters. Our variants' outputs are checked equal
token for token. ``--fixed-k`` adds the variant ``ngram fixed k``: the same engine with every
proposal allowed k ids (adaptive k off), to compare the two policies in one run; ``--also-k K2``
adds ``ngram k=K2``, prompt lookup with another ceiling; ``--no-budget`` adds ``ngram no budget``:
every proposed id within MAX_VERIFY_ROWS verified (the verify budget off,
engine.core.speculative.SpecDecoder.verify_budget).

The machine is shared (several engineers, 2 cores): the load average is printed and recorded,
and the figures are indicative only.

``--proposer``: only the n-gram proposer's micro-benchmark (cext/ngram.pyx): the cost of one
proposal at an 8k-token context as a decode sees it (one id appended, then propose), median and
p99 over 2,000 steps, and the cold build of the index over the whole context.

Usage: ``python benchmarks/speculative.py [--model PATH] [--draft-model PATH] [--llama-cpp]
[--streams 16] [--max-tokens 128] [--repeats 3] [-k 4] [--also-k 8] [--fixed-k] [--proposer]``. Writes
benchmarks/results/speculative.json (speculative_proposer.json).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json
from cext.ngram import NgramIndex
from engine import Engine, SamplingParams
from engine.config import ACTIVATIONS
from engine.tokenizer.chat_template import ChatTemplateError

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


def chat_ids(eng: Engine, prompt: str) -> list[int]:
    """The prompt as a user message in the model's chat template; a base model without one (Gemma 3
    270M) gets the text followed by a blank line."""
    try:
        return eng.tokenizer.encode_chat([{"role": "user", "content": prompt}])
    except ChatTemplateError:
        return eng.tokenizer.encode(prompt + "\n\n")


def run_one(eng: Engine, ids: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """-> (ids, end-to-end seconds, decode seconds after the first token)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    start = time.perf_counter()
    first = None
    out: list[int] = []
    for event in eng.stream(ids, params):
        if event.token_ids and first is None:
            first = time.perf_counter()
        out.extend(event.token_ids)
    end = time.perf_counter()
    return out, end - start, end - (first or end)


def run_streams(eng: Engine, ids: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    """All prompts at once -> (ids per prompt, wall seconds)."""
    start = time.perf_counter()
    done = eng.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0))
    return [c.token_ids for c in done], time.perf_counter() - start


class LlamaCpp:
    """llama-cpp-python over the same GGUF, greedy, our prompt ids; ``lookup`` = its prompt lookup."""

    def __init__(self, path: str, k: int, lookup: bool, eos_ids: list[int]):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if lookup else None
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=4096, n_threads=os.cpu_count(), draft_model=draft,
                                   verbose=False)
        self.eos_ids = set(eos_ids)

    def run_one(self, ids: list[int], max_tokens: int) -> tuple[list[int], float, float]:
        start = time.perf_counter()
        first = None
        out: list[int] = []
        for token in self.llm.generate(ids, temp=0.0, reset=True):
            if first is None:
                first = time.perf_counter()
            if token in self.eos_ids:
                break
            out.append(token)
            if len(out) >= max_tokens:
                break
        end = time.perf_counter()
        return out, end - start, end - (first or end)


def spec_counters(eng) -> tuple[int, int, int, int, int]:
    """(draft tokens, accepted tokens, proposals, the draft model's share of the draft tokens and
    of the accepted ones) so far; zeros without speculation."""
    spec = eng._core.spec
    if spec is None:
        return 0, 0, 0, 0, 0
    return (spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_proposals, spec.num_model_draft_tokens,
            spec.num_model_accepted_tokens)


def acceptance(before, after) -> dict:
    drafts, accepted, proposals, model_drafts, model_accepted = (b - a for a, b in zip(before, after))
    return {"draft_tokens": drafts, "accepted_tokens": accepted, "proposals": proposals,
            "acceptance_rate": accepted / drafts if drafts else 0.0,
            "mean_accepted_length": accepted / proposals if proposals else 0.0,
            "draft_model_tokens": model_drafts,  # of draft_tokens, those the draft model proposed
            "draft_model_acceptance_rate": model_accepted / model_drafts if model_drafts else 0.0}


def bench_one_stream(variants: dict, prompts: list[list[int]], max_tokens: int, repeats: int) -> dict:
    e2e = {name: [] for name in variants}
    dec = {name: [] for name in variants}
    before = {name: spec_counters(v) for name, v in variants.items() if isinstance(v, Engine)}
    mismatches = 0
    names = list(variants)
    for _ in range(repeats):
        for i, ids in enumerate(prompts):  # interleaved, prompt by prompt, each variant first in turn
            outs = {}
            for name in names[i % len(names):] + names[:i % len(names)]:
                v = variants[name]
                out, t_e2e, t_dec = v.run_one(ids, max_tokens) if not isinstance(v, Engine) else \
                    run_one(v, ids, max_tokens)
                outs[name] = out
                e2e[name].append(len(out) / t_e2e)
                dec[name].append((len(out) - 1) / t_dec if len(out) > 1 and t_dec > 0 else 0.0)
            mismatches += sum(outs[n] != outs["plain"] for n in before if variants[n]._core.spec is not None)
    result = {"mismatches": mismatches}
    for name in variants:
        result[name] = {"e2e_tok_s": summarize(e2e[name]), "decode_tok_s": summarize(dec[name]),
                        "ratio_e2e": summarize([b / a for a, b in zip(e2e["plain"], e2e[name])]),
                        "ratio_decode": summarize([b / a for a, b in zip(dec["plain"], dec[name]) if a > 0])}
        if name in before:
            result[name].update(acceptance(before[name], spec_counters(variants[name])))
    return result


def bench_streams(engines: dict, prompts: list[list[int]], num_streams: int, max_tokens: int,
                  repeats: int) -> dict:
    ids = [prompts[i % len(prompts)] for i in range(num_streams)]
    rates = {name: [] for name in engines}
    before = {name: spec_counters(e) for name, e in engines.items()}
    mismatches = 0
    names = list(engines)
    for r in range(repeats):
        outs = {}
        for name in names[r % len(names):] + names[:r % len(names)]:  # each engine first in turn
            eng = engines[name]
            outs[name], seconds = run_streams(eng, ids, max_tokens)
            rates[name].append(sum(len(o) for o in outs[name]) / seconds)
        mismatches += sum(outs[n] != outs["plain"] for n in engines if engines[n]._core.spec is not None)
    result = {"mismatches": mismatches, "num_streams": num_streams}
    for name in engines:
        result[name] = {"aggregate_tok_s": summarize(rates[name]),
                        "ratio": summarize([b / a for a, b in zip(rates["plain"], rates[name])]),
                        **acceptance(before[name], spec_counters(engines[name]))}
    return result


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
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model)")
    parser.add_argument("--draft-model", default=None, help="adds the variant speculative='draft' with this draft")
    parser.add_argument("--llama-cpp", action="store_true", help="adds llama-cpp-python plain and prompt lookup")
    parser.add_argument("--streams", type=int, default=0, help="also N concurrent streams (0: not run)")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: " + ", ".join(TASKS))
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--proposer", action="store_true", help="only the proposer's micro-benchmark")
    parser.add_argument("--also-k", type=int, default=0,
                        help="adds the variant 'ngram k=K2': speculative='ngram' with this ceiling too")
    parser.add_argument("--fixed-k", action="store_true",
                        help="adds the variant 'ngram fixed k': every proposal may have k ids (no adaptive k)")
    parser.add_argument("--no-budget", action="store_true",
                        help="adds the variant 'ngram no budget': every proposed id verified (no verify budget)")
    parser.add_argument("--activations", default="int16", choices=ACTIVATIONS,
                        help="every engine's activation codes; int8 adds the variant 'plain int16' (the default "
                             "engine) to show what the codes alone give")
    args = parser.parse_args()
    if args.proposer:
        main_proposer(args.num_speculative_tokens)
        return
    k = args.num_speculative_tokens
    load_before = os.getloadavg()
    common = {"activations": args.activations}
    engines = {"plain": Engine.from_pretrained(args.model, speculative=None, **common),
               "ngram": Engine.from_pretrained(args.model, speculative="ngram", num_speculative_tokens=k, **common)}
    if args.activations != "int16":
        engines["plain int16"] = Engine.from_pretrained(args.model, speculative=None)
    if args.also_k:
        engines[f"ngram k={args.also_k}"] = Engine.from_pretrained(args.model, speculative="ngram",
                                                                   num_speculative_tokens=args.also_k, **common)
    if args.fixed_k:
        engines["ngram fixed k"] = Engine.from_pretrained(args.model, speculative="ngram", num_speculative_tokens=k,
                                                          **common)
        engines["ngram fixed k"]._core.spec.adaptive = False
    if args.no_budget:
        engines["ngram no budget"] = Engine.from_pretrained(args.model, speculative="ngram", num_speculative_tokens=k,
                                                            **common)
        engines["ngram no budget"]._core.spec.budgeted = False
    if args.draft_model:
        engines["draft"] = Engine.from_pretrained(args.model, speculative="draft", draft_model=args.draft_model,
                                                  num_speculative_tokens=k, **common)
    variants = dict(engines)
    if args.llama_cpp:
        path = engines["plain"].model_path
        eos = list(engines["plain"].tokenizer.eos_token_ids)
        variants["llama.cpp"] = LlamaCpp(path, k, False, eos)
        variants["llama.cpp lookup"] = LlamaCpp(path, k, True, eos)
    results, rows, stream_rows = {}, [], []
    try:
        for v in variants.values():  # warm-up
            hello = chat_ids(engines["plain"], "Hello")
            v.run_one(hello, 8) if not isinstance(v, Engine) else run_one(v, hello, 8)
        for task in args.tasks.split(","):
            prompts = [chat_ids(engines["plain"], p) for p in TASKS[task]]
            one = bench_one_stream(variants, prompts, args.max_tokens, args.repeats)
            results[task] = {"one_stream": one}
            for name in variants:
                r = one[name]
                rows.append([task, name, fmt_stats(r["e2e_tok_s"]), fmt_stats(r["ratio_e2e"], ".2f"),
                             fmt_stats(r["decode_tok_s"]), fmt_stats(r["ratio_decode"], ".2f"),
                             f"{r['acceptance_rate']:.2f}" if "acceptance_rate" in r else "-",
                             f"{r['mean_accepted_length']:.2f}" if "acceptance_rate" in r else "-",
                             f"{r['draft_model_tokens']} ({r['draft_model_acceptance_rate']:.2f})"
                             if r.get("draft_model_tokens") else "-"])
            if args.streams:
                many = bench_streams(engines, prompts, args.streams, args.max_tokens, args.repeats)
                results[task]["streams"] = many
                for name in engines:
                    r = many[name]
                    stream_rows.append([task, name, fmt_stats(r["aggregate_tok_s"]), fmt_stats(r["ratio"], ".2f"),
                                        f"{r['acceptance_rate']:.2f}", f"{r['mean_accepted_length']:.2f}"])
            print(f"{task}: {json.dumps(results[task])}\nload average {os.getloadavg()}", flush=True)
    finally:
        for eng in engines.values():
            eng.close()
    load_after = os.getloadavg()
    print_table(["task", "variant", "e2e tok/s", "e2e ratio", "decode tok/s", "decode ratio", "accept rate",
                 "mean accepted", "draft model ids (accept)"], rows,
                title=f"one stream, greedy, max_tokens={args.max_tokens}, k={k}, {args.repeats} repeats x 4 "
                      "prompts, interleaved; medians (min-max); ratios against plain per prompt; the draft "
                      "variant's proposals come from prompt lookup first, from the draft model where it finds none")
    if stream_rows:
        print_table(["task", "variant", "aggregate tok/s", "ratio", "accept rate", "mean accepted"], stream_rows,
                    title=f"{args.streams} concurrent streams, greedy, max_tokens={args.max_tokens}, "
                          f"{args.repeats} repeats, interleaved; medians (min-max)")
    print("mismatches against plain: " + ", ".join(
        f"{t}: {r['one_stream']['mismatches']}" + (f" / {r['streams']['mismatches']}" if "streams" in r else "")
        for t, r in results.items()))
    print(f"load average before {load_before}, after {load_after}: the machine is shared by several "
          "engineers (2 cores); figures are indicative only")
    path = write_json("speculative", {"args": vars(args), "environment": environment(),
                                      "load_average_before": load_before, "load_average_after": load_after,
                                      "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
