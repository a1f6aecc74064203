"""Tuning of the quantized matmul kernels (``paged_jax.ops.quantized_matmul``): the measured table, the default
configuration it yields for a shape, and the M threshold below which ``matmul_impl="auto"`` runs the Pallas kernels.

Formats: ``"int4"`` (AWQ / GPTQ 4-bit, any group), ``"int8"`` (per channel or grouped), ``"fp8"`` (float8_e4m3fn
weights, per-channel or per-tensor scale, weight-only upcast). M buckets: the smallest of ``M_BUCKETS`` >= M.

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
"""

from __future__ import annotations

M_BUCKETS = (1, 16, 64)
FORMATS = ("int4", "int8", "fp8")

# Programs wanted in flight on an H200 (132 SMs, 2 resident programs each) when split_k is not given.
TARGET_PROGRAMS = 264

# matmul_impl="auto": the Pallas kernel for M <= this (the GPU only), XLA above (int: dequantize + dot; fp8: the
# float8 dot with activations quantized per token). The sweep measured the kernels ahead of XLA at M 1 and 16 (int4,
# fp8); M = 64 is not measured with these kernels, so it stays on XLA.
PALLAS_MAX_M = {"int4": 16, "int8": 16, "fp8": 16}

# Bucket entries for int4 / fp8 at M 1 and 16 and the shape entries (Llama-3.1-8B projections) are the H200 sweep's
# best (benchmarks/RESULTS.md, quantized matmul sweep); int8 and the M = 64 buckets are unswept guesses.
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


def m_bucket(m: int) -> int:
    """The tuning bucket of ``m`` rows (the largest bucket for anything above it)."""
    return next((b for b in M_BUCKETS if m <= b), M_BUCKETS[-1])


def format_name(bits: int | None) -> str:
    """``"int4"`` / ``"int8"`` for weight-only bits, ``"fp8"`` for None."""
    return "fp8" if bits is None else f"int{bits}"


def tuned(fmt: str, m: int, k: int, n: int) -> dict:
    """The table's knobs for ``x[m, k] @ w[k, n]`` in ``fmt``: the shape entry if there is one, else the bucket's."""
    bucket = m_bucket(m)
    return dict(TUNING.get((fmt, bucket, k, n)) or TUNING[(fmt, bucket)])


def use_pallas(fmt: str, m: int, backend: str) -> bool:
    """``matmul_impl="auto"``: whether ``m`` rows in ``fmt`` run the Pallas kernel on ``backend``."""
    return backend == "gpu" and m <= PALLAS_MAX_M[fmt]
