"""Prometheus metrics of one server: vLLM's metric set (v1 engine), with vLLM's names, labels and buckets.

Names are ``<prefix>:<vLLM's name>``: the native prefix is ``paged_jax`` (``paged_jax:num_requests_running``);
``--metrics-prefix vllm`` exports exactly vLLM's names (``vllm:num_requests_running``), so an existing vLLM Grafana
dashboard or alert rule works unchanged. Every metric carries vLLM's labels ``model_name`` (the served model name)
and ``engine`` (``"0"``: one engine per server); ``request_success_total`` adds ``finished_reason``.

Each app owns a ``CollectorRegistry`` (never the process-global one), so several servers in one process (tests)
keep separate counts. Where each value comes from:

* engine state (running / waiting counts, KV usage, prefix-cache and token counters, preemptions, the cache config)
  comes from the latest ``LLMEngine.stats()`` snapshot the engine thread published; a custom collector turns it
  into gauges and counters at scrape time, so the engine's own cumulative counters are the single source of truth.
  ``iteration_tokens_total`` (tokens per engine step, vLLM's "prompt tokens of requests whose prefill completed
  plus tokens generated" in the step) is observed from consecutive per-step snapshots (``update_engine_stats``);
* per-request values are observed on the event loop as outputs arrive (``observe_output``): time to first token and
  inter-token latency as a client sees them (also exported as vLLM's older name ``time_per_output_token_seconds``),
  and, once a request finishes, its end-to-end latency and, from the engine's own timestamps
  (``RequestOutput.metrics``: arrival, first scheduled, first token, last token), the queue, prefill, decode and
  inference times (vLLM's definitions), its token counts and its ``n`` / ``max_tokens``.

Parallel sampling (``n`` > 1) is one engine request with one set of timestamps: the timing histograms are observed
once per request; ``request_success``, ``request_prompt_tokens``, ``request_generation_tokens`` and
``request_params_max_tokens`` once per choice (vLLM counts each of the n sequences as a request of its own);
``request_params_n`` and ``request_max_num_generation_tokens`` (the longest choice) once per request, as vLLM does.
"""

from __future__ import annotations

import re
import threading
from typing import TYPE_CHECKING, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from paged_jax.metrics import (ENGINE_COUNTERS, ENGINE_GAUGES, MOE_EXPERT_TOKENS, SPEC_DECODE_COUNTERS,
                               SPEC_DECODE_PER_POS, expert_load_series)
from paged_jax.spec_decode.verify import per_position

if TYPE_CHECKING:
    from paged_jax.outputs import RequestOutput
    from serving.async_engine import RequestStream

NATIVE_PREFIX = "paged_jax"
VLLM_PREFIX = "vllm"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ENGINE_INDEX = "0"  # vLLM's ``engine`` label: the data-parallel engine index; a server here runs one engine
LABEL_NAMES = ("model_name", "engine")
_PREFIX_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

# vLLM's bucket edges.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
ITERATION_TOKENS = ("iteration_tokens_total", "Histogram of number of tokens per engine_step.")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to ``max_value`` (``build_1_2_5_buckets(100)`` =
    ``[1, 2, 5, 10, 20, 50, 100]``)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def check_prefix(prefix: str) -> str:
    """``prefix`` if it can start a Prometheus metric name (``[a-zA-Z_][a-zA-Z0-9_]*``), else ValueError naming it."""
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"metrics prefix must match [a-zA-Z_][a-zA-Z0-9_]* (e.g. {NATIVE_PREFIX!r} or "
                         f"{VLLM_PREFIX!r}), got {prefix!r}")
    return prefix


