"""The raw model loop: no engine, no scheduler, ForwardBatch objects built directly over
static block tables. Decode tok/s at batch 1, 8 and 32 and prefill tok/s of a 512-token
prompt, in float32 and bfloat16, with the projection weights packed for oneDNN (what
load_model does) beside plain dense weights through F.linear, on the fused path (C kernels
between the matmuls) beside the torch reference path; medians with min-max over repeats,
configurations interleaved within each repeat. The path ``per-layer`` is the fused path with
its kernels called layer by layer from Python (``model.use_decode_program = False``), where
``fused`` runs a decode forward's layers in one C call (engine.models.decode_program).

``--busy`` runs every decode repeat a second time beside a CPU-bound neighbour process
(a Python busy loop) and reports busy tok/s and the busy/quiet ratio (the thread policy's
target: >= 0.4 at batch 1). Threads follow engine.models.threads.apply_thread_policy
(``--threads N`` to override); set OMP_WAIT_POLICY in the environment to compare waits.

``--prefetch l1,l2`` runs each configuration with the quantized products' weight prefetch into
each cache (cext.qgemm.set_prefetch; default: the CPU's own choice), interleaved as the rest; a
level ending in ``-burst`` (``auto-burst``, ``l2-burst``) issues each pass's prefetch in one burst
at its start instead of spread over its blocks (cext.qgemm.set_prefetch_spread(False)).

Usage: ``python benchmarks/decode.py [--model PATH] [--dtypes float32,bfloat16]
[--weights packed,dense] [--paths fused,per-layer,reference] [--batch-sizes 1,8,32] [--steps 32]
[--repeats 5] [--threads N] [--busy] [--prefetch auto|l1,l2]``. Prints a table and writes
benchmarks/results/decode.json. Other benchmarks import ``raw_decode_tok_s`` and
``raw_prefill_tok_s`` to run the same loop side by side with the engine.
"""
from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

# The engine's wait policy (engine.models.threads), before torch loads libgomp;
# OMP_WAIT_POLICY=ACTIVE (or any value) in the environment overrides it for comparisons.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json  # noqa: E402
from engine.batch import ForwardBatch, single_sequence_batch  # noqa: E402
from engine.loader import default_model_path, load_model  # noqa: E402
from engine.models.threads import apply_thread_policy  # noqa: E402

BLOCK_SIZE = 16


