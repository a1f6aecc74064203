"""Quantized weights on the device: the weight-only matmul kernels and the batch-1 decode step (issue 17).

Sections (``--sections``, comma-separated; one JSON line per figure on stdout, all of them in ``--out``):

* ``check``: the Pallas weight-only kernel against its jnp reference on the device (lowering + numerics) on
  Llama-3.1-8B projection shapes, int4 (groups 128, act-order groups 32) and int8 per channel.
* ``ceiling``: this run's device copy bandwidth (read + write of 2 GiB), the ceiling the kernels are held to.
* ``matmul``: ``x[M, K] @ W`` for the Llama-3.1-8B projections (qkv 4096x6144, o 4096x4096, gate_up 4096x28672,
  down 14336x4096) at M = 1, 16, 64: the Pallas kernel (``pallas``) and XLA's dequantize + dot (``xla``, the
  engine's default path) on int4 g128 (AWQ layout) and int8, and the bf16 dot; GB/s = bytes the matmul must read
  (packed weights + scales + zeros, or bf16 weights) / time, against ``ceiling``.
* ``decode``: one batch-1 decode step (context ``--context``) of the model runner, bf16 vs fp8 (online: per-channel
  weights, per-token activations) vs AWQ-layout int4 (random weights quantized with group 128 and zero points),
  int8 per channel, each with every ``matmul_impl`` of ``--decode-impls`` (default xla and auto, the engine's
  default; auto = pallas with ``--tiny``; ``xla_native_grouped`` is skipped for fp8) and every ``rms_norm_impl`` of
  ``--rms-norm-impls`` (default auto: the fused residual add + RMSNorm kernel on a GPU); ``floor_ms`` = bytes of
  every parameter a decode step reads
  (all but the embedding table, of which it reads one row) + the KV context, at the measured copy bandwidth.

* ``sweep``: every ``matmul_impl`` side by side per (format, M in ``--batches``, Llama-3.1-8B projection), the
  blocked GEMV's tuning grid at M = 1, and the ``AUTO_IMPL`` / ``BLOCKED_TUNING`` entries to paste
  (``benchmarks/quantization_sweep.py`` documents its harness and its lines).

The GPU's choice between the Pallas kernels and XLA is made from ``sweep``, ``matmul`` and ``decode``.

Examples (H200): ``python -m benchmarks.quantization --sections check`` (kernel lowering, a minute);
``python -m benchmarks.quantization --out $OUT/quant.json`` (everything but the sweep, Llama-3.1-8B shape);
``python -m benchmarks.quantization --sections ceiling,sweep --batches 1,16 --formats int4,fp8`` (tuning, about
three minutes).
CPU check of the script: ``python -m benchmarks.quantization --tiny`` (tiny shapes, interpret-mode kernel).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import numpy as np

from benchmarks.quantization_sweep import section_sweep
from benchmarks.report import write_json

# Llama-3.1-8B projections as the engine runs them (fused q/k/v and gate/up): (name, K, N).
LLAMA8B_MATMULS = [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672), ("down", 14336, 4096)]
# --decode-formats: the unquantized reference first, then the quantized weight formats the decode section steps.
DECODE_FORMATS = ("bf16", "fp8", "awq-int4-g128", "int8")
TINY_MATMULS = [("qkv", 256, 384), ("down", 512, 256)]


def _median_s(fn, repeats: int, inner: int) -> float:
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / inner)
    return float(np.median(times))


def _matmul_shapes(args) -> list:
    """The ``(name, K, N)`` projections the matmul sections run: ``TINY_MATMULS`` with ``--tiny``, else
    ``LLAMA8B_MATMULS``."""
    return TINY_MATMULS if args.tiny else LLAMA8B_MATMULS


def _emit(results: list, row: dict) -> None:
    print(json.dumps(row), flush=True)
    results.append(row)


def _weights(k: int, n: int, bits: int, group_size: int, act_order: bool = False, seed: int = 0):
    import jax
    import jax.numpy as jnp

    from models.quantization.linear import quantize_weight_only

    w = jax.random.normal(jax.random.key(seed), (k, n), jnp.float32) * 0.02
    gs = k if group_size == -1 else group_size
    qweight, scales, zeros = jax.jit(quantize_weight_only, static_argnames=("bits", "group_size", "zero_point",
                                                                           "dtype"))(
        w, bits=bits, group_size=gs, zero_point=True, dtype=jnp.bfloat16)
    g_idx = (jnp.asarray(np.random.default_rng(seed).permutation(np.arange(k) // gs).astype(np.int32))
             if act_order else None)
    return qweight, scales, zeros, g_idx, gs


def section_check(args, results):
    import jax
    import jax.numpy as jnp

    from models.quantization.linear import weight_only_matmul_reference
    from paged_jax.ops.quantized_matmul import weight_only_matmul_pallas

    cases = ([(1, 256, 384, 4, 128, False), (5, 512, 256, 4, 32, True), (3, 256, 128, 8, -1, False)] if args.tiny
             else [(1, 4096, 6144, 4, 128, False), (16, 14336, 4096, 4, 128, False), (7, 4096, 1024, 4, 32, True),
                   (64, 4096, 28672, 8, -1, False), (33, 4096, 4096, 4, 64, False)])
    for m, k, n, bits, group_size, act_order in cases:
        qweight, scales, zeros, g_idx, gs = _weights(k, n, bits, group_size, act_order)
        x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
        want = weight_only_matmul_reference(x.astype(jnp.float32), qweight, scales.astype(jnp.float32),
                                            zeros.astype(jnp.float32), g_idx, bits=bits, group_size=gs)
        got = weight_only_matmul_pallas(x, qweight, scales, zeros, g_idx, bits=bits, group_size=gs,
                                        interpret=args.interpret)
        got32 = np.asarray(got, np.float32)
        rel = float(np.linalg.norm(got32 - np.asarray(want)) / (np.linalg.norm(np.asarray(want)) + 1e-12))
        _emit(results, {"section": "check", "m": m, "k": k, "n": n, "bits": bits, "group_size": group_size,
                        "act_order": act_order, "rel_l2_vs_fp32_reference": rel, "ok": rel < 1e-2})
    from models.quantization.linear import fp8_weight_only_matmul_reference, quantize_weight_fp8
    from paged_jax.ops.quantized_matmul import fp8_weight_only_matmul_pallas

    for m, k, n in ([(1, 256, 384), (5, 200, 72)] if args.tiny else [(1, 4096, 6144), (16, 14336, 4096)]):
        weight, scale = quantize_weight_fp8(jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02)
        x = jax.random.normal(jax.random.key(1), (m, k), jnp.bfloat16)
        want = np.asarray(fp8_weight_only_matmul_reference(x.astype(jnp.float32), weight, scale))
        got = np.asarray(fp8_weight_only_matmul_pallas(x, weight, scale, interpret=args.interpret), np.float32)
        rel = float(np.linalg.norm(got - want) / (np.linalg.norm(want) + 1e-12))
        _emit(results, {"section": "check", "m": m, "k": k, "n": n, "format": "fp8",
                        "rel_l2_vs_fp32_reference": rel, "ok": rel < 1e-2})


def section_ceiling(args, results) -> float:
    import jax
    import jax.numpy as jnp

    n = (1 << 20) if args.tiny else (1 << 30)  # bf16 elements: 2 GiB on the GPU
    x = jnp.ones((n,), jnp.bfloat16)
    copy = jax.jit(lambda a: a + jnp.asarray(0, a.dtype))
    t = _median_s(lambda: copy(x), args.repeats, 3)
    gbps = 2 * x.nbytes / t / 1e9
    _emit(results, {"section": "ceiling", "copy_GBps": gbps, "bytes": 2 * x.nbytes})
    return gbps


def section_matmul(args, results, copy_gbps: float):
    import jax
    import jax.numpy as jnp

    from models.quantization.linear import weight_only_matmul_reference
    from paged_jax.ops.quantized_matmul import weight_only_matmul_pallas

    shapes = _matmul_shapes(args)
    for m in args.batches:
        for name, k, n in shapes:
            x = jax.random.normal(jax.random.key(2), (m, k), jnp.bfloat16)
            w16 = jax.random.normal(jax.random.key(3), (k, n), jnp.bfloat16)
            dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
            t = _median_s(lambda: dot(x, w16), args.repeats, args.inner)
            _emit(results, {"section": "matmul", "impl": "bf16", "m": m, "name": name, "k": k, "n": n,
                            "us": t * 1e6, "GBps": w16.nbytes / t / 1e9, "copy_GBps": copy_gbps})
            del w16
            for bits, group_size in ((4, 128), (8, -1)):
                qweight, scales, zeros, _, gs = _weights(k, n, bits, group_size)
                read = qweight.nbytes + scales.nbytes + zeros.nbytes
                impls = {"xla": jax.jit(lambda *a: weight_only_matmul_reference(*a, None, bits=bits, group_size=gs)),
                         "pallas": lambda *a: weight_only_matmul_pallas(*a, None, bits=bits, group_size=gs,
                                                                        interpret=args.interpret)}
                for impl, fn in impls.items():
                    t = _median_s(lambda: fn(x, qweight, scales, zeros), args.repeats, args.inner)
                    _emit(results, {"section": "matmul", "impl": impl, "bits": bits, "group_size": group_size,
                                    "m": m, "name": name, "k": k, "n": n, "us": t * 1e6, "bytes_read": read,
                                    "GBps": read / t / 1e9, "copy_GBps": copy_gbps,
                                    "fraction_of_copy": read / t / 1e9 / copy_gbps})


def _decode_step_ms(model, config, args) -> tuple[float, int, dict | None]:
    """Pipelined batch-1 decode step (ms) of a ModelRunner on ``model``, the bytes of the parameters a decode
    step reads (all but the embedding table), and with ``--trace`` the step's GPU kernels (``benchmarks.trace``).
    The row is made once; each timed step runs the same decode again (a diff with nothing new)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from paged_jax.core.hand_steps import HandScheduler
    from paged_jax.worker.model_runner import ModelRunner
    from paged_jax.sampling_params import SamplingParams

    def nbytes(a):  # int4 arrays: two per byte on the GPU (jax's nbytes counts a byte each)
        return a.size // 2 if a.dtype == jnp.int4 else int(a.nbytes)

    read = sum(nbytes(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model))
               if "embed_tokens" not in [str(p) for p in path] or config.tie_word_embeddings)
    bs = 16
    blocks = -(-(args.context + 1) // bs)
    runner = ModelRunner(model, config, num_blocks=blocks + 2, block_size=bs, max_model_len=args.context + 16,
                         max_num_seqs=1, max_num_batched_tokens=16, buckets=[(1, 1)])
    runner.warm_up(use_tqdm=False)
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1 << 20)
    hand = HandScheduler()
    hand.add("s0", [7] * (args.context + 1), list(range(1, 1 + blocks)), params=params,
             num_computed_tokens=args.context)
    runner.execute(hand.step({"s0": 1})).result()
    seqs = hand.step({"s0": 1})  # not updated: the same decode again, a diff with nothing new
    runner.execute(seqs).result()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        pending = None
        for _ in range(args.inner):
            pending = runner.execute(seqs)
        pending.result()
        times.append((time.perf_counter() - start) / args.inner)
    trace = None
    if args.trace:
        from benchmarks.trace import trace_kernels

        def loop():
            pending = None
            for _ in range(args.inner):
                pending = runner.execute(seqs)
            pending.result()

        trace = trace_kernels(loop, args.inner, args.trace)
    del runner
    jax.clear_caches()
    return float(np.median(times)) * 1e3, read, trace