class _EngineStatsCollector(Collector):
    """Yields gauges/counters from the latest engine stats snapshot, and ``cache_config_info`` (vLLM's info gauge,
    permanently 1, whose labels are the cache configuration)."""

    def __init__(self, prefix: str, labels: Mapping[str, str], cache_config: Mapping[str, object]) -> None:
        self._prefix = prefix
        self._labels = dict(labels)
        self._cache_config = {key: str(value) for key, value in cache_config.items()}
        self._lock = threading.Lock()
        self._stats: dict[str, float] = {}

    def update(self, stats: Mapping[str, float]) -> None:
        with self._lock:
            self._stats = dict(stats)

    def collect(self) -> Iterable:
        with self._lock:
            stats = dict(self._stats)
        label_names = list(self._labels)
        samples = [(list(labels.values()), source) for labels, source in engine_series(self._labels, stats)]
        spec = [(GaugeMetricFamily, ENGINE_GAUGES), (CounterMetricFamily, ENGINE_COUNTERS)]
        if any(SPEC_DECODE_COUNTERS[0][1] in source for _, source in samples):
            spec.append((CounterMetricFamily, SPEC_DECODE_COUNTERS))
            yield _per_position_family(f"{self._prefix}:{SPEC_DECODE_PER_POS[0]}", label_names, samples)
        if any(expert_load_series(source) for _, source in samples):
            yield _expert_load_family(f"{self._prefix}:{MOE_EXPERT_TOKENS[0]}", label_names, samples)
        for family_type, specs in spec:
            for name, key, doc in specs:
                # CounterMetricFamily appends "_total" itself.
                family = family_type(f"{self._prefix}:{name}", doc, labels=label_names)
                for values, source in samples:
                    family.add_metric(values, float(source.get(key, 0.0)))
                yield family
        info = cache_config_info_labels(self._cache_config, stats, self._labels["engine"])
        family = GaugeMetricFamily(f"{self._prefix}:cache_config_info", CACHE_CONFIG_INFO_DOC, labels=list(info))
        family.add_metric(list(info.values()), 1.0)
        yield family


CACHE_CONFIG_INFO_DOC = "Information of the LLMEngine CacheConfig"


def _per_position_family(name: str, label_names: list[str], samples: list) -> CounterMetricFamily:
    """vLLM's ``spec_decode_num_accepted_tokens_per_pos``: one counter per draft position (label ``position``)."""
    family = CounterMetricFamily(name, SPEC_DECODE_PER_POS[1], labels=[*label_names, "position"])
    for values, source in samples:
        for position, count in enumerate(per_position(source)):
            family.add_metric([*values, str(position)], float(count))
    return family


def _expert_load_family(name: str, label_names: list[str], samples: list) -> CounterMetricFamily:
    """Tokens routed per expert (``--enable-expert-load-metrics``): one counter per layer and expert."""
    family = CounterMetricFamily(name, MOE_EXPERT_TOKENS[1], labels=[*label_names, "layer", "expert"])
    for values, source in samples:
        for layer, expert, tokens in expert_load_series(source):
            family.add_metric([*values, layer, expert], float(tokens))
    return family


def engine_series(labels: Mapping[str, str], stats: Mapping) -> list[tuple[dict[str, str], Mapping]]:
    """``(labels, stats)`` of every engine a stats snapshot describes: the engine itself, or, for a data-parallel
    engine (``paged_jax.parallel.data_parallel``, whose ``stats()`` has ``replicas``), each replica labelled
    ``engine="<index>"`` as vLLM labels its DP engines (the total is their sum; ``stats()`` also carries it)."""
    if not stats.get("replicas"):
        return [(dict(labels), stats)]
    return [({**labels, "engine": str(index)}, replica) for index, replica in enumerate(stats["replicas"])]


def cache_config_info_labels(cache_config: Mapping[str, object], stats: Mapping, engine: str) -> dict[str, str]:
    """The labels of ``cache_config_info``: the cache configuration, and the KV pool's size once the engine sized
    it (its first stats snapshot has it); vLLM labels it the same."""
    info = {key: str(value) for key, value in cache_config.items()}
    for key in ("num_gpu_blocks", "num_cpu_blocks"):
        if key in stats:
            info[key] = str(int(stats[key]))
    info["engine"] = engine
    return info


