"""Embeddings, side by side in one run: throughput against sentence-transformers and
llama-cpp-python, an embedding's latency beside generation, generation beside embeddings.

Texts: ``--num-texts`` (default 2,000) of mixed length, 10-250 WordPiece tokens (words drawn
from a fixed list; lengths uniform), the same texts for every configuration.

Parts (``--parts``, default all):
- ``throughput``: all-MiniLM-L6-v2. Ours (``--dtypes``: float32, bfloat16) at batch sizes 1 (one
  ``embed`` call per text), 32 and all (one call); sentence-transformers 6.x ``encode`` at batch
  size 1 and ``--st-batch-sizes``; llama-cpp-python ``Llama.embed`` on the GGUF llama.cpp's own
  convert_hf_to_gguf.py writes (f32) at 1, 32 and all (when ``llama_cpp`` imports), and ours on
  that GGUF too. Interleaved repetition by repetition; ratios to each library's best median.
- ``latency``: the default model (SmolLM2-135M, pooled with mean): p50/p99 of a single-text
  ``embed`` while 4 greedy generation streams run, and with nothing else running.
- ``beside``: the default model: one greedy stream's tok/s alone and beside a 2,000-text
  ``embed`` call (its rows share the stream's ticks, engine/embedding/tick_rows.py), interleaved;
  the job is cancelled when the stream ends.
Every forward runs on a worker thread (benchmarks.common.on_own_thread; ours: the engine thread).
The host is shared with other engineers' jobs: the absolute numbers move with the load (printed
beside every figure); the ratios of one interleaved run are what to compare.

    .venv/bin/python benchmarks/embeddings.py [--num-texts 2000] [--reps 1] [--parts throughput,latency,beside]

Never asserts on time; writes benchmarks/results/embeddings.json and prints the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
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


def load() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def minilm_gguf(directory: Path) -> Path:
    """all-MiniLM-L6-v2 converted by llama.cpp's convert_hf_to_gguf.py from the pinned sdist (cached)."""
    from family_fixtures import convert_to_gguf, extract_converter

    out = REPO / ".cache" / "bench" / "all-MiniLM-L6-v2-f32.gguf"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        convert_to_gguf(extract_converter(directory), minilm_path(), out, "f32")
    return out


def throughput(args, texts: list[str], num_tokens: int) -> dict:
    from sentence_transformers import SentenceTransformer

    import engine

    path = minilm_path()
    configs = {}
    engines = []
    for dtype in args.dtypes.split(","):
        eng = engine.Engine.from_pretrained(path, dtype=dtype)
        engines.append(eng)
        eng.embed(texts[:64])  # warm-up (oneDNN primitives, allocator)
        for size, label in ((1, "1"), (32, "32"), (len(texts), "all")):
            configs[f"ours {dtype}, batch {label}"] = batched(eng.embed, texts, size)
    if args.st_batch_sizes != "none":
        st = SentenceTransformer(str(path), device="cpu")
        st.encode(texts[:64], batch_size=32)
        for size in [1, *[int(s) for s in args.st_batch_sizes.split(",")]]:
            configs[f"sentence-transformers, batch {size}"] = lambda size=size: st.encode(texts, batch_size=size)
    llm = None
    try:
        import llama_cpp
    except ImportError:
        print("llama_cpp is not importable: llama-cpp-python's rows are left out", flush=True)
    else:
        gguf = minilm_gguf(Path(tempfile.mkdtemp()))
        llm = llama_cpp.Llama(model_path=str(gguf), embedding=True, n_ctx=8192, n_batch=8192, n_ubatch=8192,
                              n_threads=os.cpu_count(), verbose=False)
        llm.embed(texts[:64], normalize=True)
        for size, label in ((1, "1"), (32, "32"), (len(texts), "all")):
            configs[f"llama-cpp-python, batch {label}"] = batched(
                lambda b: llm.embed(b, normalize=True), texts, size)
        eng = engine.Engine.from_pretrained(gguf, dtype=args.dtypes.split(",")[-1])
        engines.append(eng)
        eng.embed(texts[:64])
        configs[f"ours {args.dtypes.split(',')[-1]} on the GGUF, batch all"] = batched(eng.embed, texts, len(texts))

    seconds: dict[str, list[float]] = {name: [] for name in configs}
    loads: dict[str, list[float]] = {name: [] for name in configs}
    for rep in range(args.reps):
        for name, fn in configs.items():
            start = time.perf_counter()
            on_own_thread(fn)
            seconds[name].append(time.perf_counter() - start)
            loads[name].append(os.getloadavg()[0])
            print(f"rep {rep + 1}/{args.reps} {name}: {len(texts) / seconds[name][-1]:.1f} texts/s "
                  f"(load {load()})", flush=True)
    for eng in engines:
        eng.close()
    if llm is not None:
        llm.close()
    rates = {name: summarize([len(texts) / s for s in values]) for name, values in seconds.items()}
    bests = {}
    for library in ("sentence-transformers", "llama-cpp-python"):
        names = [n for n in rates if n.startswith(library)]
        if names:
            bests[library] = max(names, key=lambda n: rates[n]["median"])
    rows = []
    for name, r in rates.items():
        ratios = [f"{r['median'] / rates[best]['median']:.2f}x" for best in bests.values()]
        rows.append([name, fmt_stats(r), *ratios, f"{min(loads[name]):.1f}-{max(loads[name]):.1f}"])
    print_table(["configuration", "texts/s median (min-max)", *[f"vs {b}" for b in bests.values()], "load"],
                rows, title=f"{len(texts)} texts, {num_tokens} tokens, {args.reps} interleaved reps")
    return {"texts_per_s": rates, "best": bests, "load_average_per_config": loads,
            "ratios": {lib: {n: r["median"] / rates[best]["median"] for n, r in rates.items()}
                       for lib, best in bests.items()}}


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def latency(args, texts: list[str], eng) -> dict:
    """p50/p99 of a single-text embed, alone and while 4 generation streams run."""
    import engine

    rng = random.Random(1)
    sample = [rng.choice(texts) for _ in range(args.num_latency)]
    params = engine.SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
    out = {}
    for label, num_streams in (("alone", 0), ("beside 4 streams", 4)):
        streams = [eng.stream(f"Story number {i}: once upon a time", params) for i in range(num_streams)]
        for s in streams:
            next(s)  # every stream is decoding before the first embedding
        drains = [threading.Thread(target=lambda s=s: [None for _ in s], daemon=True) for s in streams]
        for thread in drains:
            thread.start()
        times = []
        for text in sample:
            start = time.perf_counter()
            eng.embed(text)
            times.append(time.perf_counter() - start)
        for s in streams:
            eng.abort(s.request_id)
        for thread in drains:
            thread.join()
        out[label] = {"p50_ms": 1e3 * _percentile(times, 0.5), "p99_ms": 1e3 * _percentile(times, 0.99),
                      "num_requests": len(times), "load_average": os.getloadavg()[0]}
        print(f"latency {label}: p50 {out[label]['p50_ms']:.0f} ms, p99 {out[label]['p99_ms']:.0f} ms "
              f"(load {load()})", flush=True)
    return out