def section_decode(args, results, copy_gbps: float):
    import jax.numpy as jnp

    from models.config import ModelConfig
    from models.llama import fuse_projections
    from models.loader import init_dummy_model
    from models.presets import kv_bytes_per_token, preset_config
    from models.quantization.config import QuantConfig, resolve_quantization
    from models.quantization.load import quantize_model
    import paged_jax.ops  # noqa: F401  (registers matmul_impl "pallas", "pallas_blocked" and "auto")

    if args.tiny:
        from models.testing import tiny_config
        config = ModelConfig.from_hf_config(tiny_config("llama", hidden_size=256, intermediate_size=512,
                                                        num_attention_heads=8, num_key_value_heads=4))
    else:
        config = preset_config(args.shape)
    awq = QuantConfig("awq", "weight_only", False, bits=4, group_size=128, zero_point=True)
    # auto = the tuning table's choice on the GPU, XLA on CPU: the tiny CPU check runs the Pallas kernels instead
    impls = ["pallas" if args.tiny and impl == "auto" else impl for impl in args.decode_impls.split(",") if impl]
    quantized = list(zip(DECODE_FORMATS[1:], (resolve_quantization("fp8", {}), awq, resolve_quantization("int8", {}))))
    formats = set(args.decode_formats.split(","))
    variants = [("bf16", None, "xla")] + [(name, qc, impl) for name, qc in quantized for impl in impls
                                          if not (qc.kind in ("fp8", "int8") and impl == "xla_native_grouped")]
    variants = [v for v in variants if v[0] in formats]
    kv_read = args.context * kv_bytes_per_token(config, 2)
    if args.interpret:
        import functools

        from models.quantization import linear
        from paged_jax.ops import quantized_gemv as gemv
        from paged_jax.ops.quantized_matmul import fp8_weight_only_matmul_pallas, weight_only_matmul_pallas

        def interpret(fn):
            return None if fn is None else functools.partial(fn, interpret=True)

        for impl, int_fn, fp8_fns in (
                ("pallas", weight_only_matmul_pallas, (fp8_weight_only_matmul_pallas, None, None)),
                ("pallas_blocked", gemv.weight_only_gemv_blocked,
                 (gemv.fp8_gemv_blocked, gemv.fp8_rms_norm_gemv_blocked, gemv.fp8_silu_mul_gemv_blocked))):
            linear.register_weight_only_matmul(impl, interpret(int_fn))
            fp8_fn, rms_norm_fn, silu_mul_fn = map(interpret, fp8_fns)
            linear.register_fp8_matmul(impl, fp8_fn, rms_norm=rms_norm_fn, silu_mul=silu_mul_fn)
        from models import norm
        from paged_jax.ops.rms_norm import rms_norm_pallas_differentiable
        norm.register_rms_norm("pallas", functools.partial(rms_norm_pallas_differentiable, interpret=True))
    from models.llama import set_rms_norm_impl
    for (name, qc, impl), norm_impl in itertools.product(variants, args.rms_norm_impls.split(",")):
        model = init_dummy_model(config, dtype=jnp.bfloat16, seed=0)
        if qc is not None:
            quantize_model(model, qc, matmul_impl=impl)
        fuse_projections(model)
        set_rms_norm_impl(model, norm_impl)
        try:
            step_ms, weight_read, trace = _decode_step_ms(model, config, args)
        except Exception as exc:  # one variant that does not run must not cost the others' figures
            _emit(results, {"section": "decode", "weights": name, "matmul_impl": impl, "rms_norm_impl": norm_impl,
                            "error": repr(exc)[:400]})
            del model
            continue
        floor_ms = (weight_read + kv_read) / (copy_gbps * 1e9) * 1e3
        _emit(results, {"section": "decode", "weights": name, "matmul_impl": impl, "rms_norm_impl": norm_impl,
                        "batch": 1, "context": args.context, "step_ms": step_ms, "weight_bytes_read": weight_read,
                        "kv_bytes_read": kv_read, "floor_ms": floor_ms, "step_over_floor": step_ms / floor_ms,
                        "copy_GBps": copy_gbps, **({"trace": trace} if trace else {})})
        del model


