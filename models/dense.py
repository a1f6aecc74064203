"""Dense projections: ``nnx.Linear`` modules whose one-row matmul stays a matmul.

A batch-1 decode step multiplies one row by every projection's weight. XLA's GPU compiler drops the size-1 row
dimension and rewrites a matrix-vector dot whose ``(out + 1) * in`` is below a size threshold
(``XLA_STRENGTH_REDUCTION_ELEMENTS``) into an elementwise multiply and a reduce ("dot strength reduction"). For a
projection's ``[in, out]`` weight that reduce runs across the weight's major dimension, and where the reduce is long
and the output wide it does not absorb the multiply: the whole product is written and read back on top of the
weight, which a matmul reads once. Two rows keep such a dot a matmul (cuBLAS or XLA's Triton GEMM,
by autotuning); the second row is the first one broadcast, so nothing new is computed. That covers a router's
narrow output too (the rewrite writes and reads back a product wider than the weight: its float32 ``[in, out]``);
short reduces and very narrow outputs stay one row, where the rewrite costs less than the broadcast and the matmul's
launch.
Every ``nnx.Linear`` the models build (``dense_linear``) multiplies through ``dense_dot_general``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

INIT_STD = 0.02
# The rows a one-row product is multiplied as, and the shapes where that pays (see the module docstring).
MIN_DOT_ROWS = 2
MIN_REDUCE_LENGTH = 2048  # the weight's input features
MIN_OUTPUT_WIDTH = 128  # its output features (a 128-expert router's)
# XLA's matrix-vector rewrite threshold on (out + 1) * in; above it the dot is a library GEMV already.
XLA_STRENGTH_REDUCTION_ELEMENTS = 10_000_000


def pads_one_row(in_features: int, out_features: int) -> bool:
    """Whether a one-row product with an ``[in_features, out_features]`` weight is multiplied as two rows."""
    return (in_features >= MIN_REDUCE_LENGTH and out_features >= MIN_OUTPUT_WIDTH
            and (out_features + 1) * in_features < XLA_STRENGTH_REDUCTION_ELEMENTS)


def dense_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers, precision=None,
                      preferred_element_type=None, **kwargs) -> jax.Array:
    """``jax.lax.dot_general``'s signature (``nnx.Linear.dot_general``): ``lhs [T, in]`` contracted with ``rhs [in,
    out]`` -> ``[T, out]``. A one-row ``lhs`` whose weight ``pads_one_row`` is multiplied as ``MIN_DOT_ROWS`` equal
    rows and the product's first row returned; everything else goes to ``jax.lax.dot_general`` unchanged."""
    if lhs.ndim != 2 or lhs.shape[0] != 1 or not pads_one_row(lhs.shape[1], rhs.size // lhs.shape[1]):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)
    rows = jnp.broadcast_to(lhs, (MIN_DOT_ROWS, lhs.shape[1]))
    product = jax.lax.dot_general(rows, rhs, dimension_numbers, precision=precision,
                                  preferred_element_type=preferred_element_type, **kwargs)
    return product[:1]


def dense_linear(in_features: int, out_features: int, *, use_bias: bool, dtype, param_dtype, rngs: nnx.Rngs,
                 init_std: float = INIT_STD, kernel_init=None, bias_init=None, precision=None) -> nnx.Linear:
    """An ``nnx.Linear`` (kernel ``[in_features, out_features]``, weights ~ N(0, ``init_std``) unless
    ``kernel_init``, bias zeros unless ``bias_init``) multiplying through ``dense_dot_general``."""
    return nnx.Linear(
        in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, precision=precision,
        kernel_init=nnx.initializers.normal(stddev=init_std) if kernel_init is None else kernel_init,
        bias_init=nnx.initializers.zeros_init() if bias_init is None else bias_init,
        dot_general=dense_dot_general, rngs=rngs)
