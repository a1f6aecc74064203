"""Tuning of the quantized matmul kernels (``paged_jax.ops.quantized_matmul``, ``paged_jax.ops.quantized_gemv``):
the measured tables, the default configuration they yield for a shape, and the implementation ``matmul_impl="auto"``
runs per (format, M bucket) on the GPU (``AUTO_IMPL``).

Formats: ``"int4"`` (AWQ / GPTQ 4-bit, any group), ``"int8"`` (per channel or grouped), ``"fp8"`` (float8_e4m3fn
weights, per-channel or per-tensor scale, weight-only upcast); FP8 layers that quantize their activations ask as
``FP8_W8A8`` (``FP8_DOT_MIN_ROWS``). M buckets: the smallest of ``M_BUCKETS`` >= M.

``TUNING`` maps ``(format, m_bucket)`` to the knobs of that bucket, and ``(format, m_bucket, k, n)`` to a
shape-specific override; both are filled from ``python -m benchmarks.quantization --sections sweep`` on the GPU
(the sweep prints the best configuration of each (format, M bucket, shape) as a ready-to-paste entry). Knobs:
  * ``block_m``: rows per program; 1 = the GEMV path (broadcast-multiply + sum, one row per program, no ``dot``),
    >= 16 = the ``dot`` path (power of two, Triton's smallest dot tile);
  * ``block_n``: output columns per program (power of two; coalesced loads along N);
  * ``block_k``: input rows per K step (int formats: a multiple of ``32 / bits`` words' rows; power of two);
  * ``steps``: K steps per loop iteration (loads issued together: bytes in flight per program);
  * ``split_k``: K shares (programs along K, fp32 partials summed by XLA); None = enough shares for
    ``TARGET_PROGRAMS`` programs;
  * ``num_warps``, ``num_stages``: Triton's.

``BLOCKED_TUNING`` holds the knobs of the block-sliced M = 1 GEMV kernels (``quantized_gemv``; no ``block_m``), keyed
``(format,)`` and ``(format, k, n)``, from the same sweep.
"""

from __future__ import annotations

from models.quantization.linear import FP8_W8A8, IMPL_STORAGE

M_BUCKETS = (1, 16, 64)
FORMATS = ("int4", "int8", "fp8")

# Programs wanted in flight on an H200 (132 SMs, 2 resident programs each) when split_k is not given.
TARGET_PROGRAMS = 264

# matmul_impl="auto" on the GPU: the implementation (``models.quantization.linear.MATMUL_IMPLS``) per (format,
# M bucket); off the GPU "auto" is "xla" (or "xla_native" for a native-storage format). The H200 sweep's winners
# (RESULTS.md): int4 the block-sliced GEMV at M = 1 and the packed Pallas kernel at 16 (the grouped native dot was
# faster there, but a format keeps one storage and packed wins the sum over both buckets); fp8 the block-sliced
# GEMV's tensor-core path at M = 1 and XLA's dot on the upcast weights (its convert fuses into the GEMM's operand
# load) above, for weight-only layers at every M and for layers that quantize their activations up to
# ``FP8_DOT_MIN_ROWS``; online int8 (``Int8Linear``: FP8's layout on int8) asks as "fp8". The packed "int8" entries
# serve GPTQ 8-bit. Integer formats above 16 rows: XLA (dequantize + dot; no int4 path is bandwidth-bound there). A
# weight-only format's entries must all read one storage (``STORAGE``): its modules hold one layout whatever M a
# step has.
AUTO_IMPL = {
    ("int4", 1): "pallas_blocked", ("int4", 16): "pallas", ("int4", 64): "xla",
    ("int8", 1): "pallas", ("int8", 16): "pallas", ("int8", 64): "xla",
    ("fp8", 1): "pallas_blocked", ("fp8", 16): "xla_native", ("fp8", 64): "xla_native",
}
NATIVE_IMPLS = tuple(impl for impl, kind in IMPL_STORAGE.items() if kind == "native")
# FP8 layers that quantize their activations (format ``FP8_W8A8``): from this many rows on the GPU "auto" runs XLA's
# float8 dot (per-token activation quantization, then an FP8 GEMM on the [N, K] weights), below it the weight-only
# entries of "fp8". The H200 sweep on [N, K] weights (RESULTS.md, "FP8 at larger M"): the weight-only dot on upcast
# weights wins at 16 and 64 rows on all four Llama-3.1-8B projections; at 128 rows the float8 dot is level on qkv +
# gate_up (online fp8's quantized pair: ahead on qkv, behind on gate_up) and wins on down; from 256 it wins on all
# four.
FP8_DOT_MIN_ROWS = 128

