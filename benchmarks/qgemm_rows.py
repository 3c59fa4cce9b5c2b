"""Where the quantized products change route, by row count: the C kernels' integer path (int16
activation codes, madd), their float path (each pass's weight rows decoded once to float32,
FMAs) and dequantize + BLAS (engine.models.linear's prompt route), on the real models' layer
shapes, interleaved (every repeat runs every route at every row count), medians with min-max
of GMAC/s (wall time).

    python benchmarks/qgemm_rows.py [--rows 1,2,3,4,6,8,16,64,128,256,512] [--threads 1]
        [--repeats 5] [--formats int4,int8]

These figures set qgemm.set_float_rows' default (cext/csrc/qgemm.c) and KERNEL_MAX_ROWS
(engine/models/linear.py). Prints a table and writes benchmarks/results/qgemm_rows.json.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import engine.models.linear as linear_module  # noqa: E402
from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json  # noqa: E402
from cext import cpu, qgemm  # noqa: E402
from engine.models.linear import Linear  # noqa: E402
from engine.models.quant import Int4Weight, Int8Weight  # noqa: E402

# (name, out features, in features): SmolLM2-135M's gate/up and down, Qwen2.5-0.5B's gate/up and down
SHAPES = [("smollm2 gate_up", 3072, 576), ("smollm2 down", 576, 1536),
          ("qwen gate_up", 9728, 896), ("qwen down", 896, 4864)]
ROUTES = ("int16", "float", "blas")


def run_route(layer: Linear, x: torch.Tensor, route: str, min_seconds: float = 0.05) -> float:
    """Seconds per product of layer(x) through one route (repeated for at least min_seconds)."""
    linear_module.KERNEL_MAX_ROWS = linear_module.INT_KERNEL_MAX_ROWS = 0 if route == "blas" else 1 << 30
    qgemm.set_float_rows(1 if route == "float" else 1 << 30)
    layer(x)
    calls, start = 0, time.perf_counter()
    while True:
        layer(x)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_seconds:
            return elapsed / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,3,4,6,8,16,64,128,256,512")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--formats", default="int4,int8")
    args = parser.parse_args()
    row_counts = [int(r) for r in args.rows.split(",")]
    formats = args.formats.split(",")
    cpu.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    saved = (linear_module.KERNEL_MAX_ROWS, linear_module.INT_KERNEL_MAX_ROWS, qgemm.get_float_rows())
    gen = torch.Generator().manual_seed(0)
    cases = []
    for name, num_out, num_in in SHAPES:
        w = torch.randn(num_out, num_in, generator=gen) * 0.05
        for fmt in formats:
            weight = Int4Weight.from_dense(w) if fmt == "int4" else Int8Weight.from_dense(w)
            cases.append((f"{name} {fmt}", Linear(weight), num_in, num_out))
    inputs = {(case[0], m): torch.randn(m, case[2], generator=gen) for case in cases for m in row_counts}
    times: dict[tuple[str, int, str], list[float]] = {}
    try:
        for _ in range(args.repeats):
            for label, layer, _, _ in cases:
                for m in row_counts:
                    for route in ROUTES:
                        times.setdefault((label, m, route), []).append(run_route(layer, inputs[label, m], route))
    finally:
        linear_module.KERNEL_MAX_ROWS, linear_module.INT_KERNEL_MAX_ROWS, float_rows = saved
        qgemm.set_float_rows(float_rows)
    rows, results = [], []
    for label, _, num_in, num_out in cases:
        for m in row_counts:
            gmacs = {route: summarize([m * num_in * num_out / t / 1e9 for t in times[label, m, route]])
                     for route in ROUTES}
            best = max(ROUTES, key=lambda r: gmacs[r]["median"])
            rows.append([label, m, *(fmt_stats(gmacs[r]) for r in ROUTES), best])
            results.append({"case": label, "rows": m, "gmac_s": gmacs, "best": best})
    print_table(["layer", "rows", "int16 GMAC/s", "float GMAC/s", "dequant+BLAS GMAC/s", "best"], rows,
                title=f"quantized products by row count, {args.threads} thread(s), medians (min-max) of {args.repeats}")
    env = environment()
    print(f"load average: {env['load_average']}")
    write_json("qgemm_rows", {"args": vars(args), "environment": env, "results": results})


if __name__ == "__main__":
    main()
