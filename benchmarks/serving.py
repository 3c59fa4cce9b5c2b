"""Serving overhead: HTTP streaming vs Engine.stream in-process, latency percentiles, chunk serializer cost.

    python benchmarks/serving.py [--concurrency 1,8] [--max-tokens 128] [--latency-concurrency 1,8,32]
                                 [--repeats 3] [--skip-model] [--cheroot-path DIR]

Sections (all in one run, side by side):
  serializer  ns per SSE chunk: cext.chunk.ChunkWriter vs json.dumps vs orjson (dict built + framed).
  wsgi        us per SSE chunk of a synthetic generator app: waitress (ours) vs cheroot, if importable.
  scripted    ScriptedModel (no compute): us of host cost per token, HTTP vs in-process.
  model       the default model, same greedy generation: tok/s HTTP vs in-process, ratio (target >= 0.97).
  latency     time to first token and inter-token latency p50/p99 through HTTP at each concurrency.
The server runs in a subprocess (the production waitress server from webapp.make_server); the
client reads the raw SSE bytes. Medians over repeats with [min-max]. Never asserts on time.
Writes benchmarks/results/serving.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = [f"Write a short story about a robot named Unit-{i} who learns to paint." for i in range(64)]
SCRIPT_TEXT = "The quick brown fox jumps over the lazy dog, and then it naps in the warm sun. " * 16


def med(values) -> str:
    values = sorted(values)
    return f"{statistics.median(values):.3g} [{values[0]:.3g}-{values[-1]:.3g}]"


def pct(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


# ---------- serializer ----------
def bench_serializer(repeats: int) -> dict:
    import orjson

    from cext.chunk import ChunkWriter
    from engine.outputs import TokenLogprob
    from webapp import protocol

    lp = [TokenLogprob(42, " token", list(b" token"), -0.25,
                       [(42 + k, f" tok{k}", list(f" tok{k}".encode()), -0.25 - k) for k in range(5)])]
    cases = {"text": (' hello "world"', None), "text+top5 logprobs": (" token", lp)}
    results = {}
    n = 20000
    for case, (text, logprobs) in cases.items():
        writer = ChunkWriter("chatcmpl-abc123", "SmolLM2-135M-Instruct", 1700000000, True)

        def ours(writer=writer, text=text, logprobs=logprobs):
            for _ in range(n):
                writer.event(text, logprobs, None)

        def plain(dumps, text=text, logprobs=logprobs):
            def run():
                for _ in range(n):
                    body = protocol.chat_chunk("chatcmpl-abc123", "SmolLM2-135M-Instruct", 1700000000, text,
                                               logprobs, None)
                    b"data: " + dumps(body) + b"\n\n"
            return run

        fns = {"cext.chunk": ours,
               "json.dumps": plain(lambda d: json.dumps(d, ensure_ascii=False).encode()),
               "orjson": plain(orjson.dumps)}
        row = {}
        for name, fn in fns.items():
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter_ns()
                fn()
                times.append((time.perf_counter_ns() - t0) / n)
            row[name] = times
        results[case] = row
    return results


# ---------- wsgi servers, synthetic app ----------
CHUNK = (b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":'
         b'[{"index":0,"delta":{"content":" hello"},"logprobs":null,"finish_reason":null}]}\n\n')


def _synthetic_app(environ, start_response):
    n = int(environ.get("QUERY_STRING", "n=1000").split("=")[1])
    start_response("200 OK", [("Content-Type", "text/event-stream")])
    return (CHUNK for _ in range(n))


def _fetch_raw(port: int, path: str, payload: bytes | None = None) -> tuple[float, list[float], bytes]:
    """Raw HTTP/1.1 request; returns (t_send, arrival time of every SSE chunk, body bytes)."""
    import socket

    sock = socket.create_connection(("127.0.0.1", port))
    method = b"POST" if payload is not None else b"GET"
    head = method + b" " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
    if payload is not None:
        head += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(payload)
    t_send = time.perf_counter()
    sock.sendall(head + b"\r\n" + (payload or b""))
    arrivals, data = [], []
    while True:
        piece = sock.recv(65536)
        if not piece:
            break
        now = time.perf_counter()
        arrivals.extend([now] * piece.count(b"data: "))
        data.append(piece)
    sock.close()
    return t_send, arrivals, b"".join(data)


def bench_wsgi(repeats: int, cheroot_path: str | None) -> dict:
    servers = {}
    import waitress.server

    srv = waitress.server.create_server(_synthetic_app, host="127.0.0.1", port=0, threads=16,
                                        channel_request_lookahead=1)
    threading.Thread(target=srv.run, daemon=True).start()
    servers["waitress"] = srv.effective_port
    if cheroot_path:
        sys.path.insert(0, cheroot_path)
    try:
        from cheroot import wsgi

        ch = wsgi.Server(("127.0.0.1", 0), _synthetic_app, numthreads=16)
        ch.prepare()
        threading.Thread(target=ch.serve, daemon=True).start()
        servers["cheroot"] = ch.bind_addr[1]
    except ImportError:
        pass
    results = {}
    n = 2000
    for name, port in servers.items():
        for conc in (1, 8):
            per_chunk = []
            for _ in range(repeats):
                wall, _ = run_concurrent(lambda i, port=port: _fetch_raw(port, f"/s?n={n}"), conc)
                per_chunk.append(wall / (n * conc) * 1e6)
            results[f"{name} c={conc}"] = per_chunk
    return results


# ---------- engine: HTTP vs in-process ----------
def run_concurrent(fn, concurrency: int):
    results = [None] * concurrency

    def work(i):
        results[i] = fn(i)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, results


def http_stream(port: int, prompt: str, max_tokens: int):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t_send, arrivals, raw = _fetch_raw(port, "/v1/completions", json.dumps(body).encode())
    usage_at = raw.rfind(b'"usage":{')
    if usage_at < 0:
        raise RuntimeError(f"no usage chunk in response: {raw[:300]!r}")
    num_tokens = int(raw[usage_at:].split(b'"completion_tokens":')[1].split(b",")[0])
    token_arrivals = arrivals[:-2]  # minus the usage chunk and [DONE]
    return num_tokens, t_send, token_arrivals


def inproc_stream(eng, prompt: str, max_tokens: int):
    import engine

    params = engine.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t_send = time.perf_counter()
    arrivals, num_tokens = [], 0
    for event in eng.stream(prompt, params):
        arrivals.append(time.perf_counter())
        num_tokens += len(event.token_ids)
    return num_tokens, t_send, arrivals


def run_once(fn, concurrency: int) -> dict:
    wall, results = run_concurrent(fn, concurrency)
    total = sum(r[0] for r in results)
    ttft = [arrivals[0] - t_send for _, t_send, arrivals in results]
    itl = [b - a for _, _, arrivals in results for a, b in zip(arrivals, arrivals[1:])]
    return {"tok_s": total / wall, "us_per_token_per_stream": wall / total * 1e6 * concurrency,
            "ttft": ttft, "itl": itl}


def summarize(samples: list[dict]) -> dict:
    ttft = [t for s in samples for t in s["ttft"]]
    itl = [t for s in samples for t in s["itl"]]
    return {"tok_s": [s["tok_s"] for s in samples],
            "us_per_token_per_stream": [s["us_per_token_per_stream"] for s in samples],
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
            "itl_p50": pct(itl, 0.5), "itl_p99": pct(itl, 0.99)}


def make_engine(kind: str, max_model_len: int):
    import engine

    if kind == "default":
        return engine.Engine.from_pretrained(max_model_len=max_model_len, speculative=None)
    from engine.loader import default_model_path
    from engine.testing import ScriptedModel

    tok = engine.load_tokenizer(default_model_path())
    return engine.Engine(ScriptedModel(tok.encode(SCRIPT_TEXT, add_special_tokens=False), tok.vocab_size), tok,
                         max_model_len=max_model_len, speculative=None)


def serve_child(kind: str, max_model_len: int) -> None:
    """Subprocess mode: serve an engine on a free port, print the port, run until stdin closes."""
    from webapp import make_server

    eng = make_engine(kind, max_model_len)
    server = make_server(eng, "127.0.0.1", 0)
    threading.Thread(target=server.run, daemon=True).start()
    print(server.effective_port, flush=True)
    sys.stdin.read()
    eng.close()


def launch(kind: str, max_model_len: int):
    proc = subprocess.Popen([sys.executable, __file__, "--serve-child", kind, "--max-model-len", str(max_model_len)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline())
    return proc, port


def compare(kind: str, concurrencies, max_tokens: int, repeats: int, max_model_len: int) -> dict:
    """HTTP (server subprocess) and in-process runs interleaved, so load drift hits both alike."""
    proc, port = launch(kind, max_model_len)
    eng = make_engine(kind, max_model_len)
    runs = {
        "http": lambda i: http_stream(port, PROMPTS[i % len(PROMPTS)], max_tokens),
        "in-process": lambda i: inproc_stream(eng, PROMPTS[i % len(PROMPTS)], max_tokens),
    }
    samples = {f"{side} c={conc}": [] for side in runs for conc in concurrencies}
    try:
        http_stream(port, PROMPTS[0], 2)  # warm-up
        inproc_stream(eng, PROMPTS[0], 2)
        for _ in range(repeats):
            for conc in concurrencies:
                for side, fn in runs.items():
                    samples[f"{side} c={conc}"].append(run_once(fn, conc))
    finally:
        proc.stdin.close()
        proc.wait(60)
        eng.close()
    return {name: summarize(s) for name, s in samples.items()}


def print_engine_table(title: str, rows: dict, concurrencies) -> None:
    print(f"\n{title}")
    print(f"{'run':<17} {'tok/s median [min-max]':<30} {'us/token/stream':<30} {'TTFT p50/p99 ms':<18} ITL p50/p99 ms")
    for name, r in rows.items():
        ttft = f"{r['ttft_p50'] * 1e3:.1f}/{r['ttft_p99'] * 1e3:.1f}"
        itl = f"{r['itl_p50'] * 1e3:.2f}/{r['itl_p99'] * 1e3:.2f}"
        print(f"{name:<17} {med(r['tok_s']):<30} {med(r['us_per_token_per_stream']):<30} {ttft:<18} {itl}")
    for conc in concurrencies:
        h, p = rows.get(f"http c={conc}"), rows.get(f"in-process c={conc}")
        if h and p:
            ratio = statistics.median(h["tok_s"]) / statistics.median(p["tok_s"])
            extra = statistics.median(h["us_per_token_per_stream"]) - statistics.median(p["us_per_token_per_stream"])
            print(f"  c={conc}: HTTP/in-process tok/s ratio {ratio:.3f}; HTTP adds {extra:.1f} us per token per stream")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8", help="concurrencies for the HTTP vs in-process comparison")
    ap.add_argument("--latency-concurrency", default="1,8,32", help="concurrencies for TTFT/ITL through HTTP")
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="tokens per stream; long enough that decode, not prefill and TTFT, dominates")
    ap.add_argument("--scripted-max-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scripted-repeats", type=int, default=7)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--skip-model", action="store_true", help="skip the default-model sections")
    ap.add_argument("--cheroot-path", default=None, help="a directory holding cheroot (pip install --target)")
    ap.add_argument("--serve-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_child:
        return serve_child(args.serve_child, args.max_model_len)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    latency_conc = [int(c) for c in args.latency_concurrency.split(",")]
    report = {"args": vars(args)}

    report["serializer_ns_per_chunk"] = ser = bench_serializer(args.repeats)
    print("serializer: ns per chunk, median [min-max]")
    for case, row in ser.items():
        print(f"  {case:<20}" + "  ".join(f"{k}: {med(v)}" for k, v in row.items()))
    report["wsgi_us_per_chunk"] = wsgi = bench_wsgi(args.repeats, args.cheroot_path)
    print("wsgi servers, synthetic SSE app: us per chunk, median [min-max]")
    for name, v in wsgi.items():
        print(f"  {name:<14}{med(v)}")

    scripted_conc = sorted(set(concurrencies) | {1, 8})
    report["scripted"] = rows = compare("scripted", scripted_conc, args.scripted_max_tokens, args.scripted_repeats,
                                        args.max_model_len)
    print_engine_table(f"ScriptedModel (host cost only), {args.scripted_max_tokens} tokens per stream", rows,
                       scripted_conc)
    if not args.skip_model:
        all_conc = sorted(set(concurrencies) | set(latency_conc))
        report["model"] = rows = compare("default", all_conc, args.max_tokens, args.repeats, args.max_model_len)
        print_engine_table(f"default model, greedy, {args.max_tokens} tokens per stream", rows, all_conc)
    os.makedirs(os.path.join(ROOT, "benchmarks", "results"), exist_ok=True)
    path = os.path.join(ROOT, "benchmarks", "results", "serving.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
