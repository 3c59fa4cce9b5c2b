"""Which route each quantized product takes, chosen by measurement at load.

A quantized layer's product of M rows can run as:
- ``int16``: the C kernels' integer route (activations quantized to int16 codes per block of
  32, integer dot products: vpdpwssd on AVX-512 VNNI, madd on AVX2);
- ``float``: the C kernels' float route (each pass's weight rows decoded once to float32,
  FMAs 16 or 8 lanes wide): the exact float32 product of the dequantized weights;
- ``amx_int``: the int16 route's integer sums on AMX-INT8 tiles (cext/csrc/qgemm_amx.h: each
  activation code split into a signed high and an unsigned low byte, one tile pass per block
  of 32, the block's scale applied in float32 after it): exact as int16 is, where the CPU has
  AMX-INT8 and the layer's outputs are a multiple of 16;
- ``strip``: the int16 route's integer sums with AVX-512 VNNI in strips of 16 outputs
  (cext/csrc/qgemm_strip.h: per strip the weights decoded once into int16 pairs of 16 rows,
  vpdpwssd against broadcast activation codes, the block's scale applied in float32 once per
  block and output): exact as int16 is, where the CPU has AVX-512 VNNI and the layer's outputs
  are a multiple of 16;
- a layer whose weights Linear packed into strips of 16 rows (qgemm.h's QG_PACKED: Q4, Q5, Q6 and Q8
  where the CPU has AVX2) runs ``strip`` over them in place at every row count (AVX-512 VNNI's
  kernel, or AVX2's over half a strip at a time: the same bits; one row at 1.5-2.5x int16's rate on
  Zen 4, 1.1-1.6x on Zen 3, 2-16 rows 1.2-1.9x), or ``amx3`` over them, or ``blas``/``amx`` through
  their dequantization;
  the table times only those, and its one-row route is strip, so its decode batches round alike at
  any size up to where amx3 (with AMX bf16) takes over;
- ``amx3`` (packed strips, where the CPU has AMX-BF16; cext/csrc/qgemm_amx3.h): each weight as the
  float route dequantizes it and each activation split into two bfloat16 (w = wh + wl, x = xh +
  xl: 16 significant bits each), y = xh.wh + xh.wl + xl.wh on AMX-BF16 tiles with float32 sums
  over the whole of K (no per-block epilogue): as close to the float32 product as the int16 route
  (measured 1-3e-6 of |x| . |w| against its 4-10e-6), 2-2.7x strip's rate at 256 rows;
- ``amx``: the weights dequantized to bfloat16 a slice of rows at a time (C, all threads)
  and oneDNN's bfloat16 matmul through torch, which runs on AMX tiles where the CPU has them:
  bfloat16 weights, activations and outputs, float32 sums (not exact: see ``APPROXIMATE``;
  only where the model allows it, LlamaModel's ``approximate_products`` / ``ENGINE_AMX=1``);
- ``blas``: the weights dequantized to float32 a slice at a time and the float32 BLAS.

``calibrate`` times every route the CPU has on each distinct (layout, N, K) at the row counts
of ``ROW_GRID`` on a slice of its rows sized by the work (``proxy_rows``; 0.2-0.35 s per shape
on the quiet 2-vCPU Xeon) and keeps the fastest per row count; the table is cached per machine
(CPU model, features, threads, torch) in the user cache dir, so later loads skip the timing;
a table measured while the load average exceeded the cores, or while other processes used
more than a quarter of a core (``neighbours_were_busy``), is measured again by the first load on a
quieter machine.
``ENGINE_AMX_INT=0`` leaves the amx_int route out of the table, ``ENGINE_AMX3=0`` the amx3 route,
``ENGINE_STRIP=0`` the strip route (and the packed strips); ``ENGINE_PACKED=0`` keeps the row layouts
(every route but packed).
``ENGINE_ROUTES=fixed`` keeps the fixed thresholds (engine.models.linear),
``ENGINE_ROUTES=recalibrate`` measures again, and ``ENGINE_ROUTES=fastest`` takes the measured
route at every row count, 2-16 included (see ``same_route_up_to`` for what that gives up).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import time
from pathlib import Path

import torch

from engine.models.linear import KERNEL_ROUTES

log = logging.getLogger("engine")

ROW_GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# int16, amx_int and strip: activations within 2^-15 per element; amx3: x and w within 2^-17 (each split
# into two bfloat16), float32 sums
EXACT_ROUTES = ("int16", "float", "amx_int", "strip", "amx3", "blas")
APPROXIMATE = ("amx",)  # bfloat16 weights and activations: 8 mantissa bits
CACHE_VERSION = 17  # 7: routes the whole layer can run (6 gave amx_int to outputs not in 16s); 8: L2 prefetch
# on AMD; 9: decode steps spread their weight prefetch over each pass; 10: int16 products of 3-5 rows
# read their codes in place; 11: the strip route; 12: Q4 layers in strips of 16 (QG_PACKED); 13: amx3
# 14: amx3 splits across the threads and runs a long K in chunks; 15: packed strips on AVX2 (its kernel,
# and their dequantization for blas vectorized); 16: int8 strips on AVX2 multiply bytes (tables of 15 timed
# them at int16 speed); 17: a timing starts with its threads awake (_time_call)
PROXY_ROWS = 256  # fewest output rows a shape is timed on
PROXY_MACS = 1 << 23  # and enough rows for this many multiply-adds (a decode row: whole layers)
MIN_TIMED_SECONDS = 0.002  # a timing repeats its call until it lasts this long


def available_routes(allow_approximate: bool) -> tuple[str, ...]:
    """The routes this CPU and build can run (strip: the CPU has AVX2 and the switch allows it, over
    row layouts only with AVX-512 VNNI; amx_int: the CPU has AMX-INT8; amx3: AMX-BF16, packed strips;
    amx: AMX bf16 and torch's oneDNN)."""
    try:
        from cext import cpu
    except ImportError:
        return ("blas",)
    routes = ["int16"] + (["float"] if cpu.get_isa() != "baseline" else []) + ["blas"]
    # strip: over row layouts with AVX-512 VNNI; over packed strips (linear.packs) from AVX2 up
    if cpu.allows("avx2") and os.environ.get("ENGINE_STRIP", "1") != "0":
        routes.append("strip")
    if cpu.allows("amx_int8") and os.environ.get("ENGINE_AMX_INT", "1") != "0":
        routes.append("amx_int")
    if cpu.allows("amx_bf16") and os.environ.get("ENGINE_AMX3", "1") != "0":
        routes.append("amx3")
    if allow_approximate and cpu.allows("amx_bf16") and torch.backends.mkldnn.is_available():
        routes.append("amx")
    return tuple(routes)


def _machine_key(num_threads: int) -> str:
    from cext import cpu

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = (line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
            model = next(names, model)
    except OSError:
        pass
    features = ",".join(cpu.features())
    return f"{model}|{features}|isa={cpu.get_isa()}|threads={num_threads}|torch={torch.__version__}"


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llm-engine" / "product_routes.json"


def is_busy() -> bool:
    """More runnable work than cores (the 1-minute load average): timings are unreliable."""
    try:
        return os.getloadavg()[0] > (os.cpu_count() or 1)
    except OSError:
        return False


NEIGHBOUR_CORES = 0.25  # other processes' mean CPU use during a measurement that marks it busy
# The shortest window /proc/stat's 10 ms ticks judge: a measurement that took less is judged over
# this long (calibrate waits out the rest; one shape takes 0.2-0.35 s, and a table of one shape
# timed beside a `make test` worker was stored as quiet, taking blas where strip ran 1.6x faster).
NEIGHBOUR_WINDOW = 0.5


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds the whole machine has spent busy, this process's CPU seconds), or None
    where /proc/stat is unreadable. Steal time counts as busy: the hypervisor gave our vCPU
    to someone else."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    busy = sum(ticks[:3]) + sum(ticks[5:8])  # user nice system, irq softirq steal (not idle, iowait)
    own = os.times()
    return busy / hz, own.user + own.system


def neighbours_were_busy(before, after, wall_seconds: float) -> bool:
    """Did other processes use more than NEIGHBOUR_CORES cores on average between two
    cpu_seconds() samples? The load average lags by a minute: a compile job that starts with
    the measurement slows a 2-thread timing as much as a busy machine does, and the 1-row
    entry it skews decides every decode step up to 16 rows."""
    if before is None or after is None or wall_seconds < NEIGHBOUR_WINDOW:  # /proc/stat counts in 10 ms ticks
        return False
    others = (after[0] - before[0]) - (after[1] - before[1])
    return others / wall_seconds > NEIGHBOUR_CORES


# Tables this process measured or read, by machine key: every later load in the process takes
# the same routes (a table re-measured between two loads would give two engines of one process
# other prompt numbers).
_PROCESS_TABLES: dict[str, dict] = {}


def _load_cache(key: str) -> dict:
    """The cached table of this machine; a table measured on a busy machine counts only while the
    machine is still busy (a quiet load measures it again), or when this process used it."""
    if key in _PROCESS_TABLES:
        return _PROCESS_TABLES[key]
    try:
        data = json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}
    if data.get("version") != CACHE_VERSION:
        return {}
    digest = hashlib.sha1(key.encode()).hexdigest()
    if data.get("measured_busy", {}).get(digest) and not is_busy():
        return {}
    return data.get("machines", {}).get(digest, {})


def _store_cache(key: str, table: dict, busy: bool = False) -> None:
    path = _cache_path()
    try:
        data = json.loads(path.read_text())
        if data.get("version") != CACHE_VERSION:
            data = {}
    except (OSError, ValueError):
        data = {}
    digest = hashlib.sha1(key.encode()).hexdigest()
    data.setdefault("machines", {})[digest] = table
    data.setdefault("measured_busy", {})[digest] = busy
    data["version"] = CACHE_VERSION
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:  # a read-only home: measure again next time
        log.debug("product routes not cached: %s", exc)


def _clock():
    """The calling thread's CPU time when every kernel runs on it, else wall time."""
    from cext import cpu

    if cpu.get_num_threads() == 1 and torch.get_num_threads() == 1:
        return time.thread_time
    return time.perf_counter


def proxy_rows(layer, num_rows: int) -> int:
    """Output rows a product of ``num_rows`` rows is timed on: at least PROXY_ROWS and enough for
    PROXY_MACS multiply-adds (all of them when the layer is smaller). A decode-sized product on
    256 rows is mostly fixed cost (quantizing x, the pool's hand-off): at one row int16 and float
    timed alike there (25 us each on SmolLM2's gate_up) where the whole layer runs int16 in half
    the time (102 vs 194 us), and the table sent every decode step down the slower route."""
    wanted = -(-PROXY_MACS // (num_rows * layer.in_features))
    return min(layer.out_features, max(PROXY_ROWS, -(-wanted // 64) * 64))


# on torch's OpenMP team: the routes that are not C kernels (linear.KERNEL_ROUTES, on the kernels' pool)
TORCH_ROUTES = tuple(r for r in (*EXACT_ROUTES, *APPROXIMATE) if r not in KERNEL_ROUTES)


def _time_call(proxy, x: torch.Tensor, route: str, clock, wake: bool = True) -> float:
    """Seconds per product of x through route, over as many calls as fill MIN_TIMED_SECONDS; with
    wake, after one untimed call. A timing on torch's team leaves the kernels' pool asleep (it
    sleeps after 300 us idle), and a call that wakes it runs mostly on the caller alone: timed cold,
    a 512-row strip product of two threads took 1.2 or 2.1 ms from round to round, and tables gave
    prompts to the BLAS at half the strips' speed. (torch's passive team sleeps after every call,
    so its routes gain nothing from a wake-up call.)"""
    if wake:
        proxy.run(x, route)
    calls, start = 0, clock()
    while True:
        proxy.run(x, route)
        calls += 1
        elapsed = clock() - start
        if elapsed >= MIN_TIMED_SECONDS:
            return elapsed / calls


def measure(layer, routes: tuple[str, ...], grid: tuple[int, ...] = ROW_GRID,
            rounds: int = 3) -> list[str]:
    """The fastest of `routes` for `layer` (a quantized Linear) at each row count of grid.

    Timed on the first ``proxy_rows`` output rows (every route's time grows linearly with the
    output rows past that), each route once per round with the rounds interleaved and the
    minimum kept (a busy neighbour only adds time), after one warm-up call (oneDNN builds its
    kernel for a shape on the first); a timing repeats the call until it lasts
    MIN_TIMED_SECONDS, and a kernel route's after a torch route's starts with an untimed call
    (_time_call's wake). With one thread the clock is the thread's CPU time, which a neighbour
    that preempts us does not inflate (the machine may be shared)."""
    clock = _clock()
    gen = torch.Generator().manual_seed(0)
    best = []
    for num_rows in grid:
        proxy = layer.row_slice(proxy_rows(layer, num_rows))
        x = torch.randn(num_rows, layer.in_features, generator=gen)
        # the layer's own test too: the proxy's output count (a multiple of 64) may allow a
        # route the whole layer cannot take (amx_int needs outputs in strips of 16)
        candidates = [r for r in routes if proxy.can_run(r, num_rows) and layer.can_run(r, num_rows)]
        times = dict.fromkeys(candidates, float("inf"))
        for route in candidates:
            proxy.run(x, route)
        previous = candidates[-1] if candidates else None
        for _ in range(rounds):
            for route in candidates:
                wake = route not in TORCH_ROUTES and previous in TORCH_ROUTES
                times[route] = min(times[route], _time_call(proxy, x, route, clock, wake))
                previous = route
        best.append(min(times, key=times.get))
    return best


def calibrate(layers, allow_approximate: bool, num_threads: int) -> dict[str, list[str]]:
    """Give each quantized layer its route table (one measurement per distinct shape, cached per
    machine) -> {"layout NxK": [route per ROW_GRID entry]} for the logs and Engine.stats()."""
    mode = os.environ.get("ENGINE_ROUTES", "")
    routes = available_routes(allow_approximate)
    if mode == "fixed" or routes == ("blas",):
        return {}
    key = f"{_machine_key(num_threads)}|routes={','.join(routes)}"
    cached = {} if mode == "recalibrate" else _load_cache(key)
    table: dict[str, list[str]] = {}  # measured (and cached)
    used: dict[str, list[str]] = {}  # what the layers take (same_route_up_to)
    start = time.perf_counter()
    busy = is_busy()
    sample = cpu_seconds()
    measured = 0
    for layer in layers:
        if layer.layout is None or layer.exact:
            continue
        shape = f"{layer.layout} {layer.out_features}x{layer.in_features}"
        if shape not in table:
            if shape in cached and len(cached[shape]) == len(ROW_GRID):
                table[shape] = cached[shape]
            else:
                table[shape] = measure(layer, routes)
                measured += 1
        used[shape] = table[shape] if mode == "fastest" else same_route_up_to(table[shape])
        layer.set_routes(ROW_GRID, used[shape])
    _PROCESS_TABLES[key] = {**cached, **table}
    if measured:
        elapsed = time.perf_counter() - start
        if elapsed < NEIGHBOUR_WINDOW and sample is not None:  # too short to judge: wait out the window
            time.sleep(NEIGHBOUR_WINDOW - elapsed)
        if not busy and neighbours_were_busy(sample, cpu_seconds(), time.perf_counter() - start):
            busy = True
            log.info("other processes used the CPU while product routes were measured: the table "
                     "is measured again by a later load on a quiet machine")
        _store_cache(key, {**cached, **table}, busy)
        log.info("product routes measured for %d shape(s) in %.2f s", measured, elapsed)
    return used


SAME_ROUTE_ROWS = 16  # products of up to this many rows take the one-row route (same_route_up_to)


def same_route_up_to(best: list[str]) -> list[str]:
    """The one-row route for every grid entry up to SAME_ROUTE_ROWS. int16 and float round
    differently, so a stream whose decode rows changed route as streams joined or left its tick
    would change its tokens (greedy ones included) with the load; up to 16 decoding sequences
    one route keeps every stream's numbers those of its solo run. A speculative step's
    verification rows take the route of its number of decoding sequences and embedding rows
    one of their own (engine.models.linear.row_routes), so neither moves them either. Costs
    the float route's edge at 2-16 rows where it measured faster:
    SmolLM2's decode steps of 8 and 16 sequences took 1.22x and 1.25x the measured table's
    (Qwen2.5-0.5B 0.95-1.03x; /tmp probe, 2026-12-02). ``ENGINE_ROUTES=fastest`` skips this
    rule: faster batches, but a stream's tokens may then change with the number of streams
    beside it, and speculation equals plain decoding only while the batch keeps its size."""
    return [best[0] if limit <= SAME_ROUTE_ROWS else route for limit, route in zip(ROW_GRID, best)]


def summary(table: dict[str, list[str]]) -> dict[str, str]:
    """{shape: where the route changes}, e.g. {"0 3072x576": "1-4 int16, 5-128 float, 129+ amx"}."""
    out = {}
    for shape, best in sorted(table.items()):
        spans, begin = [], 0
        for i in range(1, len(best) + 1):
            if i == len(best) or best[i] != best[begin]:
                low = 1 if begin == 0 else ROW_GRID[begin - 1] + 1
                high = "+" if i == len(best) else f"-{ROW_GRID[i - 1]}"
                spans.append(f"{low}{high} {best[begin]}")
                begin = i
        out[shape] = ", ".join(spans)
    return out


def describe(table: dict[str, list[str]]) -> str:
    """The summary on one line, for the start-up log."""
    return "; ".join(f"{shape}: {spans}" for shape, spans in summary(table).items())