# Bucket entries for int4 / fp8 at M 1 and 16 and the shape entries (Llama-3.1-8B projections) are the H200 sweep's
# best (benchmarks/RESULTS.md, quantized matmul sweep; fp8's from when its weights were stored [K, N], not re-swept on
# [N, K]); int8 and the M = 64 buckets are unswept guesses.
TUNING: dict[tuple, dict] = {
    ("int4", 1): dict(block_m=1, block_n=128, block_k=256, steps=2, split_k=None, num_warps=8, num_stages=2),
    ("int4", 16): dict(block_m=16, block_n=128, block_k=256, steps=1, split_k=None, num_warps=8, num_stages=3),
    ("int4", 64): dict(block_m=64, block_n=128, block_k=128, steps=1, split_k=None, num_warps=8, num_stages=3),
    ("int8", 1): dict(block_m=1, block_n=256, block_k=64, steps=2, split_k=None, num_warps=4, num_stages=2),
    ("int8", 16): dict(block_m=16, block_n=128, block_k=128, steps=1, split_k=None, num_warps=4, num_stages=3),
    ("int8", 64): dict(block_m=64, block_n=128, block_k=64, steps=1, split_k=None, num_warps=8, num_stages=3),
    ("fp8", 1): dict(block_m=1, block_n=256, block_k=64, steps=2, split_k=None, num_warps=8, num_stages=2),
    ("fp8", 16): dict(block_m=16, block_n=64, block_k=128, steps=1, split_k=None, num_warps=8, num_stages=3),
    ("fp8", 64): dict(block_m=64, block_n=128, block_k=64, steps=1, split_k=None, num_warps=8, num_stages=3),
    ('int4', 1, 4096, 6144): dict(block_m=1, block_n=128, block_k=128, steps=4, split_k=4, num_warps=8, num_stages=2),
    ('int4', 1, 4096, 4096): dict(block_m=1, block_n=128, block_k=128, steps=4, split_k=8, num_warps=8, num_stages=2),
    ('int4', 1, 4096, 28672): dict(block_m=1, block_n=256, block_k=128, steps=4, split_k=2, num_warps=8, num_stages=2),
    ('int4', 1, 14336, 4096): dict(block_m=1, block_n=128, block_k=128, steps=2, split_k=8, num_warps=8, num_stages=2),
    ('int4', 16, 4096, 6144): dict(block_m=16, block_n=128, block_k=128, steps=2, split_k=4, num_warps=8, num_stages=3),
    ('int4', 16, 4096, 4096): dict(block_m=16, block_n=128, block_k=128, steps=1, split_k=8, num_warps=8, num_stages=3),
    ('int4', 16, 4096, 28672): dict(block_m=16, block_n=128, block_k=128, steps=1, split_k=1, num_warps=4, num_stages=3),
    ('int4', 16, 14336, 4096): dict(block_m=16, block_n=128, block_k=128, steps=2, split_k=8, num_warps=4, num_stages=3),
    ('fp8', 1, 4096, 6144): dict(block_m=1, block_n=128, block_k=64, steps=2, split_k=4, num_warps=8, num_stages=2),
    ('fp8', 1, 4096, 4096): dict(block_m=1, block_n=256, block_k=128, steps=2, split_k=16, num_warps=8, num_stages=2),
    ('fp8', 1, 4096, 28672): dict(block_m=1, block_n=256, block_k=64, steps=2, split_k=2, num_warps=8, num_stages=2),
    ('fp8', 1, 14336, 4096): dict(block_m=1, block_n=128, block_k=64, steps=2, split_k=8, num_warps=8, num_stages=2),
    ('fp8', 16, 4096, 6144): dict(block_m=16, block_n=64, block_k=128, steps=1, split_k=2, num_warps=8, num_stages=3),
    ('fp8', 16, 4096, 4096): dict(block_m=16, block_n=64, block_k=64, steps=1, split_k=4, num_warps=8, num_stages=3),
    ('fp8', 16, 4096, 28672): dict(block_m=16, block_n=64, block_k=64, steps=1, split_k=1, num_warps=4, num_stages=3),
    ('fp8', 16, 14336, 4096): dict(block_m=16, block_n=128, block_k=64, steps=1, split_k=8, num_warps=8, num_stages=3),
}

KNOBS = ("block_m", "block_n", "block_k", "steps", "split_k", "num_warps", "num_stages")
BLOCKED_KNOBS = ("block_n", "block_k", "steps", "split_k", "num_warps", "num_stages", "dot_rows")

