"""Prefill attention alone: the last 256-row chunk of a prompt over its paged context, the AVX-512
kernel against its AMX-BF16 variant (cext/csrc/prefill_attention_amx.h), on the attention shapes of
the real models (query heads, kv heads, head_dim), interleaved (every repeat runs every shape and
variant once), medians with min-max of milliseconds per call; the float16 cache the engine keeps.
Variants the CPU lacks are left out and named. No model files needed.

    python benchmarks/prefill_attention.py [--contexts 512,2048,8192] [--repeats 7] [--threads 2]

Prints a table and writes benchmarks/results/prefill_attention.json.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json  # noqa: E402
from cext import cpu, ops  # noqa: E402
from engine.models import fused  # noqa: E402

# (name, query heads, kv heads, head_dim)
SHAPES = [("smollm2-135m", 9, 3, 64), ("qwen2.5-0.5b", 14, 2, 64), ("gemma3-270m", 4, 1, 256)]
BLOCK_SIZE = 16
CHUNK = 256


def chunk_inputs(heads: int, kv_heads: int, head_dim: int, context: int) -> tuple:
    """The last CHUNK rows of a `context`-token prompt: q [CHUNK, H, D], float16 caches in
    scattered blocks, one sequence."""
    g = torch.Generator().manual_seed(context + head_dim)
    num_blocks = -(-context // BLOCK_SIZE)
    table = torch.randperm(num_blocks, generator=g)[None]
    k_cache = torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim, generator=g).half()
    v_cache = torch.randn(num_blocks * BLOCK_SIZE, kv_heads, head_dim, generator=g).half()
    q = torch.randn(CHUNK, heads, head_dim, generator=g)
    positions = torch.arange(context - CHUNK, context)
    return (q, k_cache, v_cache, table, torch.tensor([0, CHUNK]), torch.tensor([context]), positions,
            BLOCK_SIZE, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", default="512,2048,8192")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    cpu.set_num_threads(args.threads)
    variants = ["avx512"] if cpu.allows("avx512") else []
    if variants and cpu.allows("amx_bf16"):
        variants.append("amx")
    if not variants:
        print("this CPU has no AVX-512: nothing to compare (the AMX variant needs it)")
        return
    if "amx" not in variants:
        print("no AMX-BF16 on this CPU: the amx variant is left out")
    contexts = [int(n) for n in args.contexts.split(",")]
    cases = {(name, n): chunk_inputs(h, kv, d, n) for name, h, kv, d in SHAPES for n in contexts}
    times: dict[tuple, list[float]] = {}
    for _ in range(args.repeats):
        for key, inputs in cases.items():
            for variant in variants:
                ops.set_prefill_amx(variant == "amx")
                fused.prefill_attention(*inputs)
                start = time.perf_counter()
                fused.prefill_attention(*inputs)
                times.setdefault((*key, variant), []).append((time.perf_counter() - start) * 1e3)
    ops.set_prefill_amx(True)
    rows, results = [], []
    for name, n in cases:
        stats = {v: summarize(times[(name, n, v)]) for v in variants}
        ratio = stats["avx512"]["median"] / stats["amx"]["median"] if "amx" in stats else None
        rows.append([name, n, *(fmt_stats(stats[v], ".2f") for v in variants),
                     f"{ratio:.2f}x" if ratio else "-"])
        results.append({"model": name, "context": n, "ms": stats, "amx_speedup": ratio})
    load = os.getloadavg()
    print_table(["shape", "context", *(f"{v} ms" for v in variants), "avx512 / amx"], rows,
                title=f"prefill attention, last {CHUNK}-row chunk, {args.threads} thread(s), float16 cache "
                      f"(load average {load[0]:.2f} {load[1]:.2f})")
    write_json("prefill_attention", {"environment": environment(), "threads": args.threads, "results": results})


if __name__ == "__main__":
    main()
