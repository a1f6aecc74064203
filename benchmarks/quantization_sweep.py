"""``python -m benchmarks.quantization --sections sweep``: the tuning grid of the skinny-M quantized matmul kernels
(``paged_jax.ops.quantized_matmul``) on the Llama-3.1-8B projections, and the best configurations as entries of
``paged_jax.ops.quantized_matmul_tuning.TUNING`` (see ``benchmarks/quantization.py`` for the section's contract).

Each configuration is one compile (the kernels are jitted on their static knobs); ``split_k`` is left to
``default_tuning`` (enough K shares for the GPU), so the grid spends its budget on tile shapes, bytes in flight and
warps.
"""

from __future__ import annotations

import itertools

# Per M bucket: the grid of (block_m, block_n, block_k, steps, num_warps, num_stages), <= 8 configurations each.
# block_k is in weight rows: int4 packs 8 rows per word, int8 4, so the same bytes per step mean twice the rows for
# int4.
def _grid(fmt: str, m_bucket: int) -> list[dict]:
    wide = 2 if fmt == "int4" else 1
    if m_bucket == 1:
        shapes = [(1, bn, bk * wide, st) for bn in (128, 256) for bk, st in ((64, 2), (128, 2))]
        combos = [(*sh, w, 2) for sh, w in itertools.product(shapes, (4, 8))]
    elif m_bucket == 16:
        combos = [(16, bn, bk * wide, 1, w, 3) for bn in (64, 128) for bk in (64, 128) for w in (4, 8)]
    else:
        combos = [(bm, bn, 64 * wide, 1, w, 3) for bm, bn in ((32, 128), (64, 64), (64, 128), (64, 256))
                  for w in (4, 8)]
    keys = ("block_m", "block_n", "block_k", "steps", "num_warps", "num_stages")
    return [dict(zip(keys, combo)) for combo in combos]


def _format_entry(key: tuple, config: dict) -> str:
    knobs = ", ".join(f"{k}={config.get(k)!r}" for k in ("block_m", "block_n", "block_k", "steps", "split_k",
                                                           "num_warps", "num_stages"))
    return f"{key!r}: dict({knobs}),"


def section_sweep(args, results, copy_gbps, median_s, emit, make_weights):
    import jax
    import jax.numpy as jnp

    from benchmarks.quantization import LLAMA8B_MATMULS, TINY_MATMULS
    from models.quantization.linear import (quantize_activations_fp8, quantize_weight_fp8,
                                            weight_only_matmul_reference)
    from paged_jax.ops.quantized_matmul import (default_tuning, fp8_weight_only_matmul_pallas,
                                                weight_only_matmul_pallas)
    from paged_jax.ops.quantized_matmul_tuning import m_bucket

    shapes = TINY_MATMULS if args.tiny else LLAMA8B_MATMULS
    formats = [f for f in args.formats.split(",") if f]
    bucket_totals: dict = {}  # (fmt, bucket) -> {config key: (total seconds over shapes, config)}
    for fmt in formats:
        for m in args.batches:
            bucket = m_bucket(m)
            grid = _grid(fmt, bucket)[:2] if args.tiny else _grid(fmt, bucket)
            for name, k, n in shapes:
                x = jax.random.normal(jax.random.key(2), (m, k), jnp.bfloat16)
                if fmt == "fp8":
                    weight, scale = quantize_weight_fp8(jax.random.normal(jax.random.key(3), (k, n)) * 0.02)
                    operands = (x, weight, scale)
                    read = weight.nbytes + scale.nbytes

                    def xla_dot(a, w, s):
                        a_q, a_scale = quantize_activations_fp8(a, "dynamic_token")
                        y = jax.lax.dot_general(a_q, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
                        return (y * a_scale * s).astype(a.dtype)

                    xla = jax.jit(xla_dot)
                    kernel = lambda cfg: (lambda *a: fp8_weight_only_matmul_pallas(  # noqa: E731
                        *a, interpret=args.interpret, **cfg))
                    tuned = lambda cfg: default_tuning("fp8", m, n, k, **cfg)  # noqa: E731
                else:
                    bits = int(fmt[3:])
                    group_size = 128 if bits == 4 else -1
                    qweight, scales, zeros, _, gs = make_weights(k, n, bits, group_size)
                    operands = (x, qweight, scales, zeros)
                    read = qweight.nbytes + scales.nbytes + zeros.nbytes
                    xla = jax.jit(lambda *a, bits=bits, gs=gs: weight_only_matmul_reference(
                        *a, None, bits=bits, group_size=gs))
                    kernel = lambda cfg, bits=bits, gs=gs: (lambda *a: weight_only_matmul_pallas(  # noqa: E731
                        *a, None, bits=bits, group_size=gs, interpret=args.interpret, **cfg))
                    tuned = lambda cfg, bits=bits, gs=gs: default_tuning(  # noqa: E731
                        f"int{bits}", m, n, k, group_size=gs, **cfg)
                base = {"section": "sweep", "format": fmt, "m": m, "name": name, "k": k, "n": n,
                        "bytes_read": read, "copy_GBps": copy_gbps}
                t_xla = median_s(lambda: xla(*operands), args.repeats, args.inner)
                emit(results, {**base, "impl": "xla", "us": t_xla * 1e6, "GBps": read / t_xla / 1e9,
                               "fraction_of_copy": read / t_xla / 1e9 / copy_gbps})
                best = None
                for cfg in grid:
                    fn = kernel(cfg)
                    try:
                        t = median_s(lambda: fn(*operands), args.repeats, args.inner)
                    except Exception as exc:  # a configuration Triton cannot compile: reported, skipped
                        emit(results, {**base, "impl": "pallas", "config": cfg, "error": repr(exc)[:300]})
                        continue
                    effective = {key: v for key, v in tuned(cfg).items() if key != "post_scale"}
                    emit(results, {**base, "impl": "pallas", "config": effective, "us": t * 1e6,
                                   "GBps": read / t / 1e9, "fraction_of_copy": read / t / 1e9 / copy_gbps})
                    if best is None or t < best[0]:
                        best = (t, effective)
                    totals = bucket_totals.setdefault((fmt, bucket), {})
                    key = tuple(sorted(cfg.items()))
                    prev = totals.get(key, (0.0, cfg, 0))
                    totals[key] = (prev[0] + t, cfg, prev[2] + 1)
                if best is not None:
                    emit(results, {**base, "section": "sweep_best", "us": best[0] * 1e6,
                                   "GBps": read / best[0] / 1e9, "fraction_of_copy": read / best[0] / 1e9 / copy_gbps,
                                   "pallas_over_xla": t_xla / best[0],
                                   "entry": _format_entry((fmt, bucket, k, n), best[1])})
    for (fmt, bucket), totals in bucket_totals.items():
        complete = [v for v in totals.values() if v[2] == max(c for _, _, c in totals.values())]
        total, cfg, _ = min(complete, key=lambda v: v[0])
        emit(results, {"section": "sweep_best", "format": fmt, "m_bucket": bucket, "total_us_over_shapes": total * 1e6,
                       "entry": _format_entry((fmt, bucket), {**cfg, "split_k": None})})
