"""The server's two log streams, as vLLM's: one line per received request (``--enable-log-requests``) and the
periodic engine stats line (on unless ``--disable-log-stats``).

``RequestLogger`` logs ``Received request <id>: params: ..., prompt_token_ids: [...]`` (the ids cut at
``--max-log-len``); ``AsyncEngine.add_requests`` calls it for every request it admits.

``StatsLogger`` runs a daemon thread that wakes every ``PAGED_JAX_LOG_STATS_INTERVAL`` seconds (default 10, vLLM's
``VLLM_LOG_STATS_INTERVAL``) and, from the latest engine stats the engine thread published, logs

    Engine 000: Avg prompt throughput: X tokens/s, Avg generation throughput: Y tokens/s, Running: N reqs,
    Waiting: M reqs, GPU KV cache usage: Z%, Prefix cache hit rate: W%[, External prefix cache hit rate: V%]

at INFO while there is activity (tokens in this interval or the previous one, or requests running / waiting) and at
DEBUG when idle, like vLLM ("Engine 000": the engine index, as vLLM's ``engine`` metric label). Throughputs are over
the interval; the hit rate is over every prefix-cache query since start (tokens; vLLM's is over its last 1000
requests, which the engine's cumulative counters cannot delimit). The thread ends with the engine
(``AsyncEngine.shutdown``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Mapping

from serving.metrics import ENGINE_INDEX

logger = logging.getLogger(__name__)

LOG_STATS_INTERVAL_ENV = "PAGED_JAX_LOG_STATS_INTERVAL"
DEFAULT_LOG_STATS_INTERVAL_S = 10.0


# Libraries that log routine detail at INFO (orbax through absl: every checkpoint step; JAX: backends it did not
# find); the server's own INFO lines stay readable with these at WARNING.
CHATTY_LOGGERS = ("absl", "jax._src.xla_bridge")


def quiet_library_loggers() -> None:
    """Raise the chatty libraries' loggers to WARNING (the server's own loggers keep their level)."""
    for name in CHATTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


class RequestLogger:
    """Logs one INFO line per request. ``max_log_len``: most prompt token ids shown (None: all)."""

    def __init__(self, max_log_len: int | None = None) -> None:
        self.max_log_len = max_log_len

    def log(self, request_id: str, prompt: Any, params: Any) -> None:
        if isinstance(prompt, str):
            shown = repr(prompt if self.max_log_len is None else prompt[:self.max_log_len])
            logger.info("Received request %s: prompt: %s, params: %s", request_id, shown, params)
            return
        ids = list(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)  # a dict: with cache_salt
        shown_ids = ids if self.max_log_len is None else ids[:self.max_log_len]
        logger.info("Received request %s: params: %s, prompt_token_ids: %s (%d tokens)", request_id, params,
                    shown_ids, len(ids))


def format_stats_line(stats: Mapping[str, float], prompt_throughput: float, generation_throughput: float) -> str:
    """vLLM's stats line from an engine ``stats()`` snapshot and the interval's throughputs (tokens/s)."""
    queries = float(stats.get("prefix_cache_queries", 0))
    hit_rate = float(stats.get("prefix_cache_hits", 0)) / queries if queries else 0.0
    return (f"Engine {int(ENGINE_INDEX):03d}: Avg prompt throughput: {prompt_throughput:.1f} tokens/s, "
            f"Avg generation throughput: {generation_throughput:.1f} tokens/s, "
            f"Running: {int(stats.get('num_running', 0))} reqs, Waiting: {int(stats.get('num_waiting', 0))} reqs, "
            f"GPU KV cache usage: {100 * float(stats.get('kv_cache_usage', 0.0)):.1f}%, "
            f"Prefix cache hit rate: {100 * hit_rate:.1f}%" + _external_hit_rate(stats))


def _external_hit_rate(stats: Mapping[str, float]) -> str:
    """vLLM's addition to the line with a KV connector, here the host tier (``--kv-offloading-size``)."""
    if "external_prefix_cache_queries" not in stats:
        return ""
    queries = float(stats["external_prefix_cache_queries"])
    hits = float(stats.get("external_prefix_cache_hits", 0)) / queries if queries else 0.0
    return f", External prefix cache hit rate: {100 * hits:.1f}%"


class StatsLogger:
    """Logs the stats line every ``interval_s`` from ``read_stats()`` (the engine's latest snapshot) until
    ``is_done()`` (the engine stopped) or ``stop()``.

    ``log(now)`` does one interval's work (the thread calls it; tests call it directly with their own clock).
    """

    def __init__(self, read_stats: Callable[[], Mapping[str, float]], *, interval_s: float | None = None,
                 is_done: Callable[[], bool] = lambda: False, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s is None:
            interval_s = float(os.environ.get(LOG_STATS_INTERVAL_ENV, DEFAULT_LOG_STATS_INTERVAL_S))
        if interval_s <= 0:
            raise ValueError(f"{LOG_STATS_INTERVAL_ENV} must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._read_stats = read_stats
        self._is_done = is_done
        self._clock = clock
        self._last_time = clock()
        self._last_totals = (0.0, 0.0)  # prompt, generation tokens at the last line
        self._last_throughputs = (0.0, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paged-jax-stats-logger", daemon=True)

    def start(self) -> "StatsLogger":
        """Start the thread; the first interval counts from now (tokens served before are not in it)."""
        stats = self._read_stats()
        self._last_totals = (float(stats.get("prompt_tokens_total", 0)),
                             float(stats.get("generation_tokens_total", 0)))
        self._last_time = self._clock()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            if self._is_done():
                return
            self.log()

    def log(self, now: float | None = None) -> str:
        """Log (and return) the line for the interval since the previous call."""
        now = self._clock() if now is None else now
        stats = dict(self._read_stats())
        totals = (float(stats.get("prompt_tokens_total", 0)), float(stats.get("generation_tokens_total", 0)))
        elapsed = max(now - self._last_time, 1e-9)
        throughputs = ((totals[0] - self._last_totals[0]) / elapsed, (totals[1] - self._last_totals[1]) / elapsed)
        active = (any(throughputs) or any(self._last_throughputs)
                  or stats.get("num_running", 0) or stats.get("num_waiting", 0))
        line = format_stats_line(stats, *throughputs)
        logger.log(logging.INFO if active else logging.DEBUG, line)
        self._last_time, self._last_totals, self._last_throughputs = now, totals, throughputs
        return line
