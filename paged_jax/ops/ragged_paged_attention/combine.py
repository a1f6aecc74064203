"""Flash-decoding combine: the Triton kernel's per-kv-split partial results -> the normalised attention output.

With ``num_kv_splits > 1`` every program of ``triton_kernel`` writes, per query row ``r`` (``r = token * Hq + head``)
and split ``s``, the unnormalised ``acc[s, r, :] = sum_j exp2(x_j - m[s, r]) v_j`` over its keys, the running max
``m[s, r]`` (log2 units) and the sum ``l[s, r] = sum_j exp2(x_j - m[s, r])``; an empty split leaves ``acc = 0``,
``l = 0`` and ``m = MASK_VALUE``. The output is

    out[r] = sum_s w[s, r] acc[s, r] / sum_s w[s, r] l[s, r],   w[s, r] = exp2(m[s, r] - max_s m[s, r]),

zero for padding tokens (rows ``>= cu_q_lens[S] * Hq``, whose partials the kernel never wrote: garbage).

Written in jnp, XLA runs this as four small kernels (the max, the two weighted sums, the division); at batch-1
decode that is four launches per layer for a few hundred KB. ``combine_kv_splits`` is one Pallas (Triton) kernel
doing all of it; ``combine_kv_splits_reference`` is the jnp form it is tested against.

Kernel layout: ``acc`` is read as ``[NS, R * D]`` (a free reshape) in ``[splits_pad, block_cols]`` tiles, one
program per ``block_cols`` consecutive output elements; each column gathers the ``m`` / ``l`` of its own row
(``col // D``; repeated addresses, served from cache), so every tensor in the kernel is 2D or 1D and all splits of a
tile are loaded at once (no loop over splits: the kernel is latency-bound, one round of loads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from paged_jax.ops.ragged_paged_attention.common import MASK_VALUE, TRITON_COMPILER_PARAMS as _CompilerParams
from paged_jax.ops.ragged_paged_attention.common import next_pow2 as _next_pow2
from paged_jax.ops.ragged_paged_attention.common import triton_load as _load, triton_store as _store

# Elements of one [splits_pad, block_cols] f32 tile: 32 KB, 64 registers a thread at 4 warps.
_TILE_ELEMENTS = 8192
_MAX_BLOCK_COLS = 1024


def combine_kv_splits_reference(acc: jax.Array, m: jax.Array, l: jax.Array, cu_q_lens: jax.Array, num_q_heads: int,
                                out_dtype) -> jax.Array:
    """acc f32[NS, R, D], m f32[NS, R], l f32[NS, R], cu_q_lens int32[S + 1] -> out_dtype[R, D] (module docstring)."""
    m_max = jnp.max(m, axis=0)
    weight = jnp.exp2(m - m_max[None])
    denom = jnp.sum(l * weight, axis=0)
    out = jnp.sum(acc * weight[..., None], axis=0) / jnp.where(denom > 0, denom, 1.0)[:, None]
    row_valid = jnp.arange(out.shape[0], dtype=jnp.int32) < cu_q_lens[cu_q_lens.shape[0] - 1] * num_q_heads
    return jnp.where(row_valid[:, None], out, 0.0).astype(out_dtype)


def _combine_kernel(cu_q_lens_ref, acc_ref, m_ref, l_ref, out_ref, *, num_splits: int, splits_pad: int,
                    block_cols: int, head_dim: int, num_q_heads: int):
    """acc_ref f32[NS, R * D], m_ref / l_ref f32[NS, R], out_ref [R * D]; one program: ``block_cols`` outputs."""
    num_cols = out_ref.shape[0]
    num_valid_rows = cu_q_lens_ref[cu_q_lens_ref.shape[0] - 1] * num_q_heads
    col = pl.program_id(0) * block_cols + jnp.arange(block_cols, dtype=jnp.int32)
    row = col // head_dim
    col_valid = (col < num_cols) & (row < num_valid_rows)  # padding-token rows hold garbage: never read
    split = jnp.arange(splits_pad, dtype=jnp.int32)
    mask = (split[:, None] < num_splits) & col_valid[None, :]
    # Loads use clamped (in-range) indices: interpret mode has no masked-out addresses.
    split_idx = jnp.minimum(split, num_splits - 1)[:, None]
    row_idx = jnp.where(col_valid, row, 0)[None, :]
    col_idx = jnp.where(col_valid, col, 0)[None, :]
    m = _load(m_ref.at[split_idx, row_idx], mask=mask, other=MASK_VALUE)  # [splits_pad, block_cols]
    l = _load(l_ref.at[split_idx, row_idx], mask=mask, other=0.0)
    acc = _load(acc_ref.at[split_idx, col_idx], mask=mask, other=0.0)
    weight = jnp.exp2(m - jnp.max(m, axis=0)[None, :])
    denom = jnp.sum(l * weight, axis=0)
    out = jnp.sum(acc * weight, axis=0) / jnp.where(denom > 0, denom, 1.0)
    out = jnp.where(col_valid, out, 0.0)
    in_range = col < num_cols
    _store(out_ref.at[jnp.where(in_range, col, num_cols)], out.astype(out_ref.dtype), mask=in_range)


def combine_kv_splits(acc: jax.Array, m: jax.Array, l: jax.Array, cu_q_lens: jax.Array, num_q_heads: int, out_dtype,
                      *, interpret: bool = False) -> jax.Array:
    """One-kernel ``combine_kv_splits_reference``: acc f32[NS, R, D], m f32[NS, R], l f32[NS, R],
    cu_q_lens int32[S + 1] -> out_dtype[R, D], rows of padding tokens zero."""
    num_splits, num_rows, head_dim = acc.shape
    if m.shape != (num_splits, num_rows) or l.shape != m.shape:
        raise ValueError(f"m and l must be [{num_splits}, {num_rows}] to match acc {acc.shape}, got {m.shape}, "
                         f"{l.shape}")
    splits_pad = _next_pow2(num_splits)
    num_cols = num_rows * head_dim
    block_cols = max(16, min(_MAX_BLOCK_COLS, _TILE_ELEMENTS // splits_pad, _next_pow2(num_cols)))
    kernel = functools.partial(_combine_kernel, num_splits=num_splits, splits_pad=splits_pad, block_cols=block_cols,
                               head_dim=head_dim, num_q_heads=num_q_heads)
    out = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(num_cols, block_cols),),
        out_shape=jax.ShapeDtypeStruct((num_cols,), out_dtype),
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=4, num_stages=1),
        name=f"combine_kv_splits_s{num_splits}",
    )(cu_q_lens, acc.reshape(num_splits, num_cols), m, l)
    return out.reshape(num_rows, head_dim)
