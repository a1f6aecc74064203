"""``python -m benchmarks.quantization --sections sweep``: every quantized matmul implementation
(``models.quantization.linear.MATMUL_IMPLS``) side by side on the Llama-3.1-8B projections, the blocked GEMV's
tuning grid, and what ``matmul_impl="auto"`` should run per (format, M bucket).

Per (format, M, projection) the variants are: XLA's paths (``xla``: int dequantize + dot on packed words, fp8 the
float8 dot on per-token quantized activations; ``xla_native``: int4 / int8 storage dequantized in the dot's operand,
fp8 upcast in the operand; ``xla_native_grouped``: a dot per group on the raw integers), the "pallas" kernel with
its table's configuration, and at M = 1 the blocked GEMV ("pallas_blocked") over <= ``--sweep-configs``
configurations; and the bf16 dot of the same shape as the reference.

Timing (one figure = one compiled function): ``copies`` different weight tensors of the projection (like layers;
together >= ``4 x`` the 60 MB L2 cache, 8-32 copies) each multiplied by its own fresh random activations inside one
jit (one dispatch; the matmuls do not share an input, so XLA cannot merge them); ``--inner`` dispatches back to back,
one wait, median of ``--repeats``; time per matmul = that / copies; GB/s = bytes the matmul must read (packed
weights + scales + zeros, fp8 weights + scales, bf16 weights) / time per matmul. Each group's variants are lowered
one by one and compiled concurrently (``--compile-threads``); a group is not started once ``--budget-s`` is spent
(reported as ``skipped``).

Output lines (JSON): ``sweep`` per variant; ``sweep_best`` per (format, M, projection) with the winner and the
blocked GEMV's best configuration as a ``BLOCKED_TUNING`` entry; ``sweep_auto`` per (format, M bucket) with each
implementation's time summed over the projections (its best configuration per projection) and the choice;
``sweep_auto_table`` with ``AUTO_IMPL`` entries to paste (one storage per int format: the one with the smaller summed
time over the swept M), and ``BLOCKED_TUNING`` bucket entries (the configuration best summed over projections).
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import time

L2_BYTES = 60 * 1024 * 1024


def blocked_grid(fmt: str, limit: int) -> list[dict]:
    """<= ``limit`` configurations of the blocked GEMV (``split_k`` None = ``blocked_tuning``'s)."""
    keys = ("block_n", "block_k", "steps", "num_warps", "num_stages")
    if fmt == "fp8":
        # The tensor-core path (dot_rows 16) at 4 warps over tiles x K shares (None: the table's), then the CUDA-core
        # path (dot_rows 0); ordered so that any limit tries both paths.
        tiles = [(64, 256, 1, 4, 3), (128, 256, 1, 4, 3), (256, 256, 1, 4, 4), (64, 256, 2, 4, 3),
                 (128, 128, 2, 4, 3), (256, 128, 1, 4, 4)]
        dot = [dict(zip(keys, tile), split_k=split, dot_rows=16) for split in (None, 4, 16) for tile in tiles]
        cuda_cores = [dict(zip(keys, c), dot_rows=0) for c in ((16, 512, 2, 4, 3), (32, 256, 2, 4, 3))]
        return (dot[:2] + cuda_cores + dot[2:])[:limit]
    scale = 1 if fmt == "int4" else 2  # int8 words hold 4 rows: half the rows for the same bytes per step
    combos = [(bn, bk // scale, st, w, s) for bn, bk, st, w, s in (
        (128, 128, 2, 4, 3), (128, 128, 1, 4, 4), (256, 128, 2, 8, 3), (64, 128, 2, 2, 3),
        (128, 64, 4, 4, 3), (256, 64, 2, 4, 3), (128, 128, 4, 8, 2), (64, 64, 4, 2, 4))]
    return [dict(zip(keys, c)) for c in combos[:limit]]


def _entry(key: tuple, config: dict) -> str:
    names = ("block_n", "block_k", "steps", "split_k", "num_warps", "num_stages") + (
        ("dot_rows",) if "dot_rows" in config else ())
    knobs = ", ".join(f"{k}={config.get(k)!r}" for k in names)
    return f"{key!r}: dict({knobs}),"


def _copies(bytes_per_copy: int, tiny: bool) -> int:
    if tiny:
        return 2
    return max(8, min(32, math.ceil(4 * L2_BYTES / bytes_per_copy)))


def _make_weights(fmt: str, k: int, n: int, copies: int, seed: int):
    """``copies`` random weight sets of ``fmt`` on the device: ``(packed, native, bytes read per matmul)``; every
    integer value, scale and zero point random (int), N(0, 1) values cast to e4m3 in ``Fp8Linear``'s [N, K]
    layout (fp8), N(0, 1) (bf16)."""
    import jax
    import jax.numpy as jnp

    from models.quantization import native

    keys = jax.random.split(jax.random.key(seed), copies)
    if fmt == "bf16":
        make = jax.jit(lambda key: jax.random.normal(key, (k, n), jnp.bfloat16))
        weights = [(make(key),) for key in keys]
        return weights, None, k * n * 2
    if fmt == "fp8":
        make = jax.jit(lambda key: (jax.random.normal(key, (n, k), jnp.float32).astype(jnp.float8_e4m3fn),
                                    jax.random.uniform(key, (n,), jnp.float32, 1e-3, 2e-2)))
        weights = [make(key) for key in keys]
        return weights, weights, k * n + n * 4
    bits = int(fmt[3:])
    groups = k // 128 if bits == 4 else 1
    rows = k * bits // 32

    def make(key):
        kq, ks, kz = jax.random.split(key, 3)
        qweight = jax.lax.bitcast_convert_type(jax.random.bits(kq, (rows, n), jnp.uint32), jnp.int32)
        scales = jax.random.uniform(ks, (groups, n), jnp.float32, 1e-3, 5e-2).astype(jnp.bfloat16)
        zeros = jax.random.randint(kz, (groups, n), 0, 1 << bits).astype(jnp.bfloat16)
        return qweight, scales, zeros

    make = jax.jit(make)
    packed = [make(key) for key in keys]
    to_native = jax.jit(functools.partial(native.packed_to_native, bits=bits))
    natives = [(to_native(q), s, z) for q, s, z in packed]
    return packed, natives, rows * n * 4 + 2 * groups * n * 2


def _variants(fmt: str, m: int, k: int, args) -> list[tuple[str, dict | None, object, str]]:
    """``(impl, config, matmul(x, *weights) -> y, weights kind "packed" | "native")`` of one cell."""
    import jax
    import jax.numpy as jnp

    from models.quantization import native
    from models.quantization.linear import quantize_activations_fp8, weight_only_matmul_reference
    from paged_jax.ops.quantized_gemv import fp8_gemv_blocked, weight_only_gemv_blocked
    from paged_jax.ops.quantized_matmul import fp8_weight_only_matmul_pallas, weight_only_matmul_pallas

    interpret = args.interpret
    if fmt == "bf16":
        return [("bf16", None, lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype),
                 "packed")]
    grid = blocked_grid(fmt, args.sweep_configs) if m == 1 else []
    if args.tiny:
        grid = grid[:2]
    if fmt == "fp8":
        def float8_dot(x, w, s):
            x_q, x_scale = quantize_activations_fp8(x, "dynamic_token")
            y = jax.lax.dot_general(x_q, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            return (y * x_scale * s).astype(x.dtype)

        out = [("xla", None, float8_dot, "packed"), ("xla_native", None, native.fp8_upcast_matmul, "packed"),
               ("pallas", None, functools.partial(fp8_weight_only_matmul_pallas, interpret=interpret), "packed")]
        out += [("pallas_blocked", cfg, functools.partial(fp8_gemv_blocked, interpret=interpret, **cfg), "packed")
                for cfg in grid]
        return out
    bits = int(fmt[3:])
    gs = 128 if bits == 4 else k
    kw = dict(bits=bits, group_size=gs)
    out = [("xla", None, lambda x, q, s, z: weight_only_matmul_reference(x, q, s, z, None, **kw), "packed"),
           ("xla_native", None, lambda x, q, s, z: native.native_matmul(x, q, s, z, None, **kw), "native"),
           ("xla_native_grouped", None, lambda x, q, s, z: native.native_grouped_matmul(x, q, s, z, None, **kw),
            "native"),
           ("pallas", None, lambda x, q, s, z: weight_only_matmul_pallas(x, q, s, z, None, interpret=interpret,
                                                                         **kw), "packed")]
    out += [("pallas_blocked", cfg, functools.partial(
        lambda x, q, s, z, cfg: weight_only_gemv_blocked(x, q, s, z, None, interpret=interpret, **kw, **cfg),
        cfg=cfg), "packed") for cfg in grid]
    return out


def section_sweep(args, results, copy_gbps, emit, shapes):
    """The ``sweep`` section over ``shapes`` (``(name, K, N)`` projections); ``emit(results, row)`` prints and
    keeps each JSON row."""
    import jax
    import jax.numpy as jnp

    from models.quantization.linear import FLOAT8_DOT_COMPILER_OPTIONS
    from paged_jax.ops.quantized_matmul_tuning import M_BUCKETS, NATIVE_IMPLS, m_bucket

    formats = [f for f in args.formats.split(",") if f] + (["bf16"] if args.sweep_bf16 else [])
    # M = 1 first (the batch-1 decode target), then larger M; formats in the order given.
    cells = [(m, fmt, shape) for m in args.batches for fmt in formats for shape in shapes]
    planned = sum(len(_variants(fmt, m, shape[1], args)) for m, fmt, shape in cells)
    start = time.perf_counter()
    compiled = 0
    emit(results, {"section": "sweep_plan", "cells": len(cells), "compiles": planned, "budget_s": args.budget_s})
    best_times: dict = {}  # (fmt, m, name) -> {impl: (seconds, config)}
    weights_cache: dict = {}
    pool = concurrent.futures.ThreadPoolExecutor(max(1, args.compile_threads))
    for m, fmt, (name, k, n) in cells:
        variants = _variants(fmt, m, k, args)
        elapsed = time.perf_counter() - start
        if elapsed > args.budget_s:
            emit(results, {"section": "sweep", "format": fmt, "m": m, "name": name, "skipped": "budget",
                           "elapsed_s": elapsed})
            continue
        if (fmt, name) not in weights_cache:  # kept for the next M (a few GB in all)
            weights_cache[(fmt, name)] = _make_weights(fmt, k, n, _copies_for(fmt, k, n, args), seed=k + n)
        packed, natives, read = weights_cache[(fmt, name)]
        copies = len(packed)
        xs = tuple(jax.random.normal(jax.random.key(100 + i), (m, k), jnp.bfloat16) for i in range(copies))

        def many(matmul):  # FP8 programs compile as the engine compiles a model with float8 dots (upcast dots too)
            return jax.jit(lambda xs, ws: tuple(matmul(x, *w) for x, w in zip(xs, ws)),
                           compiler_options=FLOAT8_DOT_COMPILER_OPTIONS if fmt == "fp8" else None)

        lowered = []
        for impl, cfg, matmul, kind in variants:
            ws = natives if kind == "native" else packed
            if impl == "pallas_blocked" and _blocked_config(fmt, k, n, cfg) is None:
                compiled += 1
                emit(results, {"section": "sweep", "format": fmt, "m": m, "name": name, "impl": impl,
                               "grid_config": cfg, "skipped": "does not tile the shape"})
                continue
            try:
                lowered.append((impl, cfg, ws, many(matmul).lower(xs, ws)))
            except Exception as exc:  # a configuration the lowering refuses: reported, skipped
                emit(results, {"section": "sweep", "format": fmt, "m": m, "name": name, "impl": impl,
                               "config": cfg, "error": repr(exc)[:300]})
        futures = [pool.submit(low.compile) for *_, low in lowered]
        base = {"section": "sweep", "format": fmt, "m": m, "name": name, "k": k, "n": n, "bytes_read": read,
                "copies": copies, "copy_GBps": copy_gbps}
        cell = best_times.setdefault((fmt, m, name), {})
        for (impl, cfg, ws, _), future in zip(lowered, futures):
            compiled += 1
            try:
                exe = future.result()
                t = _median_per_matmul(exe, xs, ws, copies, args.repeats, args.inner)
            except Exception as exc:  # a configuration Triton cannot compile: reported, skipped
                emit(results, {**base, "impl": impl, "config": cfg, "error": repr(exc)[:300]})
                continue
            effective = _blocked_config(fmt, k, n, cfg) if impl == "pallas_blocked" else None
            gbps = read / t / 1e9
            emit(results, {**base, "impl": impl, "config": effective, "grid_config": cfg, "us": t * 1e6,
                           "GBps": gbps, "fraction_of_copy": gbps / copy_gbps if copy_gbps else None})
            if impl not in cell or t < cell[impl][0]:
                cell[impl] = (t, effective, cfg)
        elapsed = time.perf_counter() - start
        left = planned - compiled
        emit(results, {"section": "sweep_progress", "done_compiles": compiled, "planned": planned,
                       "elapsed_s": round(elapsed, 1), "estimated_left_s": round(elapsed / max(1, compiled) * left, 1)})
        if fmt != "bf16" and cell:
            winner = min(cell, key=lambda i: cell[i][0])
            row = {"section": "sweep_best", "format": fmt, "m": m, "name": name, "k": k, "n": n, "winner": winner,
                   "us": {i: round(v[0] * 1e6, 2) for i, v in cell.items()},
                   "GBps": {i: round(read / v[0] / 1e9, 1) for i, v in cell.items()}}
            if "pallas_blocked" in cell and cell["pallas_blocked"][1] is not None:
                row["blocked_entry"] = _entry((fmt, k, n), cell["pallas_blocked"][1])
            emit(results, row)
    pool.shutdown()
    _auto_table(results, emit, best_times, formats, args.batches, shapes, M_BUCKETS, NATIVE_IMPLS, m_bucket)


def _blocked_config(fmt: str, k: int, n: int, cfg: dict) -> dict | None:
    """The blocked GEMV's effective knobs for a grid configuration (None: it would fall back to "pallas")."""
    from paged_jax.ops.quantized_gemv import blocked_tuning

    return blocked_tuning(fmt, n, k, group_size=128 if fmt == "int4" else None, **cfg)


def _copies_for(fmt: str, k: int, n: int, args) -> int:
    per_copy = {"bf16": 2 * k * n, "fp8": k * n}[fmt] if fmt in ("bf16", "fp8") else k * n * int(fmt[3:]) // 8
    return _copies(per_copy, args.tiny)


def _median_per_matmul(exe, xs, ws, copies: int, repeats: int, inner: int) -> float:
    import jax
    import numpy as np

    jax.block_until_ready(exe(xs, ws))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(inner):
            out = exe(xs, ws)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / inner / copies)
    return float(np.median(times))