# int4: the H200 sweep's best (bucket entry and the Llama-3.1-8B projections); fp8: the Llama-3.1-8B projections
# timed inside the decode step, where qkv and gate_up run the RMSNorm prologue and down the SwiGLU one (block_n 128
# beat the standalone sweep's earlier picks there); the fp8 bucket entry is the [N, K] sweep's; int8 is an unswept
# guess.
BLOCKED_TUNING: dict[tuple, dict] = {
    ("int4",): dict(block_n=256, block_k=128, steps=2, split_k=None, num_warps=8, num_stages=3),
    ("int8",): dict(block_n=128, block_k=64, steps=2, split_k=None, num_warps=4, num_stages=3),
    ("fp8",): dict(block_n=64, block_k=256, steps=1, split_k=None, num_warps=4, num_stages=3, dot_rows=16),
    ('int4', 4096, 6144): dict(block_n=128, block_k=128, steps=4, split_k=4, num_warps=8, num_stages=2),
    ('int4', 4096, 4096): dict(block_n=256, block_k=128, steps=2, split_k=16, num_warps=8, num_stages=3),
    ('int4', 4096, 28672): dict(block_n=128, block_k=128, steps=4, split_k=1, num_warps=8, num_stages=2),
    ('int4', 14336, 4096): dict(block_n=256, block_k=64, steps=2, split_k=16, num_warps=4, num_stages=3),
    ('fp8', 4096, 6144): dict(block_n=128, block_k=256, steps=1, split_k=8, num_warps=4, num_stages=3, dot_rows=16),
    ('fp8', 4096, 4096): dict(block_n=128, block_k=256, steps=1, split_k=8, num_warps=4, num_stages=3, dot_rows=16),
    ('fp8', 4096, 28672): dict(block_n=128, block_k=256, steps=1, split_k=1, num_warps=4, num_stages=3, dot_rows=16),
    ('fp8', 14336, 4096): dict(block_n=128, block_k=256, steps=1, split_k=8, num_warps=4, num_stages=3, dot_rows=16),
}


def m_bucket(m: int) -> int:
    """The tuning bucket of ``m`` rows (the largest bucket for anything above it)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def format_name(bits: int | None) -> str:
    """``"int4"`` / ``"int8"`` for weight-only bits, ``"fp8"`` for None."""
    return "fp8" if bits is None else f"int{bits}"


def tuned(fmt: str, m: int, k: int, n: int) -> dict:
    """The table's knobs for ``x[m, k] @ w`` (``[k, n]`` unpacked; fp8 stores ``[n, k]``) in ``fmt``: the shape
    entry if there is one, else the bucket's."""
    bucket = m_bucket(m)
    return dict(TUNING.get((fmt, bucket, k, n)) or TUNING[(fmt, bucket)])


def blocked_tuned(fmt: str, k: int, n: int) -> dict:
    """``BLOCKED_TUNING``'s knobs for ``x[1, k] @ w`` (``[k, n]`` unpacked; fp8 stores ``[n, k]``) in ``fmt``: the
    shape entry if there is one."""
    return dict(BLOCKED_TUNING.get((fmt, k, n)) or BLOCKED_TUNING[(fmt,)])


def storage(fmt: str) -> str:
    """The weight-only storage ("packed" | "native") of ``matmul_impl="auto"`` modules in ``fmt``. FP8 weights have
    one layout (float8 [N, K]) under every implementation: "packed", i.e. nothing to convert."""
    if fmt == "fp8":
        return "packed"
    native = {AUTO_IMPL[(fmt, b)] in NATIVE_IMPLS for b in M_BUCKETS}
    if len(native) != 1:
        raise ValueError(f"AUTO_IMPL mixes native and packed implementations for {fmt}")
    return "native" if native.pop() else "packed"


def auto_impl(fmt: str, m: int, backend: str) -> str:
    """``matmul_impl="auto"``: the implementation ``m`` rows (static) in ``fmt`` (``FORMATS`` or ``FP8_W8A8``) run on
    ``backend``."""
    if fmt == FP8_W8A8:
        if backend == "gpu" and m < FP8_DOT_MIN_ROWS:
            return AUTO_IMPL[("fp8", m_bucket(m))]
        return "xla"
    if backend == "gpu":
        return AUTO_IMPL[(fmt, m_bucket(m))]
    return "xla_native" if fmt != "fp8" and storage(fmt) == "native" else "xla"
