"""Per-token cost of incremental detokenization, early vs late in a long output.

8,192 tokens of real mixed text (Korean, CJK, emoji, English, code), detokenized one id at
a time by three methods side by side in one run:

- ``add``: engine.detokenizer.IncrementalDetokenizer.add
- ``decode_stream``: tokenizers.decoders.DecodeStream.step (tokenizers' own streaming decoder)
- ``redecode``: decode(ids[:k]) per token, releasing the new suffix (the naive way)

For each method the ns/token of tokens 0-512 ("early") and 7,680-8,192 ("late") is timed as
a block per repetition, right after a warm-up pass over the first block with a throwaway
instance (so "early" measures position in the stream, not a cold CPU); the table shows medians
with min-max, late/early, and the speed-up of ``add`` over each baseline.
Usage: ``python benchmarks/detok.py [--reps 15] [--vocab smollm2]``.
Never asserts on time; writes JSON to benchmarks/results/detok.json and stdout.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from tokenizers.decoders import DecodeStream

from engine.detokenizer import IncrementalDetokenizer
from tests import vocabs

REPO = Path(__file__).resolve().parents[1]
NUM_TOKENS = 8192
BLOCK = 512
EARLY = (0, BLOCK)
LATE = (NUM_TOKENS - BLOCK, NUM_TOKENS)

# Paragraphs of real text, rotated so the 8,192 tokens are not one short loop.
PARAGRAPHS = [
    "대한민국의 수도는 서울이며, 한국어는 한글로 적습니다. 오늘은 날씨가 맑고 바람이 시원합니다.\n",
    "北京是中国的首都，上海是最大的城市。東京は日本の首都で、桜の季節はとても美しいです。\n",
    "Emoji: 👨‍👩‍👧‍👦 family, 🇰🇷🇯🇵🇨🇳🇺🇸 flags, 👍🏽 thumbs, ❤️‍🔥 heart on fire, 🏳️‍🌈 and 🧑🏿‍🚀.\n",
    "The quick brown fox jumps over the lazy dog while the engine streams tokens one at a time.\n",
    "def detokenize(ids: list[int]) -> str:\n    return ''.join(d.add(i) for i in ids) + d.finish()\n",
    "Combining marks: e\u0301, a\u0308, n\u0303; Ελληνικά, русский язык, עברית, العربية, हिन्दी.\n",
]


def mixed_ids(tok) -> list[int]:
    backend = getattr(tok, "backend", tok)
    ids: list[int] = []
    k = 0
    while len(ids) < NUM_TOKENS:
        text = "".join(PARAGRAPHS[(k + j) % len(PARAGRAPHS)] for j in range(len(PARAGRAPHS)))
        ids.extend(backend.encode(f"[{k}] " + text, add_special_tokens=False).ids)
        k += 1
    return ids[:NUM_TOKENS]


def run_add(tok, ids, blocks):
    add = IncrementalDetokenizer(tok).add
    return _timed(ids, blocks, add)


def run_decode_stream(tok, ids, blocks):
    backend = getattr(tok, "backend", tok)
    stream = DecodeStream(skip_special_tokens=True)
    step = stream.step
    return _timed(ids, blocks, lambda i: step(backend, i))


def run_redecode(tok, ids, blocks):
    backend = getattr(tok, "backend", tok)
    decode = backend.decode
    state = {"ids": [], "num_chars": 0}

    def add(token_id):
        state["ids"].append(token_id)
        text = decode(state["ids"])
        new = text[state["num_chars"]:]
        state["num_chars"] = len(text)
        return new

    return _timed(ids, blocks, add)


def _timed(ids, blocks, add):
    """ns/token per block; the tokens between blocks run untimed so the state is real."""
    results, pos = [], 0
    for start, end in blocks:
        for token_id in ids[pos:start]:
            add(token_id)
        chunk = ids[start:end]
        t0 = time.perf_counter_ns()
        for token_id in chunk:
            add(token_id)
        results.append((time.perf_counter_ns() - t0) / len(chunk))
        pos = end
    return results


METHODS = {"add": (run_add, 1.0), "decode_stream": (run_decode_stream, 1.0), "redecode": (run_redecode, 0.2)}


def load(name):
    if name == "smollm2":
        from engine.tokenizer import load_tokenizer

        return load_tokenizer(str(vocabs.SMOLLM2_GGUF))
    return getattr(vocabs, name)()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--vocab", action="append", help="smollm2 (default), qwen, llama_spm")
    args = parser.parse_args()
    report = {"num_tokens": NUM_TOKENS, "early": EARLY, "late": LATE, "reps": args.reps, "vocabs": {}}
    for name in args.vocab or ["smollm2", "qwen", "llama_spm"]:
        tok = load(name)
        ids = mixed_ids(tok)
        samples = {m: ([], []) for m in METHODS}
        for rep in range(args.reps):
            for method, (fn, rep_share) in METHODS.items():  # interleaved: noise hits all alike
                if rep < max(3, int(args.reps * rep_share)):
                    fn(tok, ids, [(0, BLOCK)])  # warm-up on a throwaway instance: caches, branch predictors
                    early, late = fn(tok, ids, [EARLY, LATE])
                    samples[method][0].append(early)
                    samples[method][1].append(late)
        report["vocabs"][name] = {m: _summary(e, l) for m, (e, l) in samples.items()}
    print_table(report)
    out = REPO / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "detok.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report))


def _summary(early, late):
    ratios = [b / a for a, b in zip(early, late)]
    return {
        "early_ns": [statistics.median(early), min(early), max(early)],
        "late_ns": [statistics.median(late), min(late), max(late)],
        "late_over_early": statistics.median(ratios),
        "num_reps": len(early),
    }


def print_table(report) -> None:
    header = (f"{'vocab':<10} {'method':<14} {'early ns/tok (min-max)':>28} {'late ns/tok (min-max)':>30}"
              f" {'late/early':>10} {'add x faster (late)':>20}")
    print(header)
    print("-" * len(header))
    for name, methods in report["vocabs"].items():
        add_late = methods["add"]["late_ns"][0]
        for method, s in methods.items():
            e, l = s["early_ns"], s["late_ns"]
            speedup = "" if method == "add" else f"{l[0] / add_late:.1f}x"
            s["add_speedup_late"] = None if method == "add" else l[0] / add_late
            print(
                f"{name:<10} {method:<14} {e[0]:>10.0f} ({e[1]:>7.0f}-{e[2]:>7.0f})"
                f" {l[0]:>12.0f} ({l[1]:>7.0f}-{l[2]:>7.0f})"
                f" {s['late_over_early']:>10.3f} {speedup:>20}"
            )


if __name__ == "__main__":
    main()
