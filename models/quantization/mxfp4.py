"""MXFP4 (OCP microscaling fp4), the format of gpt-oss's published experts: each run of 32 consecutive input
elements shares one power-of-two scale.

Checkpoint layout (transformers' ``integrations/mxfp4.py``), for an expert weight of ``[E, out, in]``:

  * ``<name>_blocks``: ``uint8[E, out, in // 32, 16]``, two fp4 e2m1 codes per byte: element ``2j`` of a 32-run in
    the low nibble of byte ``j``, element ``2j + 1`` in the high nibble. Code ``c`` is ``FP4_VALUES[c]`` (bit 3 the
    sign, then two exponent bits and one mantissa bit).
  * ``<name>_scales``: ``uint8[E, out, in // 32]``, e8m0 exponents biased by 127: the run's values are multiplied
    by ``2 ** (scale - 127)``.

``dequantize`` (jnp, jittable) gives the weight in model layout ``[E, in, out]``, exactly (fp4 values times powers
of two are exact in bfloat16 and float32); ``quantize`` (numpy) writes that layout from float weights, for tests
and random checkpoints.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32  # elements per scale
SCALE_BIAS = 127
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def packed_shapes(num_experts: int, out_features: int, in_features: int) -> tuple[tuple, tuple]:
    """``(blocks shape, scales shape)`` of an ``[E, out, in]`` weight; ValueError unless ``in`` is a multiple of 32."""
    if in_features % BLOCK:
        raise ValueError(f"mxfp4 needs the input dim to be a multiple of {BLOCK}, got {in_features}")
    groups = in_features // BLOCK
    return (num_experts, out_features, groups, BLOCK // 2), (num_experts, out_features, groups)


def dequantize(blocks: jax.Array, scales: jax.Array, dtype) -> jax.Array:
    """``blocks uint8[..., out, G, 16]``, ``scales uint8[..., out, G]`` -> ``dtype[..., G * 32, out]`` (model layout:
    inputs first). Leading axes (experts, or gathered experts) pass through. Decoded in bfloat16 when that is
    ``dtype`` (exact there), so no float32 copy of the weight is materialized."""
    compute = jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 else jnp.float32
    lut = jnp.asarray(FP4_VALUES, compute)
    low, high = lut[(blocks & 0x0F).astype(jnp.int32)], lut[(blocks >> 4).astype(jnp.int32)]
    values = jnp.stack([low, high], axis=-1).reshape(*blocks.shape[:-1], BLOCK)  # [..., out, G, 32]
    values = values * scale_factors(scales, compute)[..., None]
    weight = values.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)  # [..., out, in]
    return jnp.swapaxes(weight, -1, -2).astype(dtype)


def scale_factors(scales: jax.Array, dtype) -> jax.Array:
    """``scales uint8[...]`` (e8m0) -> ``dtype[...]``: ``2 ** (scale - 127)``, looked up (exact powers of two; code 255,
    NaN in the format, gives inf). A multiply by these equals ``ldexp`` without its range checks, which XLA
    materializes as masks the size of the weight."""
    with np.errstate(over="ignore"):
        table = np.ldexp(np.float32(1), np.arange(256) - SCALE_BIAS).astype(np.float32)
    return jnp.asarray(table, dtype)[scales.astype(jnp.int32)]


def matvec(x: jax.Array, blocks: jax.Array, scales: jax.Array) -> jax.Array:
    """Each row times its own packed weight: ``x [R, in]``, ``blocks uint8[R, out, in // 32, 16]``, ``scales
    uint8[R, out, in // 32]`` -> ``float32[R, out]`` = ``x[r] @ dequantize(blocks[r], scales[r])``. Written as
    elementwise products and reductions over the packed layout (each 32-run summed, then scaled by its power of
    two, exactly as scaling the weights first), so XLA fuses the decoding into the reduction and reads only the
    packed bytes: a decode step's few (token, expert) pairs never materialize their experts in a float dtype."""
    lut = jnp.asarray(FP4_VALUES, jnp.float32)
    rows, out_features, groups, _ = blocks.shape
    x_runs = x.astype(jnp.float32).reshape(rows, 1, groups, BLOCK // 2, 2)  # [..., byte, (low, high) nibble]
    low = jnp.sum(lut[(blocks & 0x0F).astype(jnp.int32)] * x_runs[..., 0], axis=-1)
    high = jnp.sum(lut[(blocks >> 4).astype(jnp.int32)] * x_runs[..., 1], axis=-1)
    return jnp.sum((low + high) * scale_factors(scales, jnp.float32), axis=-1)


def quantize(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``float[..., out, in]`` (the checkpoint's ``[E, out, in]`` orientation) -> ``(blocks, scales)``: per run of 32
    the smallest scale that keeps the run's largest magnitude within fp4's 6.0, each value rounded to the nearest
    fp4 value (ties to the smaller magnitude)."""
    weight = np.asarray(weight, np.float32)
    *lead, in_features = weight.shape
    if in_features % BLOCK:
        raise ValueError(f"mxfp4 needs the input dim to be a multiple of {BLOCK}, got {in_features}")
    runs = weight.reshape(*lead, in_features // BLOCK, BLOCK)
    amax = np.max(np.abs(runs), axis=-1)
    exponent = np.ceil(np.log2(np.maximum(amax, 2.0 ** -126) / 6.0)).astype(np.int32)
    exponent = np.clip(exponent, -SCALE_BIAS, SCALE_BIAS)
    scaled = runs / np.exp2(exponent)[..., None].astype(np.float32)
    magnitudes = np.asarray(FP4_VALUES[:8], np.float32)
    codes = np.argmin(np.abs(np.abs(scaled)[..., None] - magnitudes), axis=-1).astype(np.uint8)
    codes |= np.where(np.signbit(scaled) & (codes > 0), 8, 0).astype(np.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.astype(np.uint8), (exponent + SCALE_BIAS).astype(np.uint8)
