"""GPU kernel time by kernel name, from a jax.profiler trace of a callable (benchmarks' ``--trace`` options).

Used to see where a step's device time goes (which small fusions add up) without a GUI: the trace is written to a
temporary directory, read back with ``jax.profiler.ProfileData`` and summed per kernel name.
"""

from __future__ import annotations

import contextlib
import os


def trace_kernels(loop, steps_per_loop: int, top: int) -> dict:
    """Run ``loop`` (``steps_per_loop`` forwards) under ``jax.profiler`` and sum device-side events by name.

    Returns ``busy_us_per_step`` (sum of kernel durations), ``span_us_per_step`` (first kernel start to last kernel
    end, over all device lines), ``kernels_per_step`` and the ``top`` names by time. Device planes are those whose
    name starts with ``/device:GPU`` (on CPU there are none: empty result)."""
    loop()  # warm
    with kernel_trace(steps_per_loop, top) as summary:
        loop()
    return summary


@contextlib.contextmanager
def kernel_trace(steps: int, top: int, keep_dir: str | None = None):
    """Trace the ``with`` body under ``jax.profiler``; on exit the yielded dict holds ``trace_kernels``' summary of
    the device kernels it ran, per ``steps`` (1: totals over the body). ``keep_dir``: write the profile there and
    keep it (host and device planes, for XProf); otherwise into a temporary directory."""
    import tempfile

    import jax

    summary: dict = {}
    with contextlib.nullcontext(keep_dir) if keep_dir else tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            yield summary
        summary.update(_summarize(trace_dir, steps, top))


def _summarize(trace_dir: str, steps: int, top: int) -> dict:
    from jax.profiler import ProfileData

    paths = [os.path.join(d, f) for d, _, files in os.walk(trace_dir) for f in files if f.endswith(".xplane.pb")]
    if not paths:
        return {"error": "no xplane.pb written"}
    data = ProfileData.from_file(paths[0])
    by_name: dict[str, list[float]] = {}
    starts, ends = [], []
    line_names = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            line_names.append(f"{plane.name}: {line.name}")
            # Kernel lines; XLA op / module annotation lines duplicate the same time under other names.
            if "XLA Ops" in line.name or "XLA Modules" in line.name or "Steps" in line.name:
                continue
            for ev in line.events:
                by_name.setdefault(ev.name, []).append(ev.duration_ns / 1e3)
                starts.append(ev.start_ns)
                ends.append(ev.end_ns)
    total = sum(sum(v) for v in by_name.values())
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {
        "busy_us_per_step": round(total / steps, 1),
        "span_us_per_step": round((max(ends) - min(starts)) / 1e3 / steps, 1) if starts else 0.0,
        "kernels_per_step": round(sum(len(v) for v in by_name.values()) / steps, 1),
        "lines": line_names,
        "top": [{"name": n, "us_per_step": round(sum(v) / steps, 1),
                 "count_per_step": round(len(v) / steps, 2)} for n, v in ranked[:top]],
    }
