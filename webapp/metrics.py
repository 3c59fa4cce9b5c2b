"""Prometheus metrics for /metrics, mirroring vLLM's set, with no lock on the per-token path.

Names are vLLM's with the prefix ``llm:`` instead of ``vllm:`` and the same ``model_name``
label, so a vLLM Grafana dashboard needs only the prefix changed (the mapping is in the
README). Counters and histograms are updated once per request, when it ends: a request
keeps its own inter-token gaps in a plain list (no lock per token) and
``ServerMetrics.finish`` folds them into the shared bucket counts under one lock. Engine
gauges and counters (running and waiting requests, KV usage, prefix cache, preemptions) are
read from ``engine.stats()`` at scrape time.
"""
from __future__ import annotations

import bisect
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

PREFIX = "llm:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
               1.0, 2.5, 5.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)


class _Histogram:
    """Bucket counts guarded by the owner's lock; add() takes many observations at once."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last bucket: +Inf
        self.total = 0.0

    def add(self, values) -> None:
        for v in values:
            self.counts[bisect.bisect_left(self.bounds, v)] += 1
            self.total += v

    def family(self, name: str, doc: str, model_name: str) -> HistogramMetricFamily:
        buckets, running = [], 0
        for bound, count in zip(self.bounds + (float("inf"),), self.counts):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        family = HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([model_name], buckets, sum_value=self.total)
        return family


class RequestRecord:
    """One request's timings, owned by its handler thread (no locking)."""

    __slots__ = ("endpoint", "start", "last", "first_token_s", "gaps", "num_prompt_tokens", "num_generated",
                 "finish_reasons", "queue_s")

    def __init__(self, endpoint: str, num_prompt_tokens: int):
        self.endpoint = endpoint
        self.start = self.last = time.perf_counter()
        self.first_token_s: float | None = None
        self.gaps: list[float] = []
        self.num_prompt_tokens = num_prompt_tokens
        self.num_generated = 0
        self.finish_reasons: list[str] = []  # one per finished choice
        self.queue_s: float | None = None  # submission -> first scheduled, from the engine

    def tokens(self, num_tokens: int) -> None:
        """Called per event with the number of new token ids."""
        now = time.perf_counter()
        if self.first_token_s is None:
            self.first_token_s = now - self.start
        else:
            self.gaps.append(now - self.last)
        self.last = now
        self.num_generated += num_tokens

    def event(self, event) -> None:
        """Fold in one StreamEvent: its new tokens and, when it ends its choice, its finish reason."""
        if event.token_ids:
            self.tokens(len(event.token_ids))
        if event.finish_reason is not None:
            self.finish_reasons.append(event.finish_reason)


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, status) -> count
        self.finish_reasons: dict[str, int] = {}  # finished choices by finish_reason
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.queue = _Histogram(E2E_BUCKETS)
        self.prompt_tokens = _Histogram(TOKEN_BUCKETS)
        self.generation_tokens = _Histogram(TOKEN_BUCKETS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def count(self, endpoint: str, status: str) -> None:
        with self._lock:
            key = (endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1

    def finish(self, record: RequestRecord, status: str) -> None:
        """Folds a finished request into the shared metrics: one lock per request."""
        e2e = time.perf_counter() - record.start
        with self._lock:
            key = (record.endpoint, status)
            self.requests[key] = self.requests.get(key, 0) + 1
            for reason in record.finish_reasons:
                self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
            self.num_prompt_tokens += record.num_prompt_tokens
            self.num_generated_tokens += record.num_generated
            if record.first_token_s is not None:
                self.ttft.add((record.first_token_s,))
            if record.queue_s is not None:
                self.queue.add((record.queue_s,))
            self.itl.add(record.gaps)
            self.e2e.add((e2e,))
            self.prompt_tokens.add((record.num_prompt_tokens,))
            self.generation_tokens.add((record.num_generated,))

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self):
        model = self.model_name
        with self._lock:
            requests = CounterMetricFamily(PREFIX + "http_requests", "HTTP generation requests by endpoint and outcome",
                                           labels=["model_name", "endpoint", "status"])
            for (endpoint, status), n in sorted(self.requests.items()):
                requests.add_metric([model, endpoint, status], n)
            success = CounterMetricFamily(PREFIX + "request_success", "Finished choices by finish reason",
                                          labels=["model_name", "finished_reason"])
            for reason, n in sorted(self.finish_reasons.items()):
                success.add_metric([model, reason], n)
            families = [
                requests,
                success,
                self._counter("prompt_tokens", "Prompt tokens processed", self.num_prompt_tokens),
                self._counter("generation_tokens", "Tokens generated", self.num_generated_tokens),
                self.ttft.family("time_to_first_token_seconds", "Time from request to first token", model),
                self.itl.family("inter_token_latency_seconds", "Time between consecutive streamed events", model),
                self.e2e.family("e2e_request_latency_seconds", "Time from request to last token", model),
                self.queue.family("request_queue_time_seconds", "Time from submission to first scheduling", model),
                self.prompt_tokens.family("request_prompt_tokens", "Prompt tokens per request", model),
                self.generation_tokens.family("request_generation_tokens", "Generated tokens per request", model),
            ]
        try:
            stats = self.engine.stats()
        except Exception:  # a dead engine still gets scraped
            stats = {}
        families += [
            self._gauge("num_requests_running", "Requests in the running batch", stats.get("num_running", 0)),
            self._gauge("num_requests_waiting", "Requests waiting for admission", stats.get("num_waiting", 0)),
            self._gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)",
                        stats.get("kv_usage", 0.0)),
            self._counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                          stats.get("num_prefix_cache_query_tokens", 0)),
            self._counter("prefix_cache_hits", "Prompt tokens found in the prefix cache",
                          stats.get("num_prefix_cache_hit_tokens", 0)),
            self._counter("prefix_cache_disk_hits", "Prompt tokens read from the prefix cache's disk tier",
                          stats.get("num_prefix_cache_disk_hit_tokens", 0)),
            self._counter("num_preemptions", "Preempted requests", stats.get("num_preemptions", 0)),
            self._counter("spec_decode_num_draft_tokens", "Speculative tokens proposed",
                          stats.get("spec_decode_num_draft_tokens", 0)),
            self._counter("spec_decode_num_accepted_tokens", "Speculative tokens accepted by the target",
                          stats.get("spec_decode_num_accepted_tokens", 0)),
            self._gauge("engine_alive", "1 while the engine thread runs", 1.0 if self.engine.is_alive() else 0.0),
        ]
        return families

    def render(self) -> bytes:
        return generate_latest(self.registry)
