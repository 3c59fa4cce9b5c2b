"""Host cost per token of the sampler: all options off, penalties + logit_bias + min_p on, and n=4.

Three sections, each at batch 1 and 32 (requests), configurations interleaved in every repeat:
  sampler    ``engine.sampling.sampler.sample`` (the cext.sampler kernel) alone on [rows, V] logits
             (V = SmolLM2's 49152), plus the per-token ``LogitsAdjuster.add``; the logits copy is
             outside the timed region. The adjusters carry a 256-token prompt and 128 generated
             tokens of history.
  reference  the same work through the NumPy path (``logits_process.adjust`` for the batch, then
             per row ``sampling_reference``: argmax, or float64 softmax, masks and the CDF draw):
             what the kernel replaced, for the ratio (steps / 8: it is slow).
  Both also as CPU time of the calling thread (``time.thread_time``): on a shared, busy host the
  wall clock counts time the thread spent descheduled.
  engine     ``Engine.generate`` over ScriptedModel (no model compute): wall time per generated
             token of the whole host path (schedule, forward double, sample, detokenize, events).
Configurations: greedy and random (temperature 0.8), each plain and "all on" (presence 0.5,
frequency 0.5, repetition 1.1, 16 logit_bias entries, min_p 0.05); n=4 (random, plain: 4 rows
per request). Target (issue 12): all on <= 2x plain per token and < 20 us per token at batch 32.

Usage: ``python benchmarks/sampling.py [--repeats 5] [--steps 64] [--vocab 49152]``.
Prints tables and writes benchmarks/results/sampling.json.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json  # noqa: E402
from engine.params import SamplingParams  # noqa: E402
from engine.sampling.logits_process import LogitsAdjuster, adjust  # noqa: E402
from engine.sampling.sampler import random_stream, sample  # noqa: E402
from tests import sampling_reference  # noqa: E402

BATCH_SIZES = (1, 32)
ALL_ON = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, min_p=0.05,
              logit_bias={i * 97: (-1) ** i * 5.0 for i in range(16)})
CONFIGS = {
    "greedy plain": (dict(temperature=0), 1),
    "greedy all-on": (dict(temperature=0, **ALL_ON), 1),
    "random plain": (dict(temperature=0.8), 1),
    "random all-on": (dict(temperature=0.8, **ALL_ON), 1),
    "n=4 random": (dict(temperature=0.8), 4),
}


def reference_sample(logits: torch.Tensor, params, generators, adjusters) -> list[int]:
    """The NumPy path: adjust the batch, then one row at a time (argmax or the reference draw)."""
    array = logits.numpy()  # [rows, V]
    if adjusters is not None:
        adjust(array, adjusters)
    token_ids = array.argmax(axis=1).tolist()
    for row, (p, g) in enumerate(zip(params, generators)):
        if not p.is_greedy:
            token_ids[row] = sampling_reference.sample_row(array[row], p, g.random())
    return token_ids


def sampler_us_per_token(options: dict, n: int, batch: int, steps: int, vocab: int, rng,
                         is_reference: bool = False) -> tuple[float, float]:
    """(wall, CPU) microseconds per token; CPU time (this thread's) is less at the mercy of a busy host."""
    rows = batch * n
    params = [SamplingParams(max_tokens=4096, seed=i, **options) for i in range(rows)]
    generators = [random_stream(i) if not p.is_greedy else None for i, p in enumerate(params)]
    prompt = rng.integers(0, vocab, 256).tolist()
    adjusters = [LogitsAdjuster.for_request(p, prompt, {0}, 4096) for p in params]
    for a in adjusters:
        if a is not None:
            for t in rng.integers(0, vocab, 128).tolist():
                a.add(t)
    batch_adjusters = adjusters if any(a is not None for a in adjusters) else None
    base = torch.from_numpy(rng.standard_normal((rows, vocab), dtype=np.float32) * 4)  # [rows, V]
    total = total_cpu = 0.0
    for _ in range(steps):
        logits = base.clone()
        start, start_cpu = time.perf_counter(), time.thread_time()
        if is_reference:
            token_ids = reference_sample(logits, params, generators, batch_adjusters)
        else:
            token_ids, _ = sample(logits, params, generators, batch_adjusters)
        if batch_adjusters is not None:
            for a, t in zip(adjusters, token_ids):
                a.add(t)
        total += time.perf_counter() - start
        total_cpu += time.thread_time() - start_cpu
    return total / (steps * rows) * 1e6, total_cpu / (steps * rows) * 1e6


def engine_us_per_token(eng, options: dict, n: int, batch: int, steps: int) -> float:
    params = SamplingParams(max_tokens=steps, ignore_eos=True, seed=1, n=n, **options)
    prompts = [[1 + (i * 7 + j) % 500 for j in range(32)] for i in range(batch)]
    start = time.perf_counter()
    done = eng.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed / sum(len(c.token_ids) for c in done) * 1e6


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=49152)
    args = parser.parse_args(argv)
    torch.set_grad_enabled(False)
    rng = np.random.default_rng(0)

    import engine
    from engine.loader import default_model_path
    from engine.testing import ScriptedModel

    tok = engine.load_tokenizer(default_model_path())
    script = [random.Random(0).randrange(1000, tok.vocab_size) for _ in range(args.steps)]
    eng = engine.Engine(ScriptedModel(script, tok.vocab_size), tok, max_model_len=1024, max_num_seqs=128,
                        kv_cache_tokens=128 * 256, speculative=None)
    sections = ("sampler", "sampler CPU", "reference", "reference CPU", "engine")
    load_before = environment()["load_average"]
    results = {s: {c: {b: [] for b in BATCH_SIZES} for c in CONFIGS} for s in sections}
    try:
        engine_us_per_token(eng, {}, 1, 1, 4)  # warm-up
        for _ in range(args.repeats):
            for batch in BATCH_SIZES:
                for name, (options, n) in CONFIGS.items():  # interleaved: every config in every repeat
                    for section, is_reference, steps in (("sampler", False, args.steps),
                                                         ("reference", True, max(4, args.steps // 8))):
                        wall, cpu = sampler_us_per_token(options, n, batch, steps, args.vocab, rng, is_reference)
                        results[section][name][batch].append(wall)
                        results[f"{section} CPU"][name][batch].append(cpu)
                    results["engine"][name][batch].append(engine_us_per_token(eng, options, n, batch, args.steps))
    finally:
        eng.close()

    summary = {}
    for section in sections:
        rows = []
        for name in CONFIGS:
            cells = [name]
            for batch in BATCH_SIZES:
                stats = summarize(results[section][name][batch])
                plain = summarize(results[section]["greedy plain" if name.startswith("greedy")
                                                   else "random plain"][batch])
                summary.setdefault(section, {}).setdefault(name, {})[batch] = {
                    **stats, "ratio_to_plain": stats["median"] / plain["median"]}
                cells += [fmt_stats(stats, ".2f"), f"{stats['median'] / plain['median']:.2f}x"]
            rows.append(cells)
        headers = ["config"] + [h for b in BATCH_SIZES for h in (f"us/token b={b}", f"vs plain b={b}")]
        clock = "CPU (this thread)" if section.endswith("CPU") else "wall"
        print_table(headers, rows, title=f"{section}: host microseconds per token ({clock}), median (min-max) "
                                         f"over {args.repeats} repeats; ratio to the plain config of its kind")

    def speedup(c: str, name: str, b: int) -> float:
        reference, kernel = (summarize(results[f"{kind}{c}"][name][b])["median"] for kind in ("reference", "sampler"))
        return reference / kernel

    ratios = [[name] + [f"{speedup(c, name, b):.1f}x" for c in ("", " CPU") for b in BATCH_SIZES] for name in CONFIGS]
    print_table(["config"] + [f"reference / kernel b={b}{c}" for c in ("", " CPU") for b in BATCH_SIZES], ratios,
                title="speed-up of the kernel over the NumPy path (medians)")
    env = environment()
    print("load average before:", load_before, "after:", env["load_average"])
    path = write_json("sampling", {"args": vars(args), "environment": env, "load_average_before": load_before,
                                   "results": summary,
                                   "raw": results})
    print("wrote", path)


if __name__ == "__main__":
    main()
