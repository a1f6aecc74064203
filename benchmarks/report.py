"""What every benchmark writes beside its figures: the software versions and commit, and the JSON result file.

No jax import at module level: ``benchmarks.throughput`` times start-up from before jax is imported.
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import subprocess
import sys
import time
from typing import Any
from collections.abc import Callable


def versions() -> dict:
    """jax / jaxlib / flax / Python versions, the first device's kind, the backend and the short git commit."""
    import flax
    import jax
    import jaxlib

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
            "python": platform.python_version(), "device": str(jax.devices()[0].device_kind),
            "backend": jax.default_backend(), "commit": commit or None}


def write_json(path: str | None, result: Any, indent: int = 1) -> None:
    """Write ``result`` as JSON to ``path`` (a benchmark's ``--out``); nothing when ``path`` is None or empty."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=indent)


def median_seconds(fn: Callable[[], Any], repeats: int, *, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` timed calls, after ``warmup`` untimed ones (compilation and
    first-call effects stay out). Each call's result is waited for (``jax.block_until_ready``), so ``fn`` may
    return device arrays, a pytree of them, or anything else."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def show_engine_logs() -> None:
    """The engine's INFO lines (KV sizing, compiles) on stderr, as ``paged-jax serve`` shows them: a benchmark's
    log then says how its pool was sized."""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")


def speculation_stats(stats: dict, before: dict) -> dict:
    """vLLM's speculative-decoding counters over the timed run (engine ``stats`` less those ``before`` it:
    ``spec_decode_num_drafts``, ``_num_draft_tokens``, ``_num_accepted_tokens``, per position) and the mean
    acceptance length (1 + accepted / drafts; None without drafts)."""
    from paged_jax.spec_decode.verify import STATS_PREFIX, mean_acceptance_length

    timed = {key: value - before.get(key, 0) for key, value in stats.items() if key.startswith(STATS_PREFIX)}
    return {**timed, "mean_acceptance_length": mean_acceptance_length(timed)}
