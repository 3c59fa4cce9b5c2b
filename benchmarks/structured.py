"""Structured output: what a JSON Schema costs, and which grammar engine to use.

Default run (the real default model, SmolLM2-135M-Instruct):
  1. decode tok/s through the Engine with and without a JSON Schema at batch 1 and 8 (target:
     constrained >= 0.85x unconstrained). Every request generates exactly ``--tokens`` tokens: the
     plain one ignores EOS, the constrained one has a schema (an array of >= 40 objects) longer than that.
  2. mask time per token per sequence: engine.structured.apply_token_masks over [B, V] logits along
     real constrained token paths (the bitmask fill by llguidance plus our unpack-and-mask).
  3. schema compile time (uncached, then a cache hit) for a small, a nested and a 40-property schema.
All configurations interleaved within each repeat; medians with min-max; load average printed.

``--compare-engines``: llguidance (1.9.1) vs xgrammar (0.2.9) over OUR tokenizers (SmolLM2's, and
Qwen2.5's GGUF vocabulary from .cache/testdata), both fed the same token bytes: vocabulary set-up
time, schema compile time and mask time per token along the same valid token paths. xgrammar is
not a dependency (it pulls torch, transformers, pydantic, apache-tvm-ffi and, on x86-64 Linux,
triton: ~250 MB for triton alone, and pip resolves CUDA torch wheels, ~3 GB of downloads in all,
against llguidance's one 3 MB wheel with no dependencies); install it anywhere and pass
``--xgrammar-path DIR`` (e.g. ``pip install --no-deps --target DIR xgrammar==0.2.9 apache-tvm-ffi``).

Usage: ``python benchmarks/structured.py [--repeats 5] [--tokens 64] [--compare-engines
[--xgrammar-path DIR]]``. Prints tables; writes benchmarks/results/structured.json
(or structured_engines.json).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
QWEN_VOCAB = REPO / ".cache" / "testdata" / "ggml-vocab-qwen2.gguf"

SMALL = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                          "age": {"type": "integer", "minimum": 0, "maximum": 130}},
         "required": ["name", "age"], "additionalProperties": False}
NESTED = {"type": "object", "additionalProperties": False, "required": ["id", "customer", "items", "status"],
          "properties": {
              "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
              "customer": {"type": "object", "additionalProperties": False, "required": ["name", "email"],
                           "properties": {"name": {"type": "string"}, "email": {"type": "string"},
                                          "vip": {"type": "boolean"}}},
              "items": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
                  "type": "object", "additionalProperties": False, "required": ["sku", "qty", "price"],
                  "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                                 "price": {"type": "number", "minimum": 0}}}},
              "status": {"enum": ["new", "paid", "shipped"]}}}
WIDE = {"type": "object", "additionalProperties": False, "required": [f"field_{i}" for i in range(40)],
        "properties": {f"field_{i}": [{"type": "integer"}, {"type": "string"}, {"type": "boolean"},
                                      {"enum": ["x", "y", "z"]}][i % 4] for i in range(40)}}
LONG = {"type": "array", "minItems": 40, "items": SMALL}  # outlasts --tokens: every request runs the same length
SCHEMAS = {"small": SMALL, "nested": NESTED, "wide": WIDE}
INSTANCES = {
    "small": {"name": "Ada Lovelace", "age": 36},
    "nested": {"id": "AB-1234", "customer": {"name": "Grace Hopper", "email": "grace@example.com", "vip": True},
               "items": [{"sku": "kb-01", "qty": 2, "price": 19.5}, {"sku": "ms-77", "qty": 1, "price": 5}],
               "status": "paid"},
    "wide": {f"field_{i}": [i * 7, f"value {i}", i % 2 == 0, "xyz"[i % 3]][i % 4] for i in range(40)},
}


def instance_text(name: str) -> str:
    return json.dumps(INSTANCES[name], ensure_ascii=False)  # ", " and ": ": the separators we compile with


# ---------------------------------------------------------------- engine decode, mask, compile
def engine_tok_s(eng, prompt: str, batch_size: int, num_tokens: int, is_constrained: bool) -> float:
    from engine import SamplingParams

    if is_constrained:
        params = SamplingParams(max_tokens=num_tokens, temperature=0, json_schema=LONG)
    else:
        params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    completions = eng.generate([prompt] * batch_size, params)
    elapsed = time.perf_counter() - start
    num_generated = sum(len(c.token_ids) for c in completions)
    if num_generated != batch_size * num_tokens:
        raise RuntimeError(f"expected {batch_size * num_tokens} tokens, got {num_generated}")
    return num_generated / elapsed


def mask_us_per_token(eng, batch_size: int, paths: list[list[int]], compiled) -> float:
    """Microseconds per token per sequence of apply_token_masks over [B, V] logits along ``paths``."""
    from engine.structured import GrammarMatcher, apply_token_masks

    vocab_size = eng.tokenizer.vocab_size
    logits = np.zeros((batch_size, vocab_size), dtype=np.float32)  # [B, V]
    matchers = [GrammarMatcher(compiled) for _ in range(batch_size)]
    num_steps = min(len(p) for p in paths)
    elapsed = 0.0
    for step in range(num_steps):
        start = time.perf_counter()
        apply_token_masks(logits, matchers)
        elapsed += time.perf_counter() - start
        for row, m in enumerate(matchers):
            m.accept(paths[row % len(paths)][step])
    return elapsed / (num_steps * batch_size) * 1e6


def run_engine(args) -> dict:
    import engine
    from engine.params import SamplingParams
    from engine.structured import compile_grammar, spec_of
    from engine.structured.compiler import _cache

    eng = engine.Engine.from_pretrained(max_model_len=1024, speculative=None)
    tok = eng.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "List people as JSON."}])
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    tok_s = {(b, c): [] for b in batch_sizes for c in (False, True)}
    for b in batch_sizes:  # warm-up: compile the schema, touch every path once
        for c in (False, True):
            engine_tok_s(eng, prompt, b, 8, c)
    for repeat in range(args.repeats):
        for b in batch_sizes:
            for c in ((False, True) if repeat % 2 == 0 else (True, False)):  # alternate which runs first
                tok_s[(b, c)].append(engine_tok_s(eng, prompt, b, args.tokens, c))
    rows, results = [], {"decode": {}, "mask_us": {}, "compile_ms": {}}
    for b in batch_sizes:
        plain, constrained = summarize(tok_s[(b, False)]), summarize(tok_s[(b, True)])
        ratio = constrained["median"] / plain["median"]
        rows.append([b, fmt_stats(plain), fmt_stats(constrained), f"{ratio:.2f}x"])
        results["decode"][b] = {"plain_tok_s": plain, "schema_tok_s": constrained, "ratio": ratio}
    print_table(["batch", "plain tok/s", "JSON Schema tok/s", "ratio"], rows,
                f"Engine decode, {args.tokens} tokens per request, greedy (target ratio >= 0.85)")

    # mask time along real constrained paths (the engine's own outputs for each schema)
    rows = []
    for name, schema in SCHEMAS.items():
        params = SamplingParams(max_tokens=200, temperature=0.8, seed=1, json_schema=schema)
        paths = [c.token_ids for c in eng.generate([prompt] * 4, params) if c.token_ids]
        compiled = compile_grammar(spec_of(params), tok, tok.vocab_size)
        for b in batch_sizes:
            us = summarize([mask_us_per_token(eng, b, paths, compiled) for _ in range(args.repeats)])
            results["mask_us"][f"{name}/{b}"] = us
            rows.append([name, b, min(len(p) for p in paths), fmt_stats(us, ".0f")])
    print_table(["schema", "batch", "tokens", "mask us/token/seq"], rows,
                f"Token mask (llguidance fill + unpack + -inf), vocabulary {tok.vocab_size}")

    rows = []
    for name, schema in SCHEMAS.items():
        spec = spec_of(SamplingParams(json_schema=schema))
        cold, warm = [], []
        for _ in range(args.repeats):
            _cache.clear()
            start = time.perf_counter()
            compile_grammar(spec, tok, tok.vocab_size)
            cold.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            compile_grammar(spec, tok, tok.vocab_size)
            warm.append((time.perf_counter() - start) * 1e3)
        results["compile_ms"][name] = {"cold": summarize(cold), "cached": summarize(warm)}
        rows.append([name, fmt_stats(summarize(cold), ".2f"), fmt_stats(summarize(warm), ".4f")])
    print_table(["schema", "compile ms", "cache hit ms"], rows, "Schema compile (on the request's thread)")
    eng.close()
    return results


# ---------------------------------------------------------------- llguidance vs xgrammar
def token_bytes(tok, vocab_size: int) -> list[bytes]:
    """Our tokenizer's per-id bytes (special tokens empty: neither engine may emit them inside JSON)."""
    from engine.tokenizer.token_bytes import TokenPieces

    pieces = TokenPieces(tok)
    return [b"" if i in pieces.special_token_ids or i >= pieces.num_ids else pieces.bytes_of(i)
            for i in range(vocab_size)]


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, vocab_size: int):
        import llguidance

        from engine.structured.compiler import JSON_OPTIONS
        from engine.structured.vocab import _Wrapper

        self.llg, self.options = llguidance, JSON_OPTIONS
        self.vocab = llguidance.LLTokenizer(_Wrapper(tok, vocab_size), n_vocab=vocab_size,
                                            eos_token=list(tok.eos_token_ids))
        self.bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=self.options)
        return self.llg.LLMatcher(self.vocab, grammar, log_level=0)

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, matcher) -> None:
        matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.consume_token(token_id)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab_size: int):
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo(token_bytes(tok, vocab_size), xgrammar.VocabType.RAW, vocab_size=vocab_size,
                                      stop_token_ids=list(tok.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher) -> None:
        matcher.fill_next_token_bitmask(self.bitmask, 0)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)


