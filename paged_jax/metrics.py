"""The engine's metrics under vLLM's names: which ``EngineCore.stats`` key each gauge and counter reads (the server's
Prometheus collector, ``serving.metrics``, and ``LLM.get_metrics`` share these tables), and vLLM's offline metric
types (``vllm.v1.metrics.reader``: ``Counter``, ``Gauge``, ``Vector``) that ``LLM.get_metrics`` returns."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from paged_jax.spec_decode.verify import per_position

# (metric name without prefix, engine stats key, documentation)
ENGINE_GAUGES = (
    ("num_requests_running", "num_running", "Number of requests in model execution batches."),
    ("num_requests_waiting", "num_waiting", "Number of requests waiting to be processed."),
    ("kv_cache_usage_perc", "kv_cache_usage", "KV-cache usage. 1 means 100 percent usage."),
    # vLLM's name before 0.9, still on its published dashboard: the same value.
    ("gpu_cache_usage_perc", "kv_cache_usage",
     "GPU KV-cache usage. 1 means 100 percent usage. Same as kv_cache_usage_perc (vLLM's older name)."),
)
ENGINE_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    # The host-memory tier's (--kv-offloading-size; 0 without it): vLLM's KV-connector counters.
    ("external_prefix_cache_queries", "external_prefix_cache_queries",
     "External prefix cache queries (the host KV tier), in terms of number of queried tokens."),
    ("external_prefix_cache_hits", "external_prefix_cache_hits",
     "External prefix cache hits (the host KV tier), in terms of number of cached tokens."),
    ("num_preemptions", "num_preemptions", "Cumulative number of preemption from the engine."),
    ("prompt_tokens", "prompt_tokens_total", "Number of prefill tokens processed."),
    ("generation_tokens", "generation_tokens_total", "Number of generation tokens processed."),
)
# Only with speculative decoding (their keys are in the stats then); the per-position counter has a ``position``
# label (``SPEC_DECODE_PER_POS``).
SPEC_DECODE_COUNTERS = (
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Number of accepted tokens."),
)
SPEC_DECODE_PER_POS = ("spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.")
# Only with --enable-expert-load-metrics: a counter per (layer, expert) of a mixture-of-experts model; engine stats
# keys ``moe_expert_tokens.<layer>.<expert>`` (``paged_jax.engine.routed_experts.ExpertLoad``).
MOE_EXPERT_TOKENS = ("moe_expert_tokens", "Tokens routed to each expert of each mixture-of-experts layer (a token "
                                          "counts once for each of its top-k experts).")


def expert_load_series(stats: Mapping) -> list[tuple[str, str, int]]:
    """``(layer, expert, tokens)`` of every per-expert counter in engine stats, by layer then expert."""
    out = []
    for key, value in stats.items():
        if key.startswith(MOE_EXPERT_TOKENS[0] + "."):
            _, layer, expert = key.rsplit(".", 2)
            out.append((layer, expert, int(value)))
    return sorted(out, key=lambda entry: (int(entry[0]), int(entry[1])))


@dataclasses.dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclasses.dataclass
class Counter(Metric):
    value: int


@dataclasses.dataclass
class Gauge(Metric):
    value: float


@dataclasses.dataclass
class Vector(Metric):
    """A counter per position (vLLM's ``Vector``: ``spec_decode_num_accepted_tokens_per_pos``)."""

    values: list[int]


def metrics_from_stats(stats: Mapping, prefix: str = "vllm") -> list[Metric]:
    """The engine's gauges and counters from one ``stats()`` snapshot, named ``<prefix>:<vLLM's name>`` (labels:
    ``engine``)."""
    labels = {"engine": "0"}
    out: list[Metric] = [Gauge(f"{prefix}:{name}", dict(labels), float(stats.get(key, 0.0)))
                         for name, key, _ in ENGINE_GAUGES]
    out += [Counter(f"{prefix}:{name}", dict(labels), int(stats.get(key, 0))) for name, key, _ in ENGINE_COUNTERS]
    if SPEC_DECODE_COUNTERS[0][1] in stats:
        out += [Counter(f"{prefix}:{name}", dict(labels), int(stats[key])) for name, key, _ in SPEC_DECODE_COUNTERS]
        out.append(Vector(f"{prefix}:{SPEC_DECODE_PER_POS[0]}", dict(labels), per_position(stats)))
    out += [Counter(f"{prefix}:{MOE_EXPERT_TOKENS[0]}", dict(labels, layer=layer, expert=expert), tokens)
            for layer, expert, tokens in expert_load_series(stats)]
    return out