def main(argv: list[str] | None = None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sections", default="check,ceiling,matmul,decode")
    p.add_argument("--shape", default="llama-3.1-8b", help="named shape of the decode section (models/presets.py)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes, interpret-mode kernel (CPU check of the script)")
    p.add_argument("--batches", default="1,16,64", help="matmul rows M")
    p.add_argument("--context", type=int, default=1024, help="decode: cached tokens of the one sequence")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--inner", type=int, default=10)
    p.add_argument("--formats", default="int4,int8,fp8", help="sweep: weight formats")
    p.add_argument("--sweep-configs", type=int, default=8, help="sweep: blocked GEMV configurations per cell")
    p.add_argument("--no-sweep-bf16", dest="sweep_bf16", action="store_false",
                   help="sweep: leave out the bf16 dot reference")
    p.add_argument("--compile-threads", type=int, default=8, help="sweep: concurrent compiles per cell")
    p.add_argument("--budget-s", type=float, default=200.0,
                   help="sweep: no new cell starts after this many seconds (reported as skipped)")
    p.add_argument("--decode-impls", default="xla,auto",
                   help="decode: matmul_impl values of the quantized models (models.quantization.linear)")
    p.add_argument("--decode-formats", default=",".join(DECODE_FORMATS),
                   help="decode: the weight formats stepped (bf16 is the unquantized reference)")
    p.add_argument("--trace", type=int, metavar="TOP", default=0,
                   help="decode: also trace the steps and list the TOP kernels by GPU time (benchmarks.trace)")
    p.add_argument("--rms-norm-impls", default="auto",
                   help="decode: rms_norm_impl values of each model (models.norm.RMS_NORM_IMPLS), e.g. xla,pallas")
    p.add_argument("--out")
    args = p.parse_args(argv)
    from models.norm import RMS_NORM_IMPLS

    unknown = set(args.rms_norm_impls.split(",")) - set(RMS_NORM_IMPLS)
    if unknown:  # before any variant spends device time
        p.error(f"--rms-norm-impls: unknown {sorted(unknown)}; choose from {RMS_NORM_IMPLS}")
    unknown = set(args.decode_formats.split(",")) - set(DECODE_FORMATS)
    if unknown:
        p.error(f"--decode-formats: unknown {sorted(unknown)}; choose from {DECODE_FORMATS}")
    args.batches = [int(b) for b in args.batches.split(",")]
    args.interpret = args.tiny
    if args.tiny:
        args.repeats, args.inner, args.context = 1, 1, 32
        args.batches = args.batches[:1]
    sections = args.sections.split(",")
    results: list = []
    if "check" in sections:
        section_check(args, results)
    copy_gbps = (section_ceiling(args, results) if {"ceiling", "matmul", "decode", "sweep"} & set(sections)
                 else None)
    if "matmul" in sections:
        section_matmul(args, results, copy_gbps)
    if "sweep" in sections:
        section_sweep(args, results, copy_gbps, _emit, _matmul_shapes(args))
    if "decode" in sections:
        section_decode(args, results, copy_gbps)
    write_json(args.out, {"benchmark": "quantization", "results": results})
    return results


if __name__ == "__main__":
    main()
