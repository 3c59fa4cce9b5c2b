"""The server under overload, and a soak of mixed requests.

    python benchmarks/overload.py [--threads 64] [--levels 1,2,4] [--max-tokens 64]
                                  [--soak 2000] [--soak-concurrency 24] [--quick]

Part 1, overload: the production server (webapp.make_server, a subprocess, the default model)
gets N = level x its concurrency bound (threads - 8) simultaneous streaming requests of
--max-tokens tokens each, while a probe thread GETs /health every 50 ms. Per level: completed
streams, 429s, other statuses, /health latency p50/p99 during the load, TTFT p50/p99 of the
admitted streams.

Part 2, soak: --soak requests mixed (streamed, non-streamed, clients that leave mid-stream, bad
inputs) at --soak-concurrency; the server's RSS, threads and open files after a warm-up and at
the end, lost or truncated streams (a 200 stream without its finish_reason and [DONE]) and 5xx.
Never asserts; prints tables and writes benchmarks/results/overload.json.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import subprocess
import sys
import threading
import time

from benchmarks.common import environment, print_table, write_json

SERVER_CODE = """
import sys, engine, webapp
eng = engine.Engine.from_pretrained(max_num_seqs=int(sys.argv[2]), speculative=None)
server = webapp.make_server(eng, "127.0.0.1", 0, threads=int(sys.argv[1]))
print(server.effective_port, flush=True)
server.run()
"""


def pct(values, q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


class Server:
    def __init__(self, threads: int, max_num_seqs: int):
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER_CODE, str(threads), str(max_num_seqs)],
                                     stdout=subprocess.PIPE, text=True)
        self.port = int(self.proc.stdout.readline())

    def connection(self, timeout: float = 120) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def proc_stats(self) -> dict:
        pid = self.proc.pid
        status = open(f"/proc/{pid}/status").read()
        rss_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
        return {"rss_mib": rss_kb / 1024, "threads": len(os.listdir(f"/proc/{pid}/task")),
                "open_files": len(os.listdir(f"/proc/{pid}/fd"))}

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def chat_body(max_tokens: int, stream: bool, **extra) -> dict:
    return {"model": "x", "messages": [{"role": "user", "content": f"Tell me a story, number {random.random()}."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream, **extra}


def stream_request(server: Server, body: dict, leave_after: int | None = None) -> dict:
    """One streamed request: status, TTFT, whether it ended properly (finish_reason + [DONE])."""
    conn = server.connection()
    start = time.perf_counter()
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            resp.read()
            return {"status": resp.status}
        ttft, finish, done, num_events = None, None, False, 0
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            if "error" in event:
                return {"status": 200, "error": event["error"], "ttft": ttft}
            num_events += 1
            if ttft is None:
                ttft = time.perf_counter() - start
            for choice in event.get("choices", ()):
                finish = choice.get("finish_reason") or finish
            if leave_after is not None and num_events >= leave_after:
                return {"status": 200, "left": True}
        return {"status": 200, "ttft": ttft, "complete": done and finish is not None}
    finally:
        conn.close()


def plain_request(server: Server, body: bytes | dict, path: str = "/v1/chat/completions") -> dict:
    conn = server.connection()
    try:
        data = body if isinstance(body, bytes) else json.dumps(body)
        conn.request("POST", path, data, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        payload = resp.read()
        ok = resp.status != 200 or bool(json.loads(payload).get("choices"))
        return {"status": resp.status, "complete": ok}
    finally:
        conn.close()


def probe_health(server: Server, stop: threading.Event, latencies: list, failures: list) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        try:
            conn = server.connection(timeout=10)
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            conn.close()
            (latencies if resp.status == 200 else failures).append(time.perf_counter() - start)
        except OSError:
            failures.append(time.perf_counter() - start)
        stop.wait(0.05)


def overload_level(server: Server, num_clients: int, max_tokens: int) -> dict:
    results: list[dict] = []
    lock = threading.Lock()
    go = threading.Event()

    def client():
        go.wait()
        r = stream_request(server, chat_body(max_tokens, True))
        with lock:
            results.append(r)

    stop, health, health_failures = threading.Event(), [], []
    prober = threading.Thread(target=probe_health, args=(server, stop, health, health_failures))
    clients = [threading.Thread(target=client) for _ in range(num_clients)]
    for t in clients:
        t.start()
    prober.start()
    start = time.perf_counter()
    go.set()
    for t in clients:
        t.join()
    wall = time.perf_counter() - start
    stop.set()
    prober.join()
    ttfts = [r["ttft"] for r in results if r.get("complete")]
    statuses: dict[int, int] = {}
    for r in results:
        statuses[r["status"]] = statuses.get(r["status"], 0) + 1
    return {
        "clients": num_clients, "completed": sum(1 for r in results if r.get("complete")),
        "http_429": statuses.get(429, 0), "other": {k: v for k, v in statuses.items() if k not in (200, 429)},
        "truncated": sum(1 for r in results if r["status"] == 200 and not r.get("complete")),
        "health_p50_ms": 1e3 * pct(health, 0.5), "health_p99_ms": 1e3 * pct(health, 0.99),
        "health_max_ms": 1e3 * max(health, default=float("nan")), "health_failures": len(health_failures),
        "ttft_p50_s": pct(ttfts, 0.5), "ttft_p99_s": pct(ttfts, 0.99), "wall_s": wall,
    }


BAD_INPUTS = [
    b"{not json", {"model": "x"}, {"model": "x", "messages": []}, {"model": "x", "messages": "hi"},
    chat_body(0, False), chat_body(8, False, temperature=-1), chat_body(8, False, seed=2 ** 64),
    chat_body(8, False, stop=["x" * 100]), chat_body(10 ** 9, False),
]


def soak(server: Server, num_requests: int, concurrency: int, max_tokens: int) -> dict:
    rng = random.Random(0)
    kinds = ["stream", "plain", "leave", "bad"]
    plan = [rng.choice(kinds) for _ in range(num_requests)]
    counts = {k: 0 for k in kinds}
    outcome = {"lost_or_truncated": 0, "http_5xx": 0, "http_429": 0, "errors": 0}
    lock = threading.Lock()
    index = iter(range(num_requests))

    def worker():
        while True:
            with lock:
                i = next(index, None)
            if i is None:
                return
            kind = plan[i]
            try:
                if kind == "stream":
                    r = stream_request(server, chat_body(rng.randint(1, max_tokens), True))
                elif kind == "plain":
                    r = plain_request(server, chat_body(rng.randint(1, max_tokens), False))
                elif kind == "leave":
                    r = stream_request(server, chat_body(max_tokens, True), leave_after=2)
                else:
                    r = plain_request(server, BAD_INPUTS[i % len(BAD_INPUTS)])
            except OSError:
                r = {"status": -1}
            with lock:
                counts[kind] += 1
                status = r["status"]
                if status >= 500 or status < 0:
                    outcome["http_5xx"] += 1
                elif status == 429:
                    outcome["http_429"] += 1
                elif status == 200 and not (r.get("complete") or r.get("left")):
                    outcome["lost_or_truncated"] += 1
                if "error" in r:
                    outcome["errors"] += 1

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"requests": counts, **outcome}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=64)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--levels", default="1,2,4")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--soak", type=int, default=2000)
    parser.add_argument("--soak-concurrency", type=int, default=24)
    parser.add_argument("--quick", action="store_true", help="levels 1,2; soak of 300")
    args = parser.parse_args(argv)
    if args.quick:
        args.levels, args.soak = "1,2", 300
    bound = args.threads - 8
    env = environment()
    server = Server(args.threads, args.max_num_seqs)
    try:
        stream_request(server, chat_body(4, True))  # warm-up
        rows, levels = [], []
        for level in (int(x) for x in args.levels.split(",")):
            r = overload_level(server, level * bound, args.max_tokens)
            levels.append({"level": level, **r})
            rows.append([f"{level}x ({r['clients']})", r["completed"], r["http_429"], r["other"] or "-", r["truncated"],
                         f"{r['health_p50_ms']:.1f} / {r['health_p99_ms']:.1f} / {r['health_max_ms']:.1f}",
                         r["health_failures"], f"{r['ttft_p50_s']:.2f} / {r['ttft_p99_s']:.2f}", f"{r['wall_s']:.1f}"])
        print_table(["load (clients)", "completed", "429", "other", "truncated", "/health p50/p99/max ms",
                     "probe failures", "TTFT p50/p99 s", "wall s"], rows,
                    title=f"Overload: bound {bound} streams of {args.max_tokens} tokens,"
                          f" load avg {os.getloadavg()[0]:.2f}")
        soak_result = None
        if args.soak:
            soak(server, min(200, args.soak), args.soak_concurrency, 16)  # warm-up
            before = server.proc_stats()
            soak_result = soak(server, args.soak, args.soak_concurrency, 16)
            time.sleep(1)
            after = server.proc_stats()
            soak_result.update(before=before, after=after)
            print_table(["", "RSS MiB", "threads", "open files"],
                        [["after warm-up", f"{before['rss_mib']:.0f}", before["threads"], before["open_files"]],
                         ["after soak", f"{after['rss_mib']:.0f}", after["threads"], after["open_files"]]],
                        title=f"Soak: {args.soak} mixed requests {soak_result['requests']}")
            print(f"lost or truncated streams: {soak_result['lost_or_truncated']}, 5xx: {soak_result['http_5xx']}, "
                  f"429: {soak_result['http_429']}, in-band errors: {soak_result['errors']}")
        path = write_json("overload", {"environment": env, "args": vars(args), "bound": bound, "levels": levels,
                                       "soak": soak_result, "load_average_end": os.getloadavg()})
        print(f"wrote {path}")
    finally:
        server.close()


if __name__ == "__main__":
    main()
