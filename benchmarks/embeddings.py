"""Embedding throughput: Engine.embed against sentence-transformers' encode on all-MiniLM-L6-v2,
side by side in one process and one run, interleaved repetition by repetition.

Texts: ``--num-texts`` (default 2,000) of mixed length, 10-250 WordPiece tokens (words drawn
from a fixed list; lengths uniform), the same texts for every configuration. Configurations:
- ours float32 and bfloat16 (``dtype="bfloat16"``), batch sizes 1 (one ``embed`` call per
  text), 32 (a call per 32 texts) and all (one call with every text);
- sentence-transformers 6.x ``encode``: batch size 1 and ``--st-batch-sizes``; the ratios are to
  its best median of all of these.
Both sides run on a worker thread (benchmarks.common.on_own_thread; ours: the engine thread),
with the torch thread count the engine's policy sets for the process, which both share.
Reported: texts/s (median, min-max over ``--reps``), the ratios to sentence-transformers' best,
the load average before and after. The host is shared with other engineers' jobs: the absolute
numbers move with the load; the ratios of one interleaved run are what to compare.

    .venv/bin/python benchmarks/embeddings.py [--num-texts 2000] [--reps 3] [--st-batch-sizes 32,64,128]

Never asserts on time; writes benchmarks/results/embeddings.json and prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from embedding_fixtures import WORDS, minilm_path  # noqa: E402

from benchmarks.common import environment, fmt_stats, on_own_thread, print_table, summarize, write_json  # noqa: E402


def make_texts(num_texts: int, tokenizer, seed: int = 0) -> list[str]:
    """Texts of 10-250 tokens ([CLS] and [SEP] included), lengths uniform over that range."""
    rng = random.Random(seed)
    texts = []
    while len(texts) < num_texts:
        target = rng.randint(10, 250)
        words = [rng.choice(WORDS) for _ in range(target)]
        while len(words) > 1 and len(tokenizer.encode(" ".join(words)).ids) > target:
            words.pop()
        texts.append(" ".join(words))
    return texts


def batched(fn, texts: list[str], batch_size: int):
    def run():
        for start in range(0, len(texts), batch_size):
            fn(texts[start : start + batch_size])

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-texts", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--st-batch-sizes", default="32,64,128")
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    import engine

    path = minilm_path()
    load_before = os.getloadavg()
    ours = engine.Engine.from_pretrained(path)
    ours_bf16 = engine.Engine.from_pretrained(path, dtype="bfloat16")
    st = SentenceTransformer(str(path), device="cpu")
    texts = make_texts(args.num_texts, ours.tokenizer.backend)
    num_tokens = sum(len(ours.tokenizer.backend.encode(t).ids) for t in texts)
    st_sizes = [int(s) for s in args.st_batch_sizes.split(",")]

    configs = {}
    for name, eng in (("ours float32", ours), ("ours bfloat16", ours_bf16)):
        configs[f"{name} batch 1"] = batched(eng.embed, texts, 1)
        configs[f"{name} batch 32"] = batched(eng.embed, texts, 32)
        configs[f"{name} batch all"] = batched(eng.embed, texts, len(texts))
    configs["sentence-transformers batch 1"] = batched(lambda b: st.encode(b, batch_size=1), texts, 1)
    for size in st_sizes:
        configs[f"sentence-transformers batch {size}"] = lambda size=size: st.encode(texts, batch_size=size)

    ours.embed(texts[:64])  # warm-up (oneDNN primitives, allocator)
    ours_bf16.embed(texts[:64])
    st.encode(texts[:64], batch_size=32)

    seconds: dict[str, list[float]] = {name: [] for name in configs}
    for rep in range(args.reps):
        for name, fn in configs.items():
            start = time.perf_counter()
            on_own_thread(fn)
            seconds[name].append(time.perf_counter() - start)
            print(f"rep {rep + 1}/{args.reps} {name}: {len(texts) / seconds[name][-1]:.1f} texts/s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    rates = {name: summarize([len(texts) / s for s in values]) for name, values in seconds.items()}
    st_names = [n for n in rates if n.startswith("sentence-transformers")]
    best_st = max(st_names, key=lambda n: rates[n]["median"])
    base = rates[best_st]["median"]
    rows = [[name, fmt_stats(r), f"{r['median'] / base:.2f}x"] for name, r in rates.items()]
    load_after = os.getloadavg()
    print_table(["configuration", "texts/s median (min-max)", f"vs {best_st}"], rows,
                title=f"{len(texts)} texts, {num_tokens} tokens, {args.reps} interleaved reps; "
                      f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after "
                      "(2 vCPUs shared by ~7 engineers' jobs)")
    result = {"num_texts": len(texts), "num_tokens": num_tokens, "reps": args.reps, "best_st": best_st,
              "texts_per_s": rates, "ratio_to_best_st": {n: r["median"] / base for n, r in rates.items()},
              "load_average_before": load_before, "load_average_after": load_after,
              "environment": environment()}
    write_json("embeddings", result)
    print(json.dumps(result, indent=2, default=str))
    ours.close()
    ours_bf16.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
