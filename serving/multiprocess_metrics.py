"""``/metrics`` when several API server processes share one engine process (``--api-server-count`` > 1): every
server reports the whole system, with the same names as one server (``serving.metrics``).

vLLM's way: prometheus_client's multiprocess mode. The launcher (``serving.api_servers``) points
``PROMETHEUS_MULTIPROC_DIR`` at a fresh temporary directory (or keeps the user's own) before it starts any process,
so every process it starts writes its metric values to memory-mapped files there (one file per process and metric
type), and ``/metrics`` on any server merges them all (``serving.metrics.render_multiprocess``: histograms and counters
summed):

* request-level metrics (TTFT, inter-token latency, e2e latency, the phase times, token counts, ``request_success``)
  are each API server's own (``ServingMetrics(multiprocess=True)``), observed as its event loop sees its streams;
  summed over the servers;
* engine-level metrics (running / waiting requests, KV usage, the prefix-cache, token and preemption counters,
  ``cache_config_info``, ``iteration_tokens_total``) are recorded by the engine process itself
  (``EngineProcessMetrics``, after each step): a server only hears from the engine while it has requests there, so
  its own snapshot of the engine can be old; the engine process's is current. Gauges use
  ``multiprocess_mode="mostrecent"`` (one writer), counters grow by each snapshot's increase of the engine's
  cumulative count.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from typing import Iterator, Mapping

from prometheus_client import Counter, Gauge, Histogram, values

from paged_jax.metrics import ENGINE_COUNTERS, ENGINE_GAUGES
from serving.metrics import (CACHE_CONFIG_INFO_DOC, ENGINE_INDEX, ITERATION_TOKENS, ITERATION_TOKENS_BUCKETS,
                             LABEL_NAMES, StepTokens, cache_config_info_labels, check_prefix, engine_series)

logger = logging.getLogger(__name__)

MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def check_multiprocess_mode() -> None:
    """RuntimeError unless prometheus_client writes this process's values to ``PROMETHEUS_MULTIPROC_DIR`` (the
    variable must be set before prometheus_client is first imported: the launcher sets it before it starts a
    process)."""
    if not os.environ.get(MULTIPROC_DIR_ENV) or values.ValueClass.__name__ != "MmapedValue":
        raise RuntimeError(f"metrics of several API servers need {MULTIPROC_DIR_ENV} set before prometheus_client "
                           "is imported (serving.api_servers sets it before it starts the processes)")


@contextlib.contextmanager
def multiprocess_dir() -> Iterator[str]:
    """``PROMETHEUS_MULTIPROC_DIR`` for the processes started inside the block (they inherit the environment): the
    user's own directory if set (as vLLM: it must be emptied between runs), else a temporary one, deleted at the end
    (and the variable unset again)."""
    user_dir = os.environ.get(MULTIPROC_DIR_ENV)
    if user_dir:
        logger.warning("%s=%s is set: its metric files are kept; empty it between runs or /metrics adds up old "
                       "runs' values (unset it and a temporary directory is used and removed)", MULTIPROC_DIR_ENV,
                       user_dir)
        os.makedirs(user_dir, exist_ok=True)
        yield user_dir
        return
    with tempfile.TemporaryDirectory(prefix="paged-jax-metrics-") as path:
        os.environ[MULTIPROC_DIR_ENV] = path
        try:
            yield path
        finally:
            os.environ.pop(MULTIPROC_DIR_ENV, None)


class EngineProcessMetrics:
    """The engine-level metrics, recorded by the engine process from its stats after each step (multiprocess mode).

    Args:
      model_name: the ``model_name`` label (the first served model name, as the servers' own metrics).
      prefix: the names' prefix (``--metrics-prefix``).
      cache_config: the labels of ``cache_config_info`` (``serving.metrics.cache_config_labels(engine_args)``).
    """

    def __init__(self, model_name: str, *, prefix: str, cache_config: Mapping[str, object]) -> None:
        check_multiprocess_mode()
        self._prefix = check_prefix(prefix)
        self._labels = {"model_name": model_name, "engine": ENGINE_INDEX}
        self._cache_config = dict(cache_config)
        # registry=None: nothing here is collected in-process; the servers read the files.
        self._gauges = [(key, Gauge(f"{prefix}:{name}", doc, LABEL_NAMES, multiprocess_mode="mostrecent",
                                    registry=None)) for name, key, doc in ENGINE_GAUGES]
        self._counters = [(key, Counter(f"{prefix}:{name}", doc, LABEL_NAMES, registry=None))
                          for name, key, doc in ENGINE_COUNTERS]
        self._counted: dict[tuple[str, str], float] = {}  # (stats key, engine label) -> value counted so far
        self._iteration_tokens = Histogram(f"{prefix}:{ITERATION_TOKENS[0]}", ITERATION_TOKENS[1], LABEL_NAMES,
                                           buckets=ITERATION_TOKENS_BUCKETS, registry=None).labels(**self._labels)
        self._step_tokens = StepTokens()
        self._info_set = False

    def update(self, stats: Mapping[str, float]) -> None:
        """The engine's stats after a step (or after commands that left it idle)."""
        for labels, source in engine_series(self._labels, stats):
            for key, gauge in self._gauges:
                gauge.labels(**labels).set(float(source.get(key, 0.0)))
            for key, counter in self._counters:
                value = float(source.get(key, 0.0))
                counted = self._counted.get((key, labels["engine"]), 0.0)
                child = counter.labels(**labels)  # exported from the first snapshot on, at 0 until it grows
                if value > counted:
                    child.inc(value - counted)
                    self._counted[(key, labels["engine"])] = value
        tokens = self._step_tokens.step_tokens(stats)
        if tokens is not None:
            self._iteration_tokens.observe(tokens)
        if not self._info_set and "num_gpu_blocks" in stats:  # the engine is built: its pool size is final
            info = cache_config_info_labels(self._cache_config, stats, self._labels["engine"])
            Gauge(f"{self._prefix}:cache_config_info", CACHE_CONFIG_INFO_DOC, list(info),
                  multiprocess_mode="mostrecent", registry=None).labels(**info).set(1.0)
            self._info_set = True
