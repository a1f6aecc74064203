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
and random checkpoints. ``Mxfp4Experts`` is one packed expert stack as the grouped matmuls take it (the reference
dequantizes it, the fused MoE kernel decodes each tile it reads: ``decode_fp4`` and ``decode_e8m0``, bit
arithmetic that runs in a Pallas kernel as in jnp).
"""

from __future__ import annotations

import dataclasses
import functools

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


def decode_fp4(codes: jax.Array, dtype) -> jax.Array:
    """``codes uint8[...]`` (fp4 e2m1 codes, each below 16) -> ``dtype[...]`` (bfloat16, float16 or float32):
    ``FP4_VALUES[codes]`` built from bits (no table: a Pallas Triton kernel has no register lookup). A code of
    exponent ``e > 0`` and mantissa ``m`` is ``2 ** (e - 1) * (1 + m / 2)``, whose exponent and mantissa fields are
    ``(e << 1 | m) + 2 * (bias - 1)`` shifted to the mantissa's top; the subnormal codes are 0 and 0.5."""
    info = jnp.finfo(dtype)
    bias, int_dtype = info.maxexp - 1, jnp.int16 if info.bits == 16 else jnp.int32
    codes = codes.astype(int_dtype)
    magnitude = codes & 7
    half = (bias - 1) << info.nmant  # 0.5's bits
    bits = jnp.where(magnitude >= 2, (magnitude + 2 * (bias - 1)) << (info.nmant - 1), magnitude * half)
    return jax.lax.bitcast_convert_type(bits | ((codes >> 3) << (info.bits - 1)), dtype)


def decode_e8m0(scales: jax.Array, dtype) -> jax.Array:
    """``scales uint8[...]`` -> ``dtype[...]`` (bfloat16 or float32, whose 8-bit exponents hold every e8m0 scale):
    ``2 ** (scale - 127)`` as ``scale_factors`` gives it (255: inf; 0: 2 ** -127, subnormal), built from bits."""
    info = jnp.finfo(dtype)
    if info.maxexp != 128:
        raise ValueError(f"e8m0 scales decode to bfloat16 or float32, not {jnp.dtype(dtype)}")
    bits = scales.astype(jnp.int16 if info.bits == 16 else jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.where(bits == 0, 1 << (info.nmant - 1), bits << info.nmant), dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=("blocks", "scales"), meta_fields=())
@dataclasses.dataclass(frozen=True)
class Mxfp4Experts:
    """One stacked expert projection in MXFP4 as the checkpoint holds it (a pytree), standing for the model-layout
    ``[E, K, N]`` float stack of ``dequantize``.

    Fields:
      blocks: ``uint8[E, N, K // 32, 16]`` (``[out, in]`` per expert, two fp4 codes a byte).
      scales: ``uint8[E, N, K // 32]`` (e8m0, one per 32 inputs).
    """

    blocks: jax.Array
    scales: jax.Array

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, K, N)``, the float stack's shape."""
        num_experts, out_features, groups, _ = self.blocks.shape
        return num_experts, groups * BLOCK, out_features

    def dequantize(self, dtype) -> jax.Array:
        """``dtype[E, K, N]`` (``dequantize``)."""
        return dequantize(self.blocks, self.scales, dtype)


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
