"""Weight-only integers in XLA's own narrow types, multiplied by XLA (``matmul_impl`` "xla_native" and
"xla_native_grouped" of ``models.quantization.linear``).

Native storage of a weight-only projection: ``qweight jnp.int4 | jnp.int8 [in, out]`` holding ``q - 2**(bits-1)``
(the unsigned integer of the canonical packed layout, shifted into the signed range of the type; XLA stores ``int4``
two to a byte on the GPU, so the bytes read are the packed layout's). ``scales`` / ``zeros`` / ``g_idx`` keep the
canonical meaning (``zeros`` the unsigned zero point), so ``w[k, n] = (qn[k, n] + 2**(bits-1) - zeros[g(k), n]) *
scales[g(k), n]``.

The two matmuls leave the fusion to XLA (whether it fuses the int4 / int8 convert into its GEMM's operand load, or
into a reduction at M = 1, is for ``benchmarks.quantization --sections sweep`` to measure):
  * ``native_matmul``: dequantize in the dot's operand, ``x @ ((qn - zn[g]) * s[g])`` with ``zn = zeros - 2**(bits-1)``
    (integers, exact in bf16);
  * ``native_grouped_matmul``: one batched dot per group of contiguous input rows on the raw integers, scaled after:
    ``y = sum_g s[g] * (x_g @ qn_g) - sum_g (s[g] * zn[g]) * sum(x_g)`` (fp32 partials ``[M, G, N]``); act-order
    ``g_idx`` (groups scattered over the rows) takes ``native_matmul``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.quantization.packing import pack_int32, unpack_int32

NATIVE_DTYPES = {4: jnp.int4, 8: jnp.int8}


def _offset(bits: int) -> int:
    return 1 << (bits - 1)


def is_native(qweight) -> bool:
    """Whether ``qweight`` is in native storage (``int4`` / ``int8``) rather than the packed ``int32`` layout."""
    return jnp.dtype(qweight.dtype) in (jnp.dtype(jnp.int4), jnp.dtype(jnp.int8))


def packed_to_native(qweight: jax.Array, bits: int) -> jax.Array:
    """Canonical ``int32[in * bits / 32, out]`` -> native ``int4 | int8 [in, out]`` (values ``q - 2**(bits-1)``)."""
    return (unpack_int32(qweight, bits) - _offset(bits)).astype(NATIVE_DTYPES[bits])


def native_to_packed(qweight: jax.Array, bits: int) -> jax.Array:
    """Native ``int4 | int8 [in, out]`` -> canonical ``int32[in * bits / 32, out]`` (inverse of
    ``packed_to_native``)."""
    return pack_int32(qweight.astype(jnp.int32) + _offset(bits), bits)


def dequantize_native(qweight, scales, zeros, g_idx, *, bits: int, dtype) -> jax.Array:
    """Native arrays -> ``dtype[in, out]`` weights (the same values as the packed layout's dequantization)."""
    in_features, out = qweight.shape
    zn = zeros.astype(dtype) - jnp.asarray(_offset(bits), dtype)  # [G, out], integers: exact in bf16
    if g_idx is None:  # contiguous groups: a broadcast, which XLA can fuse into the dot's operand
        groups = scales.shape[0]
        q = qweight.reshape(groups, in_features // groups, out).astype(dtype)
        return ((q - zn[:, None, :]) * scales.astype(dtype)[:, None, :]).reshape(in_features, out)
    return (qweight.astype(dtype) - zn[g_idx]) * scales.astype(dtype)[g_idx]


def native_matmul(x, qweight, scales, zeros, g_idx, *, bits: int, group_size: int) -> jax.Array:
    """``x[M, in] @ dequantized native weights -> [M, out]`` in ``x.dtype`` (fp32 accumulation); the dequantization
    is written in the dot's operand for XLA to fuse."""
    del group_size  # the groups are scales.shape[0] (or g_idx)
    w = dequantize_native(qweight, scales, zeros, g_idx, bits=bits, dtype=x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def native_grouped_matmul(x, qweight, scales, zeros, g_idx, *, bits: int, group_size: int) -> jax.Array:
    """Per-group dot on the raw integers, scales and zero points applied to the fp32 partials (module docstring);
    ``x[M, in]`` -> ``[M, out]`` in ``x.dtype``."""
    if g_idx is not None:
        return native_matmul(x, qweight, scales, zeros, g_idx, bits=bits, group_size=group_size)
    m, in_features = x.shape
    out = qweight.shape[1]
    groups = scales.shape[0]
    gs = in_features // groups
    xg = x.reshape(m, groups, gs)
    q = qweight.reshape(groups, gs, out).astype(x.dtype)  # integers in [-128, 127]: exact in bf16
    partial = jnp.einsum("mgk,gkn->mgn", xg, q, preferred_element_type=jnp.float32)  # [M, G, N]
    s = scales.astype(jnp.float32)
    zn = zeros.astype(jnp.float32) - _offset(bits)
    x_sums = jnp.sum(xg.astype(jnp.float32), axis=-1)  # [M, G]
    # Both contractions in full fp32 (the GPU's default dot precision would round them to TF32).
    y = (jnp.einsum("mgn,gn->mn", partial, s, precision=jax.lax.Precision.HIGHEST)
         - jnp.dot(x_sums, s * zn, precision=jax.lax.Precision.HIGHEST))
    return y.astype(x.dtype)


def fp8_upcast_matmul(x, weight, weight_scale) -> jax.Array:
    """FP8 weight-only in XLA: ``(x[M, K] @ weight[N, K].astype(x.dtype).T) * weight_scale`` -> ``[M, N]`` in
    ``x.dtype`` (the upcast written in the dot's operand for XLA to fuse; the scale applied to the fp32 product)."""
    y = jax.lax.dot_general(x, weight.astype(x.dtype), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * weight_scale.astype(jnp.float32).reshape(1, -1)).astype(x.dtype)
