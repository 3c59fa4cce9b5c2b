"""The raw model loop: no engine, no scheduler, ForwardBatch objects built directly over
static block tables. Decode tok/s at batch 1, 8 and 32 and prefill tok/s of a 512-token
prompt, in float32 and bfloat16, with the projection weights packed for oneDNN (what
load_model does) beside plain dense weights through F.linear; medians with min-max over repeats.

Usage: ``python benchmarks/decode.py [--model PATH] [--dtypes float32,bfloat16]
[--weights packed,dense] [--batch-sizes 1,8,32] [--steps 32] [--repeats 5] [--threads N]``. Prints a table and writes
benchmarks/results/decode.json. Other benchmarks import ``raw_decode_tok_s`` and
``raw_prefill_tok_s`` to run the same loop side by side with the engine.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json
from engine.batch import ForwardBatch, single_sequence_batch
from engine.loader import default_model_path, load_model

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
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per measurement")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice, one per core)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or default_model_path()
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    results = {"model": str(path), "steps": args.steps, "prompt_len": args.prompt_len,
               "prefill_tokens": args.prefill_tokens, "repeats": args.repeats, "decode": [], "prefill": []}
    rows = []
    configs = [(d, w) for d in args.dtypes.split(",") for w in args.weights.split(",")]
    for dtype, weights in configs:
        model = load_model(path, dtype=dtype, pack_weights=weights == "packed")
        label = f"{dtype} {weights}"
        raw_decode_tok_s(model, 1, num_steps=4, prompt_len=args.prompt_len)  # warm-up
        for batch_size in batch_sizes:
            rates = [raw_decode_tok_s(model, batch_size, args.steps, args.prompt_len, seed=r)
                     for r in range(args.repeats)]
            stats = summarize(rates)
            step_ms = summarize([1000 * batch_size / r for r in rates])
            results["decode"].append({"dtype": dtype, "weights": weights, "batch_size": batch_size,
                                      "tok_s": stats, "step_ms": step_ms, "samples_tok_s": rates})
            rows.append([label, f"decode B={batch_size}", fmt_stats(stats), fmt_stats(step_ms, ".2f")])
            print(f"  {label} decode B={batch_size}: {fmt_stats(stats)} tok/s", file=sys.stderr, flush=True)
        raw_prefill_tok_s(model, 64)  # warm-up
        rates = [raw_prefill_tok_s(model, args.prefill_tokens, seed=r) for r in range(args.repeats)]
        stats = summarize(rates)
        results["prefill"].append({"dtype": dtype, "weights": weights, "num_tokens": args.prefill_tokens,
                                   "tok_s": stats, "samples_tok_s": rates})
        rows.append([label, f"prefill {args.prefill_tokens}", fmt_stats(stats),
                     fmt_stats(summarize([1000 * args.prefill_tokens / r for r in rates]), ".1f")])
        del model
    results["environment"] = environment()
    print_table(["dtype, weights", "workload", "tok/s median (min-max)", "ms per forward"], rows,
                title=f"Raw model loop: {Path(path).name}, {args.steps} decode steps after a "
                      f"{args.prompt_len}-token prompt, {args.repeats} repeats, "
                      f"{results['environment']['torch_num_threads']} threads")
    print(f"JSON: {write_json('decode', results)}")
    return results


if __name__ == "__main__":
    main()