def compare_engines(args) -> dict:
    import engine
    from engine.loader import default_model_path

    if args.xgrammar_path:
        sys.path.insert(0, args.xgrammar_path)
    start = time.perf_counter()
    import xgrammar  # noqa: F401

    import_s = time.perf_counter() - start
    print(f"import xgrammar: {import_s:.2f} s (it imports torch, transformers, pydantic)\n")
    vocabularies = {"SmolLM2 (49152)": engine.load_tokenizer(default_model_path())}
    if QWEN_VOCAB.is_file():
        vocabularies["Qwen2.5 GGUF (151936)"] = engine.load_tokenizer(QWEN_VOCAB)
    results: dict = {"xgrammar_import_s": import_s}
    rows = []
    for vocab_name, tok in vocabularies.items():
        vocab_size = max(tok.vocab_size, 151936 if "Qwen" in vocab_name else 0)
        backends = []
        for cls in (Llguidance, Xgrammar):
            start = time.perf_counter()
            backends.append(cls(tok, vocab_size))
            setup_s = time.perf_counter() - start
            results[f"{vocab_name}/{cls.name}/setup_s"] = setup_s
            rows.append([vocab_name, cls.name, "vocabulary set-up", f"{setup_s * 1e3:.0f} ms", ""])
        for schema_name, schema in SCHEMAS.items():
            path = tok.encode(instance_text(schema_name), add_special_tokens=False)
            compile_ms = {b.name: [] for b in backends}
            mask_us = {b.name: [] for b in backends}
            for _ in range(args.repeats):  # interleaved: each backend once per repeat
                for b in backends:
                    start = time.perf_counter()
                    compiled = b.compile(schema)
                    compile_ms[b.name].append((time.perf_counter() - start) * 1e3)
                    m = b.matcher(compiled)
                    elapsed = 0.0
                    for token_id in path:
                        start = time.perf_counter()
                        b.fill(m)
                        elapsed += time.perf_counter() - start
                        if not b.accept(m, token_id):
                            raise RuntimeError(f"{b.name} refused a token of the {schema_name} instance")
                    mask_us[b.name].append(elapsed / len(path) * 1e6)
            for b in backends:
                c, mk = summarize(compile_ms[b.name]), summarize(mask_us[b.name])
                results[f"{vocab_name}/{b.name}/{schema_name}"] = {"compile_ms": c, "mask_us": mk,
                                                                    "num_tokens": len(path)}
                rows.append([vocab_name, b.name, f"{schema_name} ({len(path)} tok)", fmt_stats(c, ".2f"),
                             fmt_stats(mk, ".0f")])
    print_table(["vocabulary", "engine", "schema", "compile ms", "mask us/token"], rows,
                "llguidance vs xgrammar over our tokenizers (one thread, same token path)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--compare-engines", action="store_true")
    parser.add_argument("--xgrammar-path", default=None)
    args = parser.parse_args()
    env = environment()
    print(f"load average: {env['load_average']}\n")
    if args.compare_engines:
        results = compare_engines(args)
        name = "structured_engines"
    else:
        results = run_engine(args)
        name = "structured"
    env_after = os.getloadavg()
    print(f"load average after: {env_after}")
    path = write_json(name, {"environment": env, "load_average_after": env_after, "args": vars(args),
                             "results": results})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