class StepTokens:
    """The tokens of each engine step (``iteration_tokens_total``) from consecutive stats snapshots: a snapshot
    that follows one ``step()`` (one more step launched, or none launched but tokens resolved: the last step of
    overlapped scheduling) gives that step's prompt + generation tokens; one with no change gives None."""

    def __init__(self) -> None:
        self._last: tuple[float, float] | None = None  # (num_steps, prompt + generation tokens)

    def step_tokens(self, stats: Mapping[str, float]) -> float | None:
        if "num_steps" not in stats:
            return None
        steps = float(stats["num_steps"])
        tokens = float(stats.get("prompt_tokens_total", 0)) + float(stats.get("generation_tokens_total", 0))
        last, self._last = self._last, (steps, tokens)
        if last is not None and (steps == last[0] + 1 or (steps == last[0] and tokens > last[1])):
            return tokens - last[1]
        return None


class ServingMetrics:
    """All metrics of one server, in their own registry.

    Args:
      model_name: value of the ``model_name`` label on every metric (the first served model name, as vLLM).
      max_model_len: the engine's; sets the token-count buckets (vLLM's ``build_1_2_5_buckets(max_model_len)``).
      prefix: the name prefix (``NATIVE_PREFIX`` or ``VLLM_PREFIX``; any ``[a-zA-Z_][a-zA-Z0-9_]*``).
      cache_config: the labels of ``cache_config_info`` (``cache_config_labels(engine_args)``).
      multiprocess: this server is one of several API server processes over one engine process
        (``--api-server-count`` > 1, ``serving.api_servers``): its request-level metrics are written to
        ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode, set up before this process started),
        the engine process records the engine-level ones there (``serving.multiprocess_metrics``), and ``render``
        reports every process's, summed.
    """

    def __init__(self, model_name: str, *, max_model_len: int, prefix: str = NATIVE_PREFIX,
                 cache_config: Mapping[str, object] | None = None, multiprocess: bool = False) -> None:
        self.prefix = check_prefix(prefix)
        self.multiprocess = multiprocess
        self.registry = CollectorRegistry(auto_describe=True)
        self._labels = {"model_name": model_name, "engine": ENGINE_INDEX}
        self._engine_stats = _EngineStatsCollector(self.prefix, self._labels, cache_config or {})
        if not multiprocess:
            self.registry.register(self._engine_stats)
        token_buckets = build_1_2_5_buckets(max_model_len)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{self.prefix}:{name}", doc, LABEL_NAMES, buckets=buckets,
                             registry=self.registry).labels(**self._labels)

        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Histogram of time per output token in seconds (vLLM's older name of inter_token_latency_seconds).",
            ITL_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds",
                                            "Histogram of time spent in WAITING phase for request.",
                                            REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = histogram("request_inference_time_seconds",
                                                "Histogram of time spent in RUNNING phase for request.",
                                                REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = histogram("request_prefill_time_seconds",
                                              "Histogram of time spent in PREFILL phase for request.",
                                              REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = histogram("request_decode_time_seconds",
                                             "Histogram of time spent in DECODE phase for request.",
                                             REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                                               token_buckets)
        self.request_generation_tokens = histogram("request_generation_tokens",
                                                   "Number of generation tokens processed.", token_buckets)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            token_buckets)
        self.request_params_n = histogram("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.request_params_max_tokens = histogram("request_params_max_tokens",
                                                   "Histogram of the max_tokens request parameter.", token_buckets)
        self.iteration_tokens = None if multiprocess else histogram(*ITERATION_TOKENS, ITERATION_TOKENS_BUCKETS)
        self._request_success = Counter(f"{self.prefix}:request_success", "Count of successfully processed requests.",
                                        list(LABEL_NAMES) + ["finished_reason"], registry=self.registry)
        self._step_tokens = StepTokens()  # engine thread

    # --------------------------------------------------------------------- engine thread
    def update_engine_stats(self, stats: Mapping[str, float]) -> None:
        """The engine's latest snapshot: after every engine-loop iteration, and from an engine process after each of
        its steps; each step's tokens go to ``iteration_tokens_total`` (``StepTokens``). With ``multiprocess`` the
        engine process records these itself: nothing to do."""
        if self.multiprocess:
            return
        self._engine_stats.update(stats)
        tokens = self._step_tokens.step_tokens(stats)
        if tokens is not None:
            self.iteration_tokens.observe(tokens)

    # --------------------------------------------------------------------- event loop
    def observe_output(self, stream: RequestStream, output: RequestOutput, now: float) -> None:
        """One (delta) output of ``stream`` reaching the event loop at ``now`` (``time.monotonic()``)."""
        has_new_tokens = False
        completions = output.outputs if isinstance(output.outputs, list) else ()  # a pooling output has none
        for completion in completions:
            if completion.token_ids:
                has_new_tokens = True
                stream.num_generation_tokens[completion.index] = (
                    stream.num_generation_tokens.get(completion.index, 0) + len(completion.token_ids))
            if completion.finish_reason is not None:  # a choice's last output
                stream.finish_reasons.append(completion.finish_reason)
        if has_new_tokens:
            if stream.first_token_time is None:
                stream.first_token_time = now
                self.time_to_first_token.observe(now - stream.arrival_time)
            else:
                self.inter_token_latency.observe(now - stream.last_token_time)
                self.time_per_output_token.observe(now - stream.last_token_time)
            stream.last_token_time = now
        if output.finished:
            self._observe_finished(stream, output, now)

    def _observe_finished(self, stream: RequestStream, output: RequestOutput, now: float) -> None:
        for reason in stream.finish_reasons:
            self._request_success.labels(**self._labels, finished_reason=str(reason)).inc()
        self.e2e_request_latency.observe(now - stream.arrival_time)
        params = stream.params
        n = getattr(params, "n", None) or max(len(stream.finish_reasons), 1)  # PoolingParams: one output
        tokens = [stream.num_generation_tokens.get(index, 0) for index in range(n)]
        for num_tokens in tokens:
            self.request_prompt_tokens.observe(len(output.prompt_token_ids))
            self.request_generation_tokens.observe(num_tokens)
            if getattr(params, "max_tokens", None):
                self.request_params_max_tokens.observe(params.max_tokens)
        self.request_params_n.observe(n)
        self.request_max_num_generation_tokens.observe(max(tokens))
        times = output.metrics
        if times is None or None in (times.first_scheduled_time, times.first_token_time, times.last_token_time):
            return  # finished before it was ever scheduled (e.g. cut short): no phases to measure
        decode_time = times.last_token_time - times.first_token_time
        self.request_queue_time.observe(times.first_scheduled_time - times.arrival_time)
        self.request_prefill_time.observe(times.first_token_time - times.first_scheduled_time)
        self.request_decode_time.observe(decode_time)
        self.request_inference_time.observe(times.last_token_time - times.first_scheduled_time)
        # vLLM's definition: the first token belongs to the prefill; 0 when there is no second token.
        longest = max(tokens)
        self.request_time_per_output_token.observe(decode_time / (longest - 1) if longest > 1 else 0.0)

    def render(self) -> bytes:
        """The Prometheus text exposition of this registry (``multiprocess``: of every process's metrics)."""
        if self.multiprocess:
            return render_multiprocess()
        return generate_latest(self.registry)


def render_multiprocess() -> bytes:
    """The Prometheus text exposition of every process's metrics in ``PROMETHEUS_MULTIPROC_DIR``, merged
    (prometheus_client's multiprocess mode, ``serving.multiprocess_metrics``)."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    return generate_latest(registry)


def cache_config_labels(engine_args) -> dict[str, object]:
    """The labels of ``cache_config_info`` from ``EngineArgs`` (vLLM's ``CacheConfig`` field names; the KV cache
    takes the model's dtype, which vLLM calls ``cache_dtype="auto"``). ``num_gpu_blocks`` / ``num_cpu_blocks`` come
    from the engine's stats once it has sized its pool."""
    return {"block_size": engine_args.block_size, "cache_dtype": "auto",
            "enable_prefix_caching": engine_args.enable_prefix_caching,
            "gpu_memory_utilization": engine_args.gpu_memory_utilization,
            "num_gpu_blocks_override": engine_args.num_gpu_blocks_override,
            "swap_space": engine_args.swap_space, "kv_offloading_size": engine_args.kv_offloading_size,
            "kv_offloading_backend": engine_args.kv_offloading_backend}
