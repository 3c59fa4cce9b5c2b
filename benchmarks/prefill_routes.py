"""Prefill tok/s of 512- and 2,048-token prompts, before/after the per-ISA kernels and the
measured route table, interleaved in one process (no llama.cpp needed).

- before: ``cext.cpu.set_isa("avx2")`` (the AVX2 kernels) and the fixed row thresholds
  (engine.models.linear: the kernels up to 256 rows, then dequantize + float32 BLAS);
- exact: the best ISA this CPU has (AVX-512 VNNI variants) and the exact routes measured at
  load without AMX and without the strip route (engine.models.routes: int16 / float / blas per
  row count; ``ENGINE_AMX_INT=0 ENGINE_STRIP=0``);
- strip: the same with the strip route (int16's integer sums, 16 outputs per AVX-512 VNNI
  vector) where the CPU has AVX-512 VNNI;
- amx_int: the same with the amx_int route (int16's integer sums on AMX-INT8 tiles, exact as
  int16 is) where the CPU has AMX-INT8: the default;
- amx: the same with the amx route allowed (``ENGINE_AMX=1``: bfloat16 weights on AMX tiles).

Each prompt is prefilled as the engine does by default, in chunks of ``--chunk`` tokens (the
scheduler's 256-token tick budget) through the paged KV cache; every repeat runs every
(model, length, variant) once, medians with min-max. The machine may be shared: the load
average is printed beside the figures.

    python benchmarks/prefill_routes.py [--models smollm2,qwen] [--lengths 512,2048] [--repeats 3]
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
from cext import cpu  # noqa: E402
from engine.batch import single_sequence_batch  # noqa: E402
from engine.loader import default_model_path, load_model  # noqa: E402
from engine.models import routes  # noqa: E402

QWEN = REPO / ".cache" / "testdata" / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
BLOCK_SIZE = 16


def products(model):
    return [p for layer in model.layers
            for p in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj) if p is not None]


VARIANTS = ("before", "exact", "strip", "amx_int", "amx")


def set_variant(model, variant: str, tables: dict) -> None:
    """before: AVX2 kernels, fixed thresholds; exact / amx: the best ISA, that variant's tables."""
    cpu.set_isa("avx2" if variant == "before" else "auto")
    for layer in products(model) + [model.head_proj]:
        if variant == "before" or id(layer) not in tables[variant]:
            layer._route_grid = layer._route_best = None
        else:
            layer.set_routes(routes.ROW_GRID, tables[variant][id(layer)])


def prefill_seconds(model, ids: list[int], chunk: int) -> float:
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    cache = model.make_kv_cache(num_blocks, BLOCK_SIZE)
    blocks = list(range(num_blocks))
    start = time.perf_counter()
    for first in range(0, len(ids), chunk):
        model.forward(single_sequence_batch(ids[first:first + chunk], first, blocks, BLOCK_SIZE), cache)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2,qwen")
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch and kernel threads (the engine's default here: 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    models = {}
    for name in args.models.split(","):
        path = default_model_path() if name == "smollm2" else str(QWEN)
        if name != "smollm2" and not QWEN.is_file():
            print(f"{name}: {QWEN} missing (make testdata), skipped")
            continue
        model = load_model(path)
        layers = products(model) + [model.head_proj]
        tables = {"amx_int": {id(p): list(p._route_best) for p in layers if p._route_best}}
        os.environ["ENGINE_AMX_INT"] = "0"
        strip = routes.calibrate(products(model), False, args.threads)
        tables["strip"] = {id(p): list(p._route_best) for p in layers if p._route_best}
        os.environ["ENGINE_STRIP"] = "0"
        exact = routes.calibrate(products(model), False, args.threads)
        del os.environ["ENGINE_AMX_INT"], os.environ["ENGINE_STRIP"]
        tables["exact"] = {id(p): list(p._route_best) for p in layers if p._route_best}
        amx = routes.calibrate(products(model), True, args.threads)
        tables["amx"] = {id(p): list(p._route_best) for p in layers if p._route_best}
        models[name] = (model, tables)
        print(f"{name} amx_int routes (the default): {routes.describe(model.product_routes)}")
        print(f"{name} exact routes: {routes.describe(exact)}")
        print(f"{name} strip routes: {routes.describe(strip)}")
        print(f"{name} amx routes: {routes.describe(amx)}")
    gen = torch.Generator().manual_seed(0)
    prompts = {(name, n): torch.randint(100, models[name][0].vocab_size - 100, (n,), generator=gen).tolist()
               for name in models for n in lengths}
    times: dict[tuple, list[float]] = {}
    for _ in range(args.repeats):
        for (name, n), ids in prompts.items():
            model, tables = models[name]
            for variant in VARIANTS:
                set_variant(model, variant, tables)
                times.setdefault((name, n, variant), []).append(prefill_seconds(model, ids, args.chunk))
    cpu.set_isa("auto")
    rows, results = [], []
    for name, n in prompts:
        stats = {v: summarize([n / t for t in times[name, n, v]]) for v in VARIANTS}
        ratios = {v: stats[v]["median"] / stats["before"]["median"] for v in VARIANTS[1:]}
        rows.append([name, n, *(fmt_stats(stats[v]) for v in VARIANTS),
                     *(f"{ratios[v]:.2f}x" for v in VARIANTS[1:])])
        results.append({"model": name, "tokens": n, "tok_s": stats, "ratios": ratios})
    env = environment()
    columns = ["model", "prompt", *(f"{v} tok/s" for v in VARIANTS), *(f"{v}/before" for v in VARIANTS[1:])]
    print_table(columns, rows,
                title=f"prefill in {args.chunk}-token chunks, {args.threads} thread(s), medians (min-max) of "
                      f"{args.repeats}, CPU {', '.join(cpu.features())}")
    print(f"load average: {env['load_average']}")
    write_json("prefill_routes", {"args": vars(args), "environment": env, "results": results,
                                  "routes": {n: m.product_routes for n, (m, _) in models.items()}})


if __name__ == "__main__":
    main()
