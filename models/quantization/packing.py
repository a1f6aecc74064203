"""The canonical packed layout of weight-only integers (``models.quantization.linear``'s ``qweight``): ``int32``
words packed along the input rows, ``pack = 32 / bits`` rows per word; bits ``j*bits .. j*bits+bits-1`` of word
``[r, c]`` hold the unsigned integer of row ``pack * r + j``, column ``c``. Both weight storages
(``linear``'s packed one and ``native``'s ``int4`` / ``int8`` one) convert through these two functions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def unpack_int32(qweight: jax.Array, bits: int) -> jax.Array:
    """``int32[R, C]`` packed along rows -> ``int32[R * 32/bits, C]`` unsigned values (row ``pack*r + j`` from bits
    ``j*bits..``)."""
    pack = 32 // bits
    shifts = jnp.arange(pack, dtype=jnp.int32) * bits
    values = jnp.right_shift(qweight[:, None, :], shifts[None, :, None]) & ((1 << bits) - 1)
    return values.reshape(qweight.shape[0] * pack, qweight.shape[1])


def pack_int32(values: jax.Array, bits: int) -> jax.Array:
    """``int[in, out]`` unsigned values -> ``int32[in*bits/32, out]`` packed along rows (inverse of
    ``unpack_int32``)."""
    pack = 32 // bits
    in_features, out = values.shape
    v = values.astype(jnp.uint32).reshape(in_features // pack, pack, out)
    shifts = (jnp.arange(pack, dtype=jnp.uint32) * bits)[None, :, None]
    return jax.lax.bitcast_convert_type(jnp.sum(v << shifts, axis=1, dtype=jnp.uint32), jnp.int32)