def decode_batch(input_ids: torch.Tensor, position: int, block_tables: torch.Tensor, block_size: int) -> ForwardBatch:
    """One decode row per sequence, all sequences at the same position (a lock-step batch)."""
    num_seqs = input_ids.shape[0]
    positions = torch.full((num_seqs,), position, dtype=torch.int64)  # [B]
    slots = block_tables[:, position // block_size] * block_size + position % block_size  # [B]
    rows = torch.arange(num_seqs, dtype=torch.int64)
    lens = positions + 1
    return ForwardBatch(
        input_ids=input_ids, positions=positions, slot_mapping=slots,
        query_starts=torch.arange(num_seqs + 1, dtype=torch.int64), context_lens=lens,
        block_tables=block_tables, logit_rows=rows, prompt_lens=lens,
        query_starts_list=list(range(num_seqs + 1)), context_lens_list=[position + 1] * num_seqs,
        num_decode_seqs=num_seqs, block_size=block_size,
    )


def prefill_batch(prompts: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> ForwardBatch:
    """prompts [B, P]: every sequence prefills its whole prompt from position 0; last-row logits."""
    num_seqs, prompt_len = prompts.shape
    positions = torch.arange(prompt_len, dtype=torch.int64).repeat(num_seqs)  # [B*P]
    seq_of_row = torch.arange(num_seqs, dtype=torch.int64).repeat_interleave(prompt_len)  # [B*P]
    slots = block_tables[seq_of_row, positions // block_size] * block_size + positions % block_size
    starts = [b * prompt_len for b in range(num_seqs + 1)]
    lens = torch.full((num_seqs,), prompt_len, dtype=torch.int64)
    return ForwardBatch(
        input_ids=prompts.flatten(), positions=positions, slot_mapping=slots,
        query_starts=torch.tensor(starts, dtype=torch.int64), context_lens=lens, block_tables=block_tables,
        logit_rows=torch.tensor(starts[1:], dtype=torch.int64) - 1, prompt_lens=lens,
        query_starts_list=starts, context_lens_list=[prompt_len] * num_seqs,
        num_decode_seqs=0, block_size=block_size,
    )


def raw_decode_tok_s(model, batch_size: int, num_steps: int = 32, prompt_len: int = 16,
                     block_size: int = BLOCK_SIZE, seed: int = 0) -> float:
    """Greedy-decode ``num_steps`` tokens for ``batch_size`` sequences after a prompt of
    ``prompt_len`` random ids each; -> generated tokens per second of the decode steps
    (batch building, forward and argmax; the prompt prefill is not timed)."""
    rng = random.Random(seed)
    blocks_per_seq = -(-(prompt_len + num_steps) // block_size)
    cache = model.make_kv_cache(batch_size * blocks_per_seq, block_size)
    block_tables = torch.arange(batch_size * blocks_per_seq, dtype=torch.int64).view(batch_size, blocks_per_seq)
    prompts = torch.tensor([[rng.randrange(model.vocab_size) for _ in range(prompt_len)] for _ in range(batch_size)])
    next_ids = model.forward(prefill_batch(prompts, block_tables, block_size), cache).argmax(dim=-1)  # [B]
    start = time.perf_counter()
    for step in range(num_steps):
        batch = decode_batch(next_ids, prompt_len + step, block_tables, block_size)
        next_ids = model.forward(batch, cache).argmax(dim=-1)  # [B]
    elapsed = time.perf_counter() - start
    return batch_size * num_steps / elapsed


def raw_prefill_tok_s(model, num_tokens: int = 512, block_size: int = BLOCK_SIZE, seed: int = 0) -> float:
    """One forward over a ``num_tokens`` prompt (logits of the last row only) -> tokens per second."""
    rng = random.Random(seed)
    prompt = [rng.randrange(model.vocab_size) for _ in range(num_tokens)]
    num_blocks = -(-num_tokens // block_size)
    cache = model.make_kv_cache(num_blocks, block_size)
    batch = single_sequence_batch(prompt, 0, list(range(num_blocks)), block_size)
    start = time.perf_counter()
    model.forward(batch, cache)
    return num_tokens / (time.perf_counter() - start)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a .gguf file or HF directory (default: embedded SmolLM2)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--weights", default="packed,dense",
                        help="packed: oneDNN layout (the default model); dense: F.linear (side by side)")
    parser.add_argument("--paths", default="fused,reference",
                        help="fused: C kernels between the matmuls (the default), a decode forward's layers in "
                             "one call; per-layer: the same kernels called layer by layer; reference: torch ops only")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=512, help="0: no prefill rows")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="engine.models.threads.apply_thread_policy (default: the measured policy)")
    parser.add_argument("--prefetch", default="auto",
                        help="comma-separated weight-prefetch levels to compare: auto, l1, l2 (each also LEVEL-burst)")
    parser.add_argument("--busy", action="store_true",
                        help="each decode repeat also runs beside a CPU-bound neighbour process; "
                             "reports busy tok/s and busy/quiet")
    return parser.parse_args(argv)


class Neighbour:
    """A CPU-bound process (a Python busy loop) for as long as the ``with`` block runs."""

    def __enter__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.3)  # let it reach the scheduler's steady state
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()


def decode_rates(models: dict, batch_size: int, args) -> dict[str, dict[str, list[float]]]:
    """Interleaved: each repeat measures every configuration quiet (and, with --busy, beside a
    neighbour) before the next repeat -> {label: {"quiet": [...], "busy": [...]}}."""
    rates = {label: {"quiet": [], "busy": []} for label in models}
    for r in range(args.repeats):
        for label, model in models.items():
            rates[label]["quiet"].append(raw_decode_tok_s(model, batch_size, args.steps, args.prompt_len, seed=r))
        if args.busy:
            with Neighbour():
                for label, model in models.items():
                    rates[label]["busy"].append(
                        raw_decode_tok_s(model, batch_size, args.steps, args.prompt_len, seed=r))
    return rates


def main(argv=None) -> dict:
    args = parse_args(argv)
    policy = apply_thread_policy(args.threads)
    path = args.model or default_model_path()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    paths = args.paths.split(",")
    results = {"model": str(path), "steps": args.steps, "prompt_len": args.prompt_len,
               "prefill_tokens": args.prefill_tokens, "repeats": args.repeats, "busy": args.busy,
               "thread_policy": asdict(policy), "load_average_start": os.getloadavg(),
               "prefetch_default": _default_prefetch(),
               "decode": [], "prefill": []}
    rows = []
    for dtype in args.dtypes.split(","):
        for weights in args.weights.split(","):
            model = load_model(path, dtype=dtype, pack_weights=weights == "packed")
            models = {}
            for fused_path in paths:
                # The same weights on both paths: the fused path reads the flag per forward.
                for prefetch in args.prefetch.split(","):
                    path_label = fused_path if prefetch == "auto" else f"{fused_path} prefetch {prefetch}"
                    models[(dtype, weights, path_label)] = _PathView(model, fused_path != "reference", prefetch,
                                                                     fused_path == "fused")
            for view in models.values():
                raw_decode_tok_s(view, 1, num_steps=4, prompt_len=args.prompt_len)  # warm-up
            for batch_size in batch_sizes:
                rates = decode_rates(models, batch_size, args)
                for (d, w, fp), samples in rates.items():
                    label = f"{d} {w} {fp}"
                    quiet = summarize(samples["quiet"])
                    entry = {"dtype": d, "weights": w, "path": fp, "batch_size": batch_size, "tok_s": quiet,
                             "step_ms": summarize([1000 * batch_size / x for x in samples["quiet"]]),
                             "samples_tok_s": samples["quiet"]}
                    row = [label, f"decode B={batch_size}", fmt_stats(quiet), fmt_stats(entry["step_ms"], ".2f")]
                    if args.busy:
                        busy = summarize(samples["busy"])
                        ratio = summarize([b / q for b, q in zip(samples["busy"], samples["quiet"])])
                        entry.update({"busy_tok_s": busy, "busy_over_quiet": ratio,
                                      "samples_busy_tok_s": samples["busy"]})
                        row += [fmt_stats(busy), fmt_stats(ratio, ".2f")]
                    results["decode"].append(entry)
                    rows.append(row)
                    print(f"  {' | '.join(row)}", file=sys.stderr, flush=True)
            if args.prefill_tokens:
                for (d, w, fp), view in models.items():
                    raw_prefill_tok_s(view, 64)  # warm-up
                    rates = [raw_prefill_tok_s(view, args.prefill_tokens, seed=r) for r in range(args.repeats)]
                    stats = summarize(rates)
                    results["prefill"].append({"dtype": d, "weights": w, "path": fp, "num_tokens": args.prefill_tokens,
                                               "tok_s": stats, "samples_tok_s": rates})
                    row = [f"{d} {w} {fp}", f"prefill {args.prefill_tokens}", fmt_stats(stats),
                           fmt_stats(summarize([1000 * args.prefill_tokens / r for r in rates]), ".1f")]
                    rows.append(row + (["", ""] if args.busy else []))
            del model, models
    results["environment"] = environment()
    headers = ["dtype, weights, path", "workload", "tok/s median (min-max)", "ms per forward"]
    if args.busy:
        headers += ["busy tok/s", "busy/quiet"]
    print_table(headers, rows,
                title=f"Raw model loop: {Path(path).name}, {args.steps} decode steps after a "
                      f"{args.prompt_len}-token prompt, {args.repeats} repeats interleaved, "
                      f"{policy.num_threads} threads (OMP_WAIT_POLICY={policy.omp_wait_policy}), "
                      f"weight prefetch by default into {results['prefetch_default']}, "
                      f"load average {results['load_average_start'][0]:.1f} at start")
    print(f"JSON: {write_json('decode', results)}")
    return results


def _default_prefetch() -> str | None:
    """The weight prefetch level this CPU gets by default (None without the C kernels)."""
    try:
        from cext import qgemm
    except ImportError:
        return None
    qgemm.set_prefetch("auto")
    return qgemm.get_prefetch()


class _PathView:
    """The model on one forward path (fused kernels or the torch reference) with one weight
    prefetch level, for the loop."""

    def __init__(self, model, use_fused: bool, prefetch: str = "auto", use_decode_program: bool = True):
        self.model, self.use_fused, self.prefetch = model, use_fused, prefetch
        self.use_decode_program = use_decode_program
        self.vocab_size = model.vocab_size

    def make_kv_cache(self, num_blocks: int, block_size: int):
        return self.model.make_kv_cache(num_blocks, block_size)

    def forward(self, batch, cache):
        from cext import qgemm

        self.model.use_fused = self.use_fused
        self.model.use_decode_program = self.use_decode_program
        level, _, burst = self.prefetch.partition("-")
        qgemm.set_prefetch(level)
        qgemm.set_prefetch_spread(burst != "burst")
        return self.model.forward(batch, cache)


if __name__ == "__main__":
    main()
