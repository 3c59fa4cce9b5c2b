"""The engine's host path: per-tick and per-token host time with ScriptedModel, and a stand-in fast model.

    python benchmarks/host_path.py [--trees DIR,DIR] [--sizes 1,8,32,64,128] [--tokens 256]
                                   [--repeats 5] [--skip-http] [--skip-fast]

Sections (every tree's numbers measured in one run, interleaved round by round):
  host     ScriptedModel (no compute, logits over the 49,152-id vocabulary of the default
           tokenizer), greedy, ``--tokens`` new tokens per request at each batch size:
           in-process (``Engine.generate``) and over HTTP (raw SSE clients read by one epoll thread
           in this process, the server in the tree's child process). Host time = wall time minus the model's forward
           time; per tick = host / engine ticks, per token = host / generated tokens.
  tick     the engine tick alone: requests added straight to a core whose ``_tick`` runs on the
           child's main thread (no consumer, queue hand-off or GIL wait): the engine thread's CPU
           per decode tick outside forward; on a loaded machine the steadiest figure.
  fast     ScriptedModel(step_seconds=1/650): a 650 tok/s model. One 4,096-token HTTP stream and
           32 concurrent 512-token HTTP streams; decode tok/s (first token of the last stream to
           start .. last token) against 650 per stream, and against the double's own measured rate
           (a loop of its forwards alone: a spin that ends within ~10-30 us of its 1/650 s).
Targets (issue 28): batch-1 tick <= 35 us and <= 6 us per token at batch 64 in-process; HTTP
per token within 10 us of in-process; fast >= 0.95x (one stream) and >= 0.9x (32 streams).

``--trees``: worktrees to compare (default: this one). Each gets a child process that imports
that tree's engine (PYTHONPATH) and serves its engines; this script's own code drives all of
them, so an older tree is measured the same way. Medians with min-max; the load average is
printed per round (the machine is shared). Never asserts on time. Writes
benchmarks/results/host_path.json.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAST_RATE = 650.0
PROMPT = "Go."
SCRIPT_TEXT = "The quick brown fox jumps over the lazy dog, and then it naps in the warm sun. " * 16


# ---------- child: one tree's engines ----------
class TimedModel:
    """Delegates to a model and sums its forward time, and the engine thread's CPU time spent
    between forwards (``host_cpu_s``: the tick's own work, not the time it waited for a core or
    the GIL: on a shared machine the robust figure)."""

    def __init__(self, inner):
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.max_model_len = None
        self.forward_seconds = 0.0
        self.host_cpu_s = 0.0
        self._cpu_at_exit = None

    def make_kv_cache(self, num_blocks: int, block_size: int):
        return self.inner.make_kv_cache(num_blocks, block_size)

    def forward(self, batch, kv_cache):
        cpu = time.thread_time()
        if self._cpu_at_exit is not None:
            self.host_cpu_s += cpu - self._cpu_at_exit
        start = time.perf_counter()
        out = self.inner.forward(batch, kv_cache)
        self.forward_seconds += time.perf_counter() - start
        self._cpu_at_exit = time.thread_time()
        return out

    def counters(self, ticks: int) -> dict:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"ticks": ticks, "forward_s": self.forward_seconds, "host_cpu_s": self.host_cpu_s,
                "process_cpu_s": usage.ru_utime + usage.ru_stime}


def delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def scripted(script, vocab_size: int, step_seconds: float):
    from engine.testing import ScriptedModel

    try:
        return ScriptedModel(script, vocab_size, step_seconds=step_seconds)
    except TypeError:  # an older tree: no step_seconds yet, pace it from outside
        return _Paced(ScriptedModel(script, vocab_size), step_seconds)


class _Paced:
    def __init__(self, inner, step_seconds: float):
        self.inner, self.step_seconds = inner, step_seconds
        self.vocab_size, self.max_model_len = inner.vocab_size, None

    def make_kv_cache(self, num_blocks: int, block_size: int):
        return None

    def forward(self, batch, kv_cache):
        time.sleep(self.step_seconds)
        return self.inner.forward(batch, kv_cache)


def child_main(max_batch: int, max_tokens: int) -> None:
    import engine
    from engine.loader import default_model_path
    from engine.params import SamplingParams
    from webapp import make_server

    try:  # the compute threads Engine.from_pretrained sets (the sampler shares its rows with them)
        from engine.models.threads import apply_thread_policy
        apply_thread_policy()
    except ImportError:
        pass
    tok = engine.load_tokenizer(default_model_path())
    script = tok.encode(SCRIPT_TEXT, add_special_tokens=False)
    max_model_len = max_tokens + 64
    options = dict(max_model_len=max_model_len, max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch),
                   kv_cache_tokens=max_batch * (max_model_len + 32), speculative=None)
    engines, ports = {}, {}
    for name, step in (("host", 0.0), ("fast", 1.0 / FAST_RATE)):
        model = TimedModel(scripted(script, tok.vocab_size, step))
        eng = engine.Engine(model, tok, **options)
        server = make_server(eng, "127.0.0.1", 0, threads=max_batch + 16)
        threading.Thread(target=server.run, daemon=True).start()
        engines[name], ports[name] = (eng, model), server.effective_port
    try:  # as python -m webapp does before it serves
        from engine.startup import freeze_startup_heap
        freeze_startup_heap()
    except ImportError:
        pass
    print(json.dumps(ports), flush=True)
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    for line in sys.stdin:
        cmd = json.loads(line)
        eng, model = engines[cmd.get("engine", "host")]
        if cmd["op"] == "counters":
            reply = model.counters(eng._core.num_ticks)
        elif cmd["op"] == "generate":
            params = SamplingParams(max_tokens=cmd["tokens"], temperature=0, ignore_eos=True)
            before = model.counters(eng._core.num_ticks)
            start = time.perf_counter()
            done = eng.generate([prompt_ids] * cmd["batch"], params)
            wall = time.perf_counter() - start
            reply = dict(delta(model.counters(eng._core.num_ticks), before), wall=wall,
                         tokens=sum(len(c.token_ids) for c in done))
        elif cmd["op"] == "tick_cpu":
            reply = {"us_per_tick": tick_cpu(tok, script, options, cmd["batch"], cmd["ticks"])}
        elif cmd["op"] == "raw_rate":  # the double's own rate: its forwards in a loop, nothing else
            batch = _decode_batch(eng, cmd["batch"])
            start = time.perf_counter()
            for _ in range(cmd["steps"]):
                model.inner.forward(batch, None)
            reply = {"tok_s_per_stream": cmd["steps"] / (time.perf_counter() - start)}
        else:
            reply = {"error": f"unknown op {cmd['op']!r}"}
        print(json.dumps(reply), flush=True)
    for eng, _ in engines.values():
        eng.close()


def tick_cpu(tok, script, options: dict, batch: int, num_ticks: int) -> float:
    """The engine tick alone: ``batch`` requests added straight to a fresh core and ``_tick`` called
    on this thread (the engine's own thread sleeps: nothing wakes it), so no consumer, queue hand-off
    or GIL wait is in it. CPU microseconds per decode tick outside forward (steady state)."""
    import engine
    from engine.params import SamplingParams

    model = TimedModel(scripted(script, tok.vocab_size, 0.0))
    eng = engine.Engine(model, tok, **options)
    core = eng._core
    params = SamplingParams(max_tokens=num_ticks + 32, temperature=0, ignore_eos=True)
    prompt_ids = tok.encode(PROMPT, add_special_tokens=False)
    for _ in range(batch):
        req = core.make_request(prompt_ids, params)
        core.groups[req.group.request_id] = req.group
        core._add(req)
    for _ in range(16):  # prefill, then decode
        core._tick()
    before = model.counters(0)
    for _ in range(num_ticks):
        core._tick()
    work = delta(model.counters(0), before)
    eng.close()
    return work["host_cpu_s"] / (num_ticks - 1) * 1e6  # CPU between forwards: num_ticks - 1 gaps


def _decode_batch(eng, batch: int):
    """A decode-only ForwardBatch of ``batch`` rows (the shape of a steady-state tick)."""
    import torch

    from engine.batch import ForwardBatch

    def t(values):
        return torch.tensor(values, dtype=torch.int64)

    return ForwardBatch(input_ids=t([1] * batch), positions=t([8] * batch),
                        slot_mapping=t(list(range(batch))), query_starts=t(list(range(batch + 1))),
                        context_lens=t([9] * batch),
                        block_tables=t([[i] for i in range(batch)]), logit_rows=t(list(range(batch))),
                        prompt_lens=t([4] * batch), query_starts_list=list(range(batch + 1)),
                        context_lens_list=[9] * batch, num_decode_seqs=batch, block_size=16)


class Child:
    def __init__(self, tree: str, max_batch: int, max_tokens: int):
        env = dict(os.environ, PYTHONPATH=tree)
        self.tree = tree
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", "--max-batch", str(max_batch),
             "--max-tokens", str(max_tokens)],
            cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.ports = json.loads(self.proc.stdout.readline())

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


# ---------- HTTP client ----------
def run_streams(port: int, concurrency: int, max_tokens: int) -> tuple[float, list[list[float]]]:
    """``concurrency`` streamed completions read raw by one thread (epoll over their sockets, as a
    load generator reads): per stream the arrival time of each token's chunk. One reader thread,
    not one per stream: the clients share the server's two cores, and 32 client threads woken once
    a chunk each took CPU from the server (32 x 512 tokens of the stand-in: 0.76x of 32 x 650 read
    by 32 threads, 0.80x by this loop, interleaved)."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    pattern = b"data: {"  # one chunk per token event ([DONE] does not match)
    results: list[list[float]] = [[] for _ in range(concurrency)]
    tails = [b""] * concurrency
    sel = selectors.DefaultSelector()
    start = time.perf_counter()
    for i in range(concurrency):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(request)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, i)
    num_open = concurrency
    try:
        while num_open:
            for key, _ in sel.select(60.0) or [(None, None)]:
                if key is None:
                    raise TimeoutError("no stream sent anything for 60 s")
                i = key.data
                try:
                    piece = key.fileobj.recv(1 << 16)
                except BlockingIOError:
                    continue
                if not piece:
                    sel.unregister(key.fileobj)
                    key.fileobj.close()
                    num_open -= 1
                    continue
                now = time.perf_counter()
                data = tails[i] + piece
                results[i].extend([now] * data.count(pattern))
                tails[i] = data[-(len(pattern) - 1):]
    finally:
        for key in list(sel.get_map().values()):
            key.fileobj.close()
        sel.close()
    return time.perf_counter() - start, results


def decode_rate(results: list[list[float]]) -> float:
    """Tokens per second from the moment every stream has its first token to the last token."""
    t0 = max(r[0] for r in results)
    t1 = max(r[-1] for r in results)
    return sum(1 for r in results for x in r if x > t0) / (t1 - t0)


# ---------- parent ----------
def fmt(values, spec: str = ".1f") -> str:
    return f"{statistics.median(values):{spec}} ({min(values):{spec}}-{max(values):{spec}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", default=ROOT, help="comma-separated worktrees to compare (A/B in one run)")
    ap.add_argument("--sizes", default="1,8,32,64,128")
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per request in the host section")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--fast-repeats", type=int, default=3)
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--skip-fast", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--max-batch", type=int, default=128, help=argparse.SUPPRESS)
    ap.add_argument("--max-tokens", type=int, default=4096, help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child:
        return child_main(args.max_batch, args.max_tokens)
    trees = [os.path.abspath(t) for t in args.trees.split(",")]
    names = [os.path.basename(t.rstrip("/")) + (f"#{i}" if [os.path.basename(x) for x in trees].count(
        os.path.basename(t)) > 1 else "") for i, t in enumerate(trees)]
    children = [Child(t, max(sizes + [32]), 4096) for t in trees]
    host = {(n, mode, b): [] for n in names for mode in ("inproc", "http") for b in sizes}
    ticks = {(n, b): [] for n in names for b in sizes}
    fast = {(n, kind): [] for n in names for kind in ("1x4096", "32x512")}
    fast_cpu = {(n, mode): [] for n in names for mode in ("inproc", "http")}  # the stand-in's engine CPU a token
    loads = []
    try:
        for child in children:  # warm-up
            child.ask(op="generate", batch=2, tokens=8)
            run_streams(child.ports["host"], 2, 8)
        for rnd in range(args.repeats):
            loads.append(os.getloadavg()[0])
            for b in sizes:
                for name, child in zip(names, children):
                    ticks[name, b].append(child.ask(op="tick_cpu", batch=b, ticks=200)["us_per_tick"])
                    r = child.ask(op="generate", batch=b, tokens=args.tokens)
                    host[name, "inproc", b].append(r)
                    if not args.skip_http:
                        before = child.ask(op="counters")
                        wall, results = run_streams(child.ports["host"], b, args.tokens)
                        after = child.ask(op="counters")
                        host[name, "http", b].append(dict(delta(after, before), wall=wall,
                                                          tokens=sum(len(r) for r in results)))
            print(f"round {rnd + 1}/{args.repeats} done, load average {loads[-1]:.2f}", file=sys.stderr)
        raw = {}
        if not args.skip_fast:
            for name, child in zip(names, children):
                raw[name] = {b: child.ask(op="raw_rate", engine="fast", batch=b, steps=650)
                             ["tok_s_per_stream"] for b in (1, 32)}
            for rnd in range(args.fast_repeats):
                loads.append(os.getloadavg()[0])
                for name, child in zip(names, children):
                    before = child.ask(op="counters", engine="fast")
                    _, res = run_streams(child.ports["fast"], 1, 4096)
                    after = child.ask(op="counters", engine="fast")
                    fast[name, "1x4096"].append(decode_rate(res))
                    fast_cpu[name, "http"].append(delta(after, before)["host_cpu_s"] / sum(map(len, res)) * 1e6)
                    r = child.ask(op="generate", engine="fast", batch=1, tokens=4096)
                    fast_cpu[name, "inproc"].append(r["host_cpu_s"] / r["tokens"] * 1e6)
                    _, res = run_streams(child.ports["fast"], 32, 512)
                    fast[name, "32x512"].append(decode_rate(res))
                print(f"fast round {rnd + 1}/{args.fast_repeats} done, load average {loads[-1]:.2f}",
                      file=sys.stderr)
    finally:
        for child in children:
            child.close()

    report = {"trees": dict(zip(names, trees)), "tokens": args.tokens, "load_average_per_round": loads,
              "host": {}, "fast": {}}
    print(f"ScriptedModel, {args.tokens} new tokens per request; median (min-max) of {args.repeats} "
          f"interleaved rounds; load average {min(loads):.1f}-{max(loads):.1f} "
          f"(2 cores shared by ~6 engineers)")
    print("  engine cpu: the engine thread's CPU time outside forward (its own work, robust to load);")
    print("  wall: wall time minus forward (includes waiting for a core and the GIL);")
    print("  process cpu: all threads of the serving process (engine, consumers, HTTP handlers, the double's")
    print("  forward) per token")
    print(f"{'tree':<14}{'mode':<7}{'batch':>6}{'engine cpu us/tick':>24}{'us/token':>20}{'wall us/tick':>24}"
          f"{'process cpu us/token':>24}")
    for b in sizes:
        for mode in ("inproc", "http"):
            for name in names:
                rows = host[name, mode, b]
                if not rows:
                    continue
                cpu_tick = [r["host_cpu_s"] / r["ticks"] * 1e6 for r in rows]
                cpu_token = [r["host_cpu_s"] / r["tokens"] * 1e6 for r in rows]
                wall_tick = [(r["wall"] - r["forward_s"]) / r["ticks"] * 1e6 for r in rows]
                proc_token = [r["process_cpu_s"] / r["tokens"] * 1e6 for r in rows]
                report["host"][f"{name} {mode} b={b}"] = {
                    "engine_cpu_us_per_tick": cpu_tick, "engine_cpu_us_per_token": cpu_token,
                    "wall_us_per_tick": wall_tick, "process_cpu_us_per_token": proc_token}
                print(f"{name:<14}{mode:<7}{b:>6}{fmt(cpu_tick):>24}{fmt(cpu_token, '.2f'):>20}"
                      f"{fmt(wall_tick):>24}{fmt(proc_token):>24}")
    print("\nthe tick alone (requests added to a core, _tick called on one thread: no consumer or hand-off),")
    print("engine CPU outside forward per decode tick, median (min-max)")
    print(f"{'tree':<14}{'batch':>6}{'us/tick':>24}{'us/token':>20}")
    for b in sizes:
        for name in names:
            values = ticks[name, b]
            report.setdefault("tick", {})[f"{name} b={b}"] = values
            print(f"{name:<14}{b:>6}{fmt(values):>24}{fmt([v / b for v in values], '.2f'):>20}")
    if not args.skip_fast:
        print(f"\nstand-in fast model (step_seconds=1/650) over HTTP: decode tok/s, median (min-max) of "
              f"{args.fast_repeats}")
        print(f"{'tree':<14}{'run':<9}{'tok/s':>24}{'x 650/stream':>14}{'x own rate':>12}{'own rate':>10}")
        for kind, num in (("1x4096", 1), ("32x512", 32)):
            for name in names:
                rates = fast[name, kind]
                own = raw[name][num]
                report["fast"][f"{name} {kind}"] = {"tok_s": rates, "own_rate_per_stream": own}
                med = statistics.median(rates)
                print(f"{name:<14}{kind:<9}{fmt(rates, '.0f'):>24}{med / (FAST_RATE * num):>14.3f}"
                      f"{med / (own * num):>12.3f}{own:>10.0f}")
        print("\nthe stand-in's one 4,096-token stream: engine CPU outside forward per token (us), HTTP against "
              "Engine.generate in-process (issue 28: within 10 us), median (min-max)")
        print(f"{'tree':<14}{'in-process':>24}{'HTTP':>24}{'HTTP - in-process':>20}")
        for name in names:
            inproc, http = fast_cpu[name, "inproc"], fast_cpu[name, "http"]
            report["fast"][f"{name} 1x4096 engine_cpu_us_per_token"] = {"inproc": inproc, "http": http}
            gap = statistics.median(http) - statistics.median(inproc)
            print(f"{name:<14}{fmt(inproc):>24}{fmt(http):>24}{gap:>20.1f}")
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    path = os.path.join(ROOT, "benchmarks", "results", "host_path.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
