"""Small helpers shared by the benchmark scripts: repeated timing, median/min-max
summaries, a plain-text table and JSON results under benchmarks/results/.

Benchmarks never assert on time: they print and record numbers.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def measure(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Wall-clock seconds of ``repeats`` calls of fn, after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def summarize(values: Sequence[float]) -> dict[str, float]:
    """-> {"median", "min", "max", "n"} of a non-empty sequence."""
    if not values:
        raise ValueError("values: empty, nothing to summarize")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def fmt_stats(stats: dict[str, float], spec: str = ".1f") -> str:
    """'123.4 (110.2-130.5)': median with min-max."""
    return f"{stats['median']:{spec}} ({stats['min']:{spec}}-{stats['max']:{spec}})"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str | None = None) -> None:
    if title:
        print(title)
    print(format_table(headers, rows))
    print()


def environment() -> dict[str, Any]:
    """What the numbers depend on: versions, threads, the machine's load while running."""
    import torch

    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average": os.getloadavg(),
    }


def write_json(name: str, data: dict[str, Any], directory: Path | None = None) -> Path:
    """Write ``data`` to benchmarks/results/<name>.json (created if needed); returns the path."""
    directory = RESULTS_DIR if directory is None else Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def on_own_thread(fn, *args):
    """fn(*args) on a new Python thread, as the engine runs its forwards on the engine thread.

    Measured on this 2-core host under load (~14): the same bf16 raw loop ran at 0.14 tok/s on the
    main thread and 4.4 tok/s on a worker thread (torch's OpenMP team of the main thread collapses
    when the cores are busy), so both sides of the comparison run their forwards off the main thread.
    """
    result = []
    worker = threading.Thread(target=lambda: result.append(fn(*args)))
    worker.start()
    worker.join()
    return result[0]


def decode_read_bytes(gguf_path: str | os.PathLike) -> int:
    """The bytes of a GGUF file's tensors that one decode step reads: every tensor, except the
    token embeddings when the file has an output head of its own (then a step reads one row of
    them; with a tied head it reads them all, as the head). The yardstick both engines share:
    their repacked copies of the same weights differ by a few percent at most."""
    from engine.gguf_file import GGUFFile

    with GGUFFile(gguf_path, with_vocabulary=False) as f:
        tensors = f.tensors
        untied = "output.weight" in tensors
        return sum(info.num_bytes for name, info in tensors.items() if not (untied and name == "token_embd.weight"))


def read_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> list[float]:
    """GB/s of ``repeats`` reads of an ``nbytes`` buffer (16x a large L3 by default, its pages
    touched first) on the kernels' pool (cext.cpu.read_bytes), the threads a decode step reads
    its weights with: the machine's read bandwidth as our kernels can see it."""
    import numpy as np

    from cext import cpu

    buffer = np.ones(nbytes, dtype=np.uint8)
    cpu.read_bytes(buffer.ctypes.data, nbytes)  # warm: the pool's threads up
    return [nbytes / seconds / 1e9 for seconds in measure(lambda: cpu.read_bytes(buffer.ctypes.data, nbytes), repeats)]
