"""What the product-route rules for a tick's rows cost (engine/models/routes.py, engine.models.linear.row_routes).

One model, one process, the variants of each check interleaved, medians (min-max) of --repeats:
1. decode steps of B = 4, 8, 16 sequences with the one-row route up to 16 rows (the default:
   routes.same_route_up_to) against the measured table (ENGINE_ROUTES=fastest);
2. one sequence at context --context: a 1-row decode step, a 5-row speculative verification
   (decode attention, plain decoding's route) and the same 5 rows as a prompt chunk;
3. a mixed tick, 4 decode rows and a 256-row prompt chunk at context --context: the decode rows
   on the chunk's route (the default) against a route of their own (a second product).

    .venv/bin/python benchmarks/row_routes.py [--model PATH] [--repeats 12] [--context 300]
"""
from __future__ import annotations

# isort: off
import engine  # noqa: F401  (first: the thread policy before torch loads)
# isort: on
import argparse
import os

import torch

from benchmarks.common import environment, fmt_stats, measure, print_table, summarize, write_json
from engine.batch import ForwardBatch
from engine.loader import load_model
from engine.models import routes
from engine.models.linear import Linear
from engine.models.threads import apply_thread_policy

BLOCK = 16


def make_batch(seqs: list[tuple[list[int], int, list[int]]], gen_rows: int | None = None,
               gen_seqs: int | None = None) -> ForwardBatch:
    """seqs: (token ids, first position, block table); every row a logit row; the leading one-row
    sequences are the decodes."""
    ids, positions, slots, starts, ctx = [], [], [], [0], []
    for tokens, start, table in seqs:
        for i, token in enumerate(tokens):
            ids.append(token)
            positions.append(start + i)
            slots.append(table[(start + i) // BLOCK] * BLOCK + (start + i) % BLOCK)
        starts.append(starts[-1] + len(tokens))
        ctx.append(start + len(tokens))
    width = max(len(t) for _, _, t in seqs)
    tables = [t + [-1] * (width - len(t)) for _, _, t in seqs]
    num_decodes = next((i for i, (tokens, _, _) in enumerate(seqs) if len(tokens) != 1), len(seqs))

    def t(values):
        return torch.tensor(values, dtype=torch.int64)

    return ForwardBatch(t(ids), t(positions), t(slots), t(starts), t(ctx), t(tables), t(list(range(len(ids)))),
                        t(ctx), starts, ctx, num_decode_seqs=num_decodes, block_size=BLOCK, gen_rows=gen_rows,
                        gen_seqs=gen_seqs)


def interleaved(variants: dict, repeats: int) -> dict[str, dict]:
    """{name: fn} -> {name: summary of ms}, the variants taking turns."""
    times = {name: [] for name in variants}
    for fn in variants.values():
        fn()
    for _ in range(repeats):
        for name, fn in variants.items():
            times[name] += measure(fn, 1, warmup=0)
    return {name: summarize([x * 1e3 for x in v]) for name, v in times.items()}


def quantized_layers(model) -> list[Linear]:
    layers = [getattr(layer, name) for layer in model.layers
              for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")]
    layers.append(model.head_proj)
    return [x for x in layers if isinstance(x, Linear) and x._route_best is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model)")
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--context", type=int, default=300)
    args = parser.parse_args()
    model = load_model(args.model)
    apply_thread_policy()
    layers = quantized_layers(model)
    measured = next(iter(routes._PROCESS_TABLES.values()), {})
    if not layers or not measured:
        raise SystemExit("no measured route table: a quantized model on the C kernels is needed")
    clamped = {id(x): list(x._route_best) for x in layers}

    def use(rule: bool) -> None:
        for x in layers:
            x._route_best = clamped[id(x)] if rule else list(measured[f"{x.layout} {x.out_features}x{x.in_features}"])

    rows, results = [], {}
    # 1. decode steps with and without the one-row rule
    nb = -(-(args.context + 2) // BLOCK)
    cache = model.make_kv_cache(16 * nb + 8, BLOCK)
    for size in (4, 8, 16):
        batch = make_batch([([100 + b], args.context, list(range(b * nb, (b + 1) * nb))) for b in range(size)])

        def step(rule: bool, batch=batch):
            use(rule)
            model.forward(batch, cache)

        got = interleaved({"one-row rule": lambda: step(True), "measured table": lambda: step(False)}, args.repeats)
        use(True)
        results[f"decode B={size}"] = got
        ratio = got["one-row rule"]["median"] / got["measured table"]["median"]
        rows.append([f"decode step B={size}", fmt_stats(got["one-row rule"]), fmt_stats(got["measured table"]),
                     f"{ratio:.3f}"])
    # 2. verification against a decode step and a prompt chunk of the same rows
    table = list(range(nb + 1))
    tokens = list(range(1000, 1000 + args.context + 5))
    cache = model.make_kv_cache(nb + 2, BLOCK)
    model.forward(make_batch([(tokens[: args.context], 0, table)]), cache)
    follow = tokens[args.context: args.context + 5]
    got = interleaved({
        "decode 1 row": lambda: model.forward(make_batch([(follow[:1], args.context, table)]), cache),
        "verify 5 rows": lambda: model.forward(make_batch([(follow, args.context, table)], gen_rows=5, gen_seqs=1),
                                               cache),
        "prompt chunk 5 rows": lambda: model.forward(make_batch([(follow, args.context, table)]), cache),
    }, args.repeats)
    results["verification"] = got
    base = got["decode 1 row"]["median"]
    for name, stats in got.items():
        rows.append([name, fmt_stats(stats), "", f"{stats['median'] / base:.2f}x a decode step"])
    # 3. a mixed tick: decode rows on the chunk's route, or on their own
    nb = -(-(args.context + 256 + 2) // BLOCK)
    cache = model.make_kv_cache(5 * nb + 2, BLOCK)
    seqs = [([5 + b], 100, list(range(b * nb, (b + 1) * nb))) for b in range(4)]
    seqs.append((list(range(100, 356)), args.context, list(range(4 * nb, 5 * nb))))
    mixed = make_batch(seqs)
    own = [(4, 4)]
    shared = ForwardBatch.route_spans

    def tick(apart: bool):
        ForwardBatch.route_spans = (lambda self: ((own[0]), (256, 256))) if apart else shared
        try:
            model.forward(mixed, cache)
        finally:
            ForwardBatch.route_spans = shared

    got = interleaved({"chunk's route": lambda: tick(False), "own route": lambda: tick(True)}, args.repeats)
    results["mixed tick"] = got
    ratio = got["own route"]["median"] / got["chunk's route"]["median"]
    rows.append(["mixed tick (4 decodes + 256 rows)", fmt_stats(got["chunk's route"]), fmt_stats(got["own route"]),
                 f"own / shared {ratio:.3f}"])
    print_table(["check", "ms (default)", "ms (alternative)", "ratio"], rows,
                title=f"{args.model or 'default model'}, context {args.context}, {args.repeats} interleaved repeats")
    print("load average", os.getloadavg())
    write_json("row_routes", {"environment": environment(), "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
