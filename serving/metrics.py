"""Prometheus metrics of one server, named as vLLM names them (prefix ``paged_jax:`` instead of ``vllm:``).

Each app owns a ``CollectorRegistry`` (never the process-global one), so several servers in one process (tests)
keep separate counts. Two kinds of metrics:

* engine state (running / waiting counts, KV usage, prefix-cache and token counters, preemptions) comes from the
  latest ``LLMEngine.stats()`` snapshot the engine thread published; a custom collector turns that snapshot into
  gauges and counters at scrape time, so the engine's own cumulative counters are the single source of truth;
* per-request latencies (TTFT, inter-token latency, end-to-end) and finished-request counts are observed on the
  event loop as outputs arrive, i.e. as a client sees them.
"""

from __future__ import annotations

import threading
from typing import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "paged_jax:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket edges (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)

# (metric name without prefix, engine stats key, documentation)
_ENGINE_GAUGES = (
    ("num_requests_running", "num_running", "Number of requests in model execution batches."),
    ("num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
    ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
)
_ENGINE_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    ("num_preemptions", "num_preemptions", "Cumulative number of preemptions from the engine."),
    ("prompt_tokens", "prompt_tokens_total", "Number of prefill tokens processed."),
    ("generation_tokens", "generation_tokens_total", "Number of generation tokens processed."),
)


class _EngineStatsCollector(Collector):
    """Yields gauges/counters from the latest engine stats snapshot (absent keys are skipped, not faked)."""

    def __init__(self, labels: Mapping[str, str]) -> None:
        self._labels = dict(labels)
        self._lock = threading.Lock()
        self._stats: dict[str, float] = {}

    def update(self, stats: Mapping[str, float]) -> None:
        with self._lock:
            self._stats = dict(stats)

    def collect(self) -> Iterable:
        with self._lock:
            stats = dict(self._stats)
        label_names = list(self._labels)
        label_values = list(self._labels.values())
        # A data-parallel engine (paged_jax.data_parallel) reports each replica: one series per replica, labelled
        # engine="<index>" as vLLM labels its DP engines (the total is their sum; stats() also carries it).
        samples = [(label_values, stats)]
        if stats.get("replicas"):
            label_names = label_names + ["engine"]
            samples = [(label_values + [str(index)], replica) for index, replica in enumerate(stats["replicas"])]
        for family_type, specs in ((GaugeMetricFamily, _ENGINE_GAUGES), (CounterMetricFamily, _ENGINE_COUNTERS)):
            for name, key, doc in specs:
                # CounterMetricFamily appends "_total" itself.
                family = family_type(PREFIX + name, doc, labels=label_names)
                for values, source in samples:
                    family.add_metric(values, float(source.get(key, 0.0)))
                yield family


class ServingMetrics:
    """All metrics of one server, in their own registry.

    Args:
      model_name: value of the ``model_name`` label on every metric (as vLLM labels them).
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        labels = {"model_name": model_name}
        self._labels = labels
        self._engine_stats = _EngineStatsCollector(labels)
        self.registry.register(self._engine_stats)
        label_names = list(labels)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            label_names, buckets=TTFT_BUCKETS, registry=self.registry).labels(**labels)
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            label_names, buckets=ITL_BUCKETS, registry=self.registry).labels(**labels)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
            label_names, buckets=E2E_BUCKETS, registry=self.registry).labels(**labels)
        self._request_success = Counter(
            PREFIX + "request_success", "Count of successfully processed requests.",
            label_names + ["finished_reason"], registry=self.registry)

    # Called from the engine thread after every step.
    def update_engine_stats(self, stats: Mapping[str, float]) -> None:
        self._engine_stats.update(stats)

    # Called on the event loop as outputs arrive.
    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.observe(seconds)

    def observe_finished(self, e2e_seconds: float, finish_reasons: Iterable[str | None]) -> None:
        """One finished engine request: its latency once, and one success count per choice, by finish reason."""
        self.e2e_request_latency.observe(e2e_seconds)
        for reason in finish_reasons:
            self._request_success.labels(**self._labels, finished_reason=str(reason)).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry."""
        return generate_latest(self.registry)
