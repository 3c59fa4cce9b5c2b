"""Host cost per token of the async API next to the sync one (ScriptedModel: no model compute).

Four ways to consume the same request, interleaved in each round so load drifts hit all alike:
  sync         for ev in eng.stream(...)
  async        async for ev in eng.astream(...)             (loop-waking queue, engine/async_stream.py)
  executor     the same queue waited on in a thread executor  (the design not taken, for comparison)
  sync x8 / async x8: 8 concurrent streams (threads for sync, tasks on one loop for async)

Prints wall and CPU (process_time: every thread of this process, the engine's included) us/token,
median and min-max over rounds, and the ratio to sync; writes JSON. On a loaded machine wall
time swings with the scheduler; CPU time per token is the steadier figure of host cost.

    .venv/bin/python benchmarks/async_stream.py [--rounds 7] [--tokens 2000]
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import engine  # noqa: E402
from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json  # noqa: E402
from engine.core.runtime import FINISHED  # noqa: E402
from engine.loader import default_model_path  # noqa: E402
from engine.params import SamplingParams  # noqa: E402
from engine.testing import ScriptedModel  # noqa: E402

NUM_CONCURRENT = 8


def run_sync(eng, params, num_streams: int) -> int:
    counts = [0] * num_streams

    def consume(i: int) -> None:
        for event in eng.stream(f"Go {i}.", params):
            counts[i] += len(event.token_ids)

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(num_streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts)


def run_async(eng, params, num_streams: int) -> int:
    async def consume(i: int) -> int:
        return sum([len(ev.token_ids) async for ev in eng.astream(f"Go {i}.", params)])

    async def main() -> int:
        return sum(await asyncio.gather(*(consume(i) for i in range(num_streams))))

    return asyncio.run(main())


def run_executor(eng, params, num_streams: int) -> int:
    """Each event fetched by a blocking get() in the loop's default thread pool."""
    async def consume(i: int) -> int:
        loop = asyncio.get_running_loop()
        stream = eng.stream(f"Go {i}.", params)
        outputs = stream._request.outputs  # the benchmark peeks: this is the design not taken
        count = 0
        while True:
            item = await loop.run_in_executor(None, outputs.get)
            if item is FINISHED:
                stream.close()
                return count
            count += len(item.token_ids)

    async def main() -> int:
        return sum(await asyncio.gather(*(consume(i) for i in range(num_streams))))

    return asyncio.run(main())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=2000)
    args = parser.parse_args()

    tok = engine.load_tokenizer(default_model_path())
    script = tok.encode("Tokens stream to an event loop. " * 8, add_special_tokens=False)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    cases = {
        "sync": lambda eng: run_sync(eng, params, 1),
        "async": lambda eng: run_async(eng, params, 1),
        "executor": lambda eng: run_executor(eng, params, 1),
        f"sync x{NUM_CONCURRENT}": lambda eng: run_sync(eng, params, NUM_CONCURRENT),
        f"async x{NUM_CONCURRENT}": lambda eng: run_async(eng, params, NUM_CONCURRENT),
    }
    per_token: dict[str, list[float]] = {name: [] for name in cases}
    cpu_per_token: dict[str, list[float]] = {name: [] for name in cases}
    with engine.Engine(ScriptedModel(script, tok.vocab_size), tok, max_model_len=args.tokens + 64,
                       kv_cache_tokens=(args.tokens + 64) * NUM_CONCURRENT, speculative=None) as eng:
        for fn in cases.values():  # warm-up
            fn(eng)
        for _ in range(args.rounds):
            for name, fn in cases.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                num_tokens = fn(eng)
                per_token[name].append((time.perf_counter() - start) / num_tokens * 1e6)
                cpu_per_token[name].append((time.process_time() - start_cpu) / num_tokens * 1e6)
    stats = {name: summarize(values) for name, values in per_token.items()}
    cpu_stats = {name: summarize(values) for name, values in cpu_per_token.items()}
    rows = []
    for name, s in stats.items():
        base = "sync x8" if "x8" in name else "sync"
        c = cpu_stats[name]
        rows.append([name, fmt_stats(s), f"{s['median'] / stats[base]['median']:.2f}",
                     fmt_stats(c), f"{c['median'] / cpu_stats[base]['median']:.2f}"])
    env = environment()
    print_table(["consumer", "wall us/token", "vs sync", "CPU us/token", "vs sync"], rows,
                title=f"async vs sync host cost, {args.tokens} tokens/stream, {args.rounds} rounds, "
                      f"load average {env['load_average'][0]:.2f}")
    path = write_json("async_stream", {"args": vars(args), "environment": env, "us_per_token": stats,
                                         "cpu_us_per_token": cpu_stats})
    print(path)


if __name__ == "__main__":
    main()
