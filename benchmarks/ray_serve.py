"""The server on Ray Serve against the single-process server, ScriptedModel engines (host cost only).

    python benchmarks/ray_serve.py [--rounds 3] [--max-tokens 128] [--quick]

One local Ray (num_cpus=2, dashboard off) and one single-process server (webapp.make_server in a
subprocess), both serving tests.server_fixtures' ScriptedModel engine, so every microsecond
measured is host cost: HTTP, SSE, the engine loop, and for Ray its proxy, ingress and replica hops.

1. Latency, interleaved round by round (single, Ray 1 replica, Ray 2 replicas):
   c=1: TTFT and the time per token after the first, per stream;
   c=16: 16 concurrent streams: aggregate tok/s and host microseconds per token (1 / tok/s),
   TTFT p50. Medians over rounds with min-max.
2. Prefix routing: 8 conversations x 8 turns (each turn sends the whole history: a long system
   prompt of its own plus the turns so far), the conversations in parallel, on 2 replicas with
   the prefix-affine router and with the same router's least-loaded fallback alone; the hit rate is the
   engines' prefix-cache hit tokens / looked-up prompt tokens summed over the replicas (from
   /metrics), and the fraction of a conversation's turns that went to its first replica.

Prints tables, writes benchmarks/results/ray_serve.json; never asserts on time.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx

from benchmarks.common import environment, fmt_stats, print_table, summarize, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_NUM_SEQS = 32
SINGLE_CODE = """
import sys
import webapp
from tests.server_fixtures import scripted_engine
eng = scripted_engine(max_model_len=4096, max_num_seqs=int(sys.argv[1]))
server = webapp.make_server(eng, "127.0.0.1", 0)
print(server.effective_port, flush=True)
server.run()
"""
ENGINE_KWARGS = {"max_model_len": 4096, "max_num_seqs": MAX_NUM_SEQS}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_once(client: httpx.Client, url: str, body: dict) -> tuple[float, float, int, str | None]:
    """One streamed chat request: (TTFT s, e2e s, content chunks, replica id)."""
    start = time.perf_counter()
    first, num_chunks = None, 0
    with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        replica = response.headers.get("x-replica-id")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content") is not None:
                num_chunks += 1
                if first is None:
                    first = time.perf_counter() - start
    return first or 0.0, time.perf_counter() - start, num_chunks, replica


def stream_body(max_tokens: int, k: int = 0) -> dict:
    return {"messages": [{"role": "user", "content": f"Count for me, request {k}."}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}


def latency_c1(url: str, max_tokens: int, num_requests: int) -> dict:
    ttfts, per_token = [], []
    with httpx.Client(timeout=120) as client:
        stream_once(client, url, stream_body(4))  # warm the connection
        for k in range(num_requests):
            ttft, e2e, n, _ = stream_once(client, url, stream_body(max_tokens, k))
            ttfts.append(ttft)
            per_token.append((e2e - ttft) / max(1, n - 1))
    return {"ttft_ms": statistics.median(ttfts) * 1e3, "us_per_token": statistics.median(per_token) * 1e6}


def throughput(url: str, max_tokens: int, concurrency: int) -> dict:
    results: list[tuple[float, float, int]] = []
    lock = threading.Lock()

    def one(k: int) -> None:
        with httpx.Client(timeout=300) as client:
            ttft, e2e, n, _ = stream_once(client, url, stream_body(max_tokens, k))
        with lock:
            results.append((ttft, e2e, n))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(concurrency)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    num_tokens = sum(n for _, _, n in results)
    return {"tok_s": num_tokens / wall, "us_per_token": wall / num_tokens * 1e6,
            "ttft_ms": statistics.median(r[0] for r in results) * 1e3}


def prefix_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    values = {}
    for name in ("prefix_cache_hits_total", "prefix_cache_queries_total"):
        match = re.search(rf"^llm:{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        values[name] = float(match.group(1)) if match else 0.0
    return values["prefix_cache_hits_total"], values["prefix_cache_queries_total"]


def conversations(url: str, num_conversations: int, num_turns: int, stats_wait_s: float) -> dict:
    """num_conversations in parallel, each num_turns turns that resend the whole history."""
    hits0, queries0 = prefix_counters(url)
    same_replica: list[float] = []
    lock = threading.Lock()

    def one(k: int) -> None:
        system = f"Conversation {k}. " + f"You are assistant number {k}; keep answers short and exact. " * 12
        messages = [{"role": "system", "content": system}]
        replicas = []
        with httpx.Client(timeout=120) as client:
            for turn in range(num_turns):
                messages.append({"role": "user", "content": f"Question {turn} of conversation {k}?"})
                response = client.post(url + "/v1/chat/completions",
                                       json={"messages": messages, "max_tokens": 16, "temperature": 0})
                response.raise_for_status()
                replicas.append(response.headers.get("x-replica-id"))
                messages.append({"role": "assistant", "content": response.json()["choices"][0]["message"]["content"]})
        with lock:
            same_replica.append(sum(r == replicas[0] for r in replicas) / len(replicas))

    threads = [threading.Thread(target=one, args=(k,)) for k in range(num_conversations)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(stats_wait_s)  # replicas' engine stats reach the ingress every ROUTING_STATS_PERIOD_S
    hits1, queries1 = prefix_counters(url)
    return {"hit_rate": (hits1 - hits0) / max(1.0, queries1 - queries0),
            "same_replica": statistics.mean(same_replica), "prompt_tokens": queries1 - queries0}


def start_single() -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", SINGLE_CODE, str(MAX_NUM_SEQS)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, text=True)
    return proc, f"http://127.0.0.1:{int(proc.stdout.readline())}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="1 round, fewer requests")
    args = parser.parse_args()
    rounds = 1 if args.quick else args.rounds
    c1_requests = 3 if args.quick else 8

    os.environ["PYTHONPATH"] = REPO + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    import ray
    from ray import serve

    from webapp.ray_serve import EngineSpec, deploy

    single, single_url = start_single()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = _free_port()
    spec = EngineSpec("tests.ray_fixtures:scripted_replica_engine", ENGINE_KWARGS)
    load_before = os.getloadavg()
    try:
        deploy(spec, "127.0.0.1", port, app_name="r1", num_replicas=1, num_cpus_per_replica=0.5)
        deploy(spec, "127.0.0.1", port, app_name="r2", num_replicas=2, num_cpus_per_replica=0.5)
        servers = {"single": single_url, "ray 1 replica": f"http://127.0.0.1:{port}/r1",
                   "ray 2 replicas": f"http://127.0.0.1:{port}/r2"}
        samples: dict[str, dict[str, list[float]]] = {name: {} for name in servers}
        for _ in range(rounds):  # interleaved: each round measures every server once
            for name, url in servers.items():
                c1 = latency_c1(url, args.max_tokens, c1_requests)
                c16 = throughput(url, args.max_tokens, 16)
                for key, value in {"c1_ttft_ms": c1["ttft_ms"], "c1_us_per_token": c1["us_per_token"],
                                   "c16_ttft_ms": c16["ttft_ms"], "c16_us_per_token": c16["us_per_token"],
                                   "c16_tok_s": c16["tok_s"]}.items():
                    samples[name].setdefault(key, []).append(value)
        keys = ("c1_ttft_ms", "c1_us_per_token", "c16_ttft_ms", "c16_us_per_token", "c16_tok_s")
        summary = {name: {k: summarize(v) for k, v in s.items()} for name, s in samples.items()}
        print_table(["server", *keys], [[name, *(fmt_stats(summary[name][k]) for k in keys)] for name in servers],
                    title=f"Host cost, ScriptedModel, {args.max_tokens}-token streams"
                          f" ({rounds} rounds, median (min-max))")
        ratio = {k: summary["ray 1 replica"][k]["median"] / summary["single"][k]["median"] for k in keys}
        print("ray 1 replica / single:", {k: round(v, 2) for k, v in ratio.items()})
        print("tok/s, 2 replicas / 1 replica (c=16):",
              round(summary["ray 2 replicas"]["c16_tok_s"]["median"]
                    / summary["ray 1 replica"]["c16_tok_s"]["median"], 2))
        print()

        serve.delete("r1")
        deploy(spec, "127.0.0.1", port, app_name="r2pow", num_replicas=2, num_cpus_per_replica=0.5,
               prefix_routing=False)
        routing = {}
        num_conv, num_turns = (4, 4) if args.quick else (8, 8)
        for name, url in (("single (one engine: the ceiling)", single_url),
                          ("ray 2 replicas, prefix-affine", servers["ray 2 replicas"]),
                          ("ray 2 replicas, least loaded", f"http://127.0.0.1:{port}/r2pow")):
            routing[name] = conversations(url, num_conv, num_turns, stats_wait_s=0 if name.startswith("single") else 3)
        print_table(["server", "prefix-cache hit rate", "turns on the conversation's first replica", "prompt tokens"],
                    [[name, f"{r['hit_rate']:.3f}", f"{r['same_replica']:.2f}", int(r["prompt_tokens"])]
                     for name, r in routing.items()],
                    title=f"Prefix routing: {num_conv} conversations x {num_turns} turns")
    finally:
        serve.shutdown()
        ray.shutdown()
        single.terminate()
        single.wait(10)
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    write_json("ray_serve", {"args": vars(args), "latency": summary, "ratio_ray1_over_single": ratio,
                             "routing": routing, "load_before": load_before, "load_after": load_after,
                             "environment": environment()})


if __name__ == "__main__":
    main()
