"""Prometheus metrics for /metrics, with no lock on the per-token path.

Counters and histograms are updated once per request, when it ends: a request keeps its
own inter-token gaps in a plain list (no lock per token) and ``ServerMetrics.finish``
folds them into the shared bucket counts under one lock. Engine gauges (running and
waiting requests, KV usage) are read from ``engine.stats()`` at scrape time.
"""
from __future__ import annotations

import bisect
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


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

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        buckets, running = [], 0
        for bound, count in zip(self.bounds + (float("inf"),), self.counts):
            running += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=self.total)


class RequestRecord:
    """One request's timings, owned by its handler thread (no locking)."""

    __slots__ = ("endpoint", "start", "last", "first_token_s", "gaps", "num_prompt_tokens", "num_generated")

    def __init__(self, endpoint: str, num_prompt_tokens: int):
        self.endpoint = endpoint
        self.start = self.last = time.perf_counter()
        self.first_token_s: float | None = None
        self.gaps: list[float] = []
        self.num_prompt_tokens = num_prompt_tokens
        self.num_generated = 0

    def tokens(self, num_tokens: int) -> None:
        """Called per event with the number of new token ids."""
        now = time.perf_counter()
        if self.first_token_s is None:
            self.first_token_s = now - self.start
        else:
            self.gaps.append(now - self.last)
        self.last = now
        self.num_generated += num_tokens


class ServerMetrics:
    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, status) -> count
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
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
            self.num_prompt_tokens += record.num_prompt_tokens
            self.num_generated_tokens += record.num_generated
            if record.first_token_s is not None:
                self.ttft.add((record.first_token_s,))
            self.itl.add(record.gaps)
            self.e2e.add((e2e,))

    def collect(self):
        with self._lock:
            requests = CounterMetricFamily("llm_requests", "HTTP generation requests by endpoint and outcome",
                                           labels=["endpoint", "status"])
            for (endpoint, status), n in sorted(self.requests.items()):
                requests.add_metric([endpoint, status], n)
            families = [
                requests,
                CounterMetricFamily("llm_prompt_tokens", "Prompt tokens processed", value=self.num_prompt_tokens),
                CounterMetricFamily("llm_generation_tokens", "Tokens generated", value=self.num_generated_tokens),
                self.ttft.family("llm_time_to_first_token_seconds", "Time from request to first token"),
                self.itl.family("llm_inter_token_latency_seconds", "Time between consecutive streamed events"),
                self.e2e.family("llm_e2e_request_latency_seconds", "Time from request to last token"),
            ]
        try:
            stats = self.engine.stats()
        except Exception:  # a dead engine still gets scraped
            stats = {}
        families.append(GaugeMetricFamily("llm_num_requests_running", "Requests in the running batch",
                                          value=stats.get("num_running", 0)))
        families.append(GaugeMetricFamily("llm_num_requests_waiting", "Requests waiting for admission",
                                          value=stats.get("num_waiting", 0)))
        families.append(GaugeMetricFamily("llm_kv_cache_usage_ratio", "Fraction of KV cache blocks in use",
                                          value=stats.get("kv_usage", 0.0)))
        families.append(GaugeMetricFamily("llm_engine_alive", "1 while the engine thread runs",
                                          value=1.0 if self.engine.is_alive() else 0.0))
        return families

    def render(self) -> bytes:
        return generate_latest(self.registry)
