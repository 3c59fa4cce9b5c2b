"""Weight formats side by side: raw-model decode tok/s at batch 1/8/32 and prefill tok/s for
quantization="auto" (int4 layers + int8 head, bfloat16 activations) against dense float32
(oneDNN-packed) and dense bfloat16, interleaved (every repeat runs every variant), medians with
min-max; then load time and memory of each variant, each in a fresh process (peak RSS =
VmHWM, final RSS = VmRSS after load), optionally also with another source tree's loader
(`--before /work/main`: the loader before this change).

    python benchmarks/quant_bench.py [--model PATH] [--variants auto,float32,bfloat16]
        [--batch-sizes 1,8,32] [--steps 16] [--repeats 5] [--threads 1] [--before DIR]

Prints a table and writes benchmarks/results/quant_bench.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json  # noqa: E402
from benchmarks.decode import raw_decode_tok_s, raw_prefill_tok_s  # noqa: E402

LOAD_SNIPPET = """
import json, time, torch
torch.set_num_threads({threads})
from engine.loader import load_model
start = time.perf_counter()
model = load_model({path!r}, **{kwargs!r})
seconds = time.perf_counter() - start
status = open("/proc/self/status").read()
kb = lambda key: int(status.split(key + ":")[1].split()[0])
print(json.dumps({{"seconds": seconds, "peak_rss_mb": kb("VmHWM") / 1024, "final_rss_mb": kb("VmRSS") / 1024}}))
"""
BASELINE_SNIPPET = """
import json, torch
torch.set_num_threads({threads})
import engine.loader
status = open("/proc/self/status").read()
print(json.dumps({{"final_rss_mb": int(status.split("VmRSS:")[1].split()[0]) / 1024}}))
"""


def variant_kwargs(variant: str) -> dict:
    if "@" in variant:  # quantization@activation dtype, e.g. auto@float32
        quantization, dtype = variant.split("@")
        return {"quantization": quantization, "dtype": dtype}
    if variant.startswith("auto+dense>"):  # keep a dense float32 copy for products above N rows
        return {"quantization": "auto", "dense_above_rows": int(variant.split(">")[1])}
    return {"quantization": variant}


def measure_load(tree: Path, path: str, kwargs: dict, threads: int) -> dict:
    code = LOAD_SNIPPET.format(threads=threads, path=path, kwargs=kwargs)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--variants", default="auto,float32,bfloat16")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--before", default=None, help="another source tree whose loader is measured too")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from engine.loader import default_model_path, load_model

    path = args.model or default_model_path()
    variants = args.variants.split(",")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results = {"model": str(path), "file_mb": os.path.getsize(path) / 2 ** 20, "decode": [], "prefill": [], "load": []}
    rows = []
    if not args.skip_speed:
        models = {v: load_model(path, **variant_kwargs(v)) for v in variants}
        for model in models.values():
            raw_decode_tok_s(model, 1, num_steps=2)  # warm-up
        samples = {(v, b): [] for v in variants for b in batch_sizes + ["prefill"]}
        for repeat in range(args.repeats):
            for batch_size in batch_sizes:
                for v, model in models.items():
                    samples[v, batch_size].append(raw_decode_tok_s(model, batch_size, args.steps, seed=repeat))
            for v, model in models.items():
                samples[v, "prefill"].append(raw_prefill_tok_s(model, args.prefill_tokens, seed=repeat))
            print(f"  repeat {repeat + 1}/{args.repeats} done", file=sys.stderr, flush=True)
        for (v, b), rates in samples.items():
            stats = summarize(rates)
            kind = "prefill" if b == "prefill" else "decode"
            entry = {"variant": v, "tok_s": stats, "samples_tok_s": rates}
            entry.update({"num_tokens": args.prefill_tokens} if kind == "prefill" else {"batch_size": b})
            results[kind].append(entry)
            label = f"prefill {args.prefill_tokens}" if kind == "prefill" else f"decode B={b}"
            rows.append([v, label, fmt_stats(stats)])
        del models
    trees = [("this tree", REPO, None)] + ([("before", Path(args.before), {"dtype": "float32"})] if args.before else [])
    for name, tree, fixed in trees:
        base = subprocess.run([sys.executable, "-c", BASELINE_SNIPPET.format(threads=args.threads)],
                              env={**os.environ, "PYTHONPATH": str(tree)}, capture_output=True, text=True, cwd=tree)
        base_mb = json.loads(base.stdout.strip().splitlines()[-1])["final_rss_mb"]
        for v in (["float32 (old default)"] if fixed else variants):
            m = measure_load(tree, path, fixed or variant_kwargs(v), args.threads)
            m.update(tree=name, variant=v, import_rss_mb=base_mb)
            results["load"].append(m)
            if "error" in m:
                rows.append([f"{name}: {v}", "load", m["error"]])
                continue
            rows.append([f"{name}: {v}", "load",
                         f"{m['seconds']:.2f} s, RSS final {m['final_rss_mb']:.0f} MB, peak {m['peak_rss_mb']:.0f} MB "
                         f"(imports alone {base_mb:.0f} MB)"])
    results["environment"] = environment()
    print_table(["variant", "workload", "tok/s median (min-max) | load"], rows,
                title=f"{Path(path).name} ({results['file_mb']:.0f} MB): {args.steps} decode steps after a "
                      f"16-token prompt, {args.repeats} interleaved repeats, {args.threads} threads, "
                      f"load average {os.getloadavg()[0]:.1f}")
    print(f"JSON: {write_json('quant_bench', results)}")
    return results


if __name__ == "__main__":
    main()