def _auto_table(results, emit, best_times, formats, batches, shapes, buckets, native_impls, m_bucket):
    """``sweep_auto`` per (format, M) and the ``AUTO_IMPL`` / ``BLOCKED_TUNING`` bucket entries. The fp8 entries also
    serve weight-only layers, whose "xla" is the upcast dot, so they name weight-only paths only; the float8 dot
    ("xla", timed with quantized activations) gets its own suggestion, ``FP8_DOT_MIN_ROWS``: the smallest swept M from
    which it beats the best weight-only path at every swept M (None: nowhere)."""
    from paged_jax.ops.quantized_matmul_tuning import AUTO_IMPL as current_auto

    entries = []
    for fmt in formats:
        if fmt == "bf16":
            continue
        totals = {}  # m -> {impl: summed seconds over the projections}
        for m in batches:
            cells = [best_times.get((fmt, m, name), {}) for name, _, _ in shapes]
            impls = set.intersection(*(set(c) for c in cells)) if cells and all(cells) else set()
            totals[m] = {impl: sum(c[impl][0] for c in cells) for impl in impls}
            if totals[m]:
                emit(results, {"section": "sweep_auto", "format": fmt, "m": m,
                               "total_us_over_projections": {i: round(t * 1e6, 2) for i, t in totals[m].items()},
                               "best": min(totals[m], key=totals[m].get)})
        measured = [m for m in batches if totals.get(m)]
        if not measured:
            continue
        storages = ["packed"] if fmt == "fp8" else ["packed", "native"]

        def in_storage(impl, storage):
            if fmt == "fp8":
                return impl != "xla"
            return (impl in native_impls) == (storage == "native")

        def storage_total(storage):
            return sum(min((t for i, t in totals[m].items() if in_storage(i, storage)), default=math.inf)
                       for m in measured)

        storage = min(storages, key=storage_total)
        for bucket in buckets:
            ms = [m for m in measured if m_bucket(m) == bucket]
            if ms:
                options = {i: t for i, t in totals[ms[0]].items() if in_storage(i, storage)}
                impl = min(options, key=options.get)
            else:  # not swept: the table's current choice when it reads the chosen storage, else XLA in it
                impl = current_auto.get((fmt, bucket), "xla")
                if not in_storage(impl, storage):
                    impl = "xla_native" if storage == "native" or fmt == "fp8" else "xla"
            entries.append(f"({fmt!r}, {bucket}): {impl!r},")
        if fmt == "fp8":
            dot_wins = [m for m in measured if "xla" in totals[m] and totals[m]["xla"] < min(
                (t for i, t in totals[m].items() if i != "xla"), default=math.inf)]
            since = [m for m in measured if all(x in dot_wins for x in measured if x >= m)]
            emit(results, {"section": "sweep_auto_table", "FP8_DOT_MIN_ROWS": min(since) if since else None})
        # BLOCKED_TUNING bucket entry: the raw grid configuration with the smallest summed time over projections.
        by_cfg: dict = {}
        for name, _, _ in shapes:
            for row in results:
                if (row.get("section") == "sweep" and row.get("format") == fmt and row.get("m") == 1
                        and row.get("name") == name and row.get("impl") == "pallas_blocked" and "us" in row):
                    key = tuple(sorted(row["grid_config"].items()))
                    total, count = by_cfg.get(key, (0.0, 0))
                    by_cfg[key] = (total + row["us"], count + 1)
        full = {key: v for key, v in by_cfg.items() if v[1] == len(shapes)}
        if full:
            key = min(full, key=lambda c: full[c][0])
            emit(results, {"section": "sweep_auto_table", "format": fmt,
                           "blocked_bucket_entry": _entry((fmt,), {**dict(key), "split_k": None})})
    emit(results, {"section": "sweep_auto_table", "AUTO_IMPL_entries": entries})
