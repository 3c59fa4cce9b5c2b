"""Where the quantized products change route, by row count: the C kernels' integer route (int16
activation codes: vpdpwssd on AVX-512 VNNI, madd on AVX2), their float route (each pass's weight
rows decoded once to float32, FMAs 16 or 8 lanes wide), strip (int16's integer sums with AVX-512
VNNI, 16 outputs per vector), packed (strip's sums over weights stored in strips of 16, read in
place: what Linear builds where the CPU has AVX2; AVX-512 VNNI's kernel or AVX2's), packed_int8 (packed
with int8 activation codes: activations="int8", vpdpbusd with AVX-512 VNNI, vpmaddubsw on AVX2), amx
(weights dequantized to bfloat16 per slice of rows, oneDNN's bfloat16 matmul on AMX tiles) and blas
(dequantize to float32 + the BLAS),
on the real models' layer shapes, interleaved (every repeat runs every route at every row count),
medians with min-max of GMAC/s (wall time). Routes the CPU lacks are left out and named.

    python benchmarks/qgemm_rows.py [--rows 1,2,3,4,6,8,16,64,128,256,512] [--threads 1]
        [--repeats 5] [--formats int4,int5,int8] [--isas avx2,avx512]

engine.models.routes makes the same measurement per shape at load and picks per row count;
these figures show the whole curve. Prints a table and writes benchmarks/results/qgemm_rows.json.
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
from engine.models.linear import Linear  # noqa: E402
from engine.models.quant import Int4Weight, Int5Weight, Int8Weight  # noqa: E402
from engine.models.routes import available_routes  # noqa: E402

# (name, out features, in features): SmolLM2-135M's gate/up and down, Qwen2.5-0.5B's gate/up and down
SHAPES = [("smollm2 gate_up", 3072, 576), ("smollm2 down", 576, 1536),
          ("qwen gate_up", 9728, 896), ("qwen down", 896, 4864)]
ROUTES = ("int16", "float", "strip", "packed", "packed_int8", "amx", "blas")


def run_route(layer: Linear, x: torch.Tensor, route: str, min_seconds: float = 0.05) -> float:
    """Seconds per product of layer(x) through one route (repeated for at least min_seconds)."""
    layer.run(x, route)
    calls, start = 0, time.perf_counter()
    while True:
        layer.run(x, route)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls


def row_and_packed_layers(weight) -> tuple[Linear, Linear | None, Linear | None]:
    """The weight in its row layout (every route but the packed ones), in strips of 16 and in strips
    with int8 activation codes (None where Linear does not pack: no AVX2)."""
    old = os.environ.get("ENGINE_PACKED")
    os.environ["ENGINE_PACKED"] = "0"
    try:
        rows = Linear(weight)
    finally:
        if old is None:
            del os.environ["ENGINE_PACKED"]
        else:
            os.environ["ENGINE_PACKED"] = old
    packed, packed8 = Linear(weight), Linear(weight)
    if not packed.is_packed_strips:
        return rows, None, None
    packed8.use_int8_activations()
    return rows, packed, packed8


def _can_set(isa: str) -> bool:
    try:
        cpu.set_isa(isa)
    except ValueError:
        return False
    finally:
        cpu.set_isa("auto")
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,6,8,16,64,128,256,512")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--formats", default="int4,int8")
    parser.add_argument("--isas", default="auto",
                        help="instruction sets the kernel routes run on, side by side (e.g. avx2,avx512)")
    args = parser.parse_args()
    available = (*available_routes(allow_approximate=True),
                 *(["packed", "packed_int8"] if "strip" in available_routes(False) else []))
    isas = args.isas.split(",")
    known = (*cpu.ISA_NAMES.values(), "auto")
    skipped = [r for r in ROUTES if r not in available]
    skipped += [i for i in isas if i not in known or (i != "auto" and not _can_set(i))]
    isas = [i for i in isas if i not in skipped]
    # (label, isa, route): the C kernels' routes once per ISA, amx and blas once
    routes = [(f"{r}@{i}" if len(isas) > 1 else r, i, r) for r in ROUTES if r in available
              for i in (isas if r in ("int16", "float") else ["auto"])]
    row_counts = [int(r) for r in args.rows.split(",")]
    formats = args.formats.split(",")
    cpu.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for name, num_out, num_in in SHAPES:
        w = torch.randn(num_out, num_in, generator=gen) * 0.05
        for fmt in formats:
            weight = {"int4": Int4Weight.from_dense, "int8": Int8Weight.from_dense,
                      "int5": lambda w: Int5Weight.from_int4(Int4Weight.from_dense(w))}[fmt](w)
            cases.append((f"{name} {fmt}", row_and_packed_layers(weight), num_in, num_out))
    inputs = {(case[0], m): torch.randn(m, case[2], generator=gen) for case in cases for m in row_counts}
    times: dict[tuple[str, int, str], list[float]] = {}
    for _ in range(args.repeats):
        for label, (layer, packed, packed8), _, _ in cases:
            for m in row_counts:
                for name, isa, route in routes:
                    cpu.set_isa(isa)
                    if route == "packed":
                        seconds = run_route(packed, inputs[label, m], "strip")
                    elif route == "packed_int8":
                        seconds = run_route(packed8, inputs[label, m], "strip")
                    else:
                        seconds = run_route(layer, inputs[label, m], route)
                    times.setdefault((label, m, name), []).append(seconds)
    cpu.set_isa("auto")
    rows, results = [], []
    for label, _, num_in, num_out in cases:
        for m in row_counts:
            names = [name for name, _, _ in routes]
            gmacs = {name: summarize([m * num_in * num_out / t / 1e9 for t in times[label, m, name]])
                     for name in names}
            best = max(names, key=lambda r: gmacs[r]["median"])
            rows.append([label, m, *(fmt_stats(gmacs[r]) for r in names), best])
            results.append({"case": label, "rows": m, "gmac_s": gmacs, "best": best})
    title = (f"quantized products by row count (GMAC/s), {args.threads} thread(s), CPU "
             f"{', '.join(cpu.features())}, medians (min-max) of {args.repeats}")
    print_table(["layer", "rows", *(name for name, _, _ in routes), "best"], rows, title=title)
    env = environment()
    if skipped:
        print(f"left out (this CPU lacks them): {', '.join(skipped)}")
    print(f"load average: {env['load_average']}")
    write_json("qgemm_rows", {"args": vars(args), "environment": env, "results": results})


if __name__ == "__main__":
    main()