def beside(args, texts: list[str], eng) -> dict:
    """One stream's tok/s alone and beside a len(texts)-text embed call, interleaved."""
    import engine

    params = engine.SamplingParams(max_tokens=args.stream_tokens, temperature=0, ignore_eos=True)
    runs: dict[str, list[float]] = {"alone": [], "beside": []}
    embed_tokens: list[float] = []
    for rep in range(args.reps):
        for label in ("alone", "beside"):
            call = eng.submit_embed(texts, truncate=True) if label == "beside" else None
            before = eng.stats()["num_embedding_tokens"]
            stream = eng.stream("Once upon a time", params)
            next(stream)  # timed from the first token: the prompt's prefill is not the comparison
            start = time.perf_counter()
            num = sum(len(ev.token_ids) for ev in stream)
            elapsed = time.perf_counter() - start
            runs[label].append(num / elapsed)
            if call is not None:
                embed_tokens.append((eng.stats()["num_embedding_tokens"] - before) / elapsed)
                call.job.cancel()  # the rest of the job is dropped at the next tick
            print(f"rep {rep + 1}/{args.reps} stream {label}: {runs[label][-1]:.1f} tok/s (load {load()})",
                  flush=True)
    alone, with_embed = summarize(runs["alone"]), summarize(runs["beside"])
    return {"stream_tok_per_s": {"alone": alone, "beside": with_embed},
            "ratio": with_embed["median"] / alone["median"],
            "embedding_tokens_per_s_beside": summarize(embed_tokens), "load_average": os.getloadavg()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-texts", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--parts", default="throughput,latency,beside")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--st-batch-sizes", default="32", help="besides 1; none: no sentence-transformers rows")
    parser.add_argument("--num-latency", type=int, default=50, help="single-text requests per latency run")
    parser.add_argument("--stream-tokens", type=int, default=128)
    args = parser.parse_args()
    from tokenizers import Tokenizer

    import engine

    tokenizer = Tokenizer.from_file(str(minilm_path() / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    texts = make_texts(args.num_texts, tokenizer)
    num_tokens = sum(len(tokenizer.encode(t).ids) for t in texts)
    parts = args.parts.split(",")
    result = {"num_texts": len(texts), "num_tokens": num_tokens, "reps": args.reps,
              "load_average_before": os.getloadavg(), "environment": environment()}
    if "throughput" in parts:
        result["throughput"] = throughput(args, texts, num_tokens)
    if "latency" in parts or "beside" in parts:
        with engine.Engine.from_pretrained(pooling="mean") as eng:
            eng.embed(texts[:8])
            if "latency" in parts:
                result["latency"] = latency(args, texts, eng)
            if "beside" in parts:
                result["beside"] = beside(args, texts, eng)
                b = result["beside"]
                print(f"stream beside a {len(texts)}-text embed call: {b['ratio']:.2f}x its solo tok/s "
                      f"({b['stream_tok_per_s']['beside']['median']:.1f} vs "
                      f"{b['stream_tok_per_s']['alone']['median']:.1f}; load {load()})", flush=True)
    result["load_average_after"] = os.getloadavg()
    write_json("embeddings", result)
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
