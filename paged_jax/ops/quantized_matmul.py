"""Weight-only int4 / int8 matmul with the dequantization inside a Pallas kernel (Triton lowering).

``y[M, N] = x[M, K] @ w``, ``w[k, n] = (q[k, n] - zeros[g(k), n]) * scales[g(k), n]``, with ``q`` packed as in
``models.quantization.linear`` (``qweight int32[K * bits / 32, N]``; bits ``j*bits..`` of word ``[r, n]`` hold input
row ``pack * r + j``, ``pack = 32 / bits``). The point is bandwidth: each packed word is read from memory once and
turned into ``pack`` weights in registers, so a decode step reads ``bits / 16`` of the bf16 weight bytes.

Kernel layout (same style as ``ragged_paged_attention.triton_kernel``: whole-array refs, integer-array indexers with
masks, no BlockSpecs, so interpret mode runs the same code on CPU):
  * grid ``(ceil(M / block_m), ceil(N / block_n), split_k)``; program ``(i, j, s)`` owns output tile ``(i, j)`` and
    the ``s``-th share of the K tiles, and writes an fp32 partial sum summed by XLA afterwards (``split_k`` > 1
    fills the GPU at batch 1, where ``M`` gives a single row of tiles);
  * per K tile: one ``[block_kp, block_n]`` load of packed words; for each of the ``pack`` bit planes ``j`` the
    activations are ``x[:, pack * r + j]``, contiguous in ``x_planes = x.reshape(M, K/pack, pack)`` transposed to
    ``[pack, M, K/pack]`` (a cheap activation shuffle done by XLA), so plane ``j`` is one ``[block_m, block_kp]``
    load and one ``dot``;
  * group scales / zeros: when the groups are contiguous and a K tile (``block_kp * pack`` rows) lies in one group,
    one ``[block_n]`` row each per tile; otherwise (act-order ``g_idx``, or groups smaller than a tile) a gather of
    ``[block_kp, block_n]`` per plane by the rows' group ids (cache hits: a group's rows share one scale row).
``weight_only_matmul_reference`` (``models.quantization.linear``) is the jnp oracle and the engine's "xla" path;
which one the GPU runs is a measurement (``benchmarks/quantization.py``), not a default here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from models.quantization.linear import register_weight_only_matmul, weight_only_matmul_reference

_CompilerParams = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
_load = getattr(plgpu, "load", None) or pl.load
_store = getattr(plgpu, "store", None) or pl.store
_dot = getattr(plgpu, "dot", None) or pl.dot

# K rows per tile (block_kp packed rows * pack); AWQ / GPTQ group size 128 then takes the one-scale-row path.
_K_ROWS_PER_TILE = 128
# Programs wanted in flight on an H200 (132 SMs, 2 resident programs each) when choosing split_k.
_TARGET_PROGRAMS = 264


def default_tuning(m: int, n: int, k: int, bits: int, *, block_m: int | None = None, block_n: int | None = None,
                   block_kp: int | None = None, split_k: int | None = None, num_warps: int | None = None,
                   num_stages: int = 2) -> dict:
    """Tile sizes for ``x[m, k] @ w[k, n]``: power-of-two blocks >= 16 (Triton dot shapes); ``split_k`` so that
    about ``_TARGET_PROGRAMS`` programs run."""
    pack = 32 // bits
    block_m = block_m or (16 if m <= 16 else 32 if m <= 32 else 64)
    block_n = block_n or (64 if m <= 16 else 128)
    block_kp = block_kp or max(16, _K_ROWS_PER_TILE // pack)
    k_tiles = -(-(k // pack) // block_kp)
    tiles = -(-m // block_m) * -(-n // block_n)
    if split_k is None:
        split_k = 1
        while split_k * 2 <= k_tiles and tiles * split_k * 2 <= _TARGET_PROGRAMS:
            split_k *= 2
    return dict(block_m=block_m, block_n=block_n, block_kp=block_kp, split_k=max(1, min(split_k, k_tiles)),
                num_warps=num_warps or (4 if block_m * block_n <= 64 * 64 else 8), num_stages=num_stages)


def _kernel(x_ref, w_ref, s_ref, z_ref, g_ref, out_ref, *, bits, block_m, block_n, block_kp, tiles_per_split,
            one_group_per_tile, group_size, precision):
    pack = 32 // bits
    mask_bits = (1 << bits) - 1
    _, m_total, kp_total = x_ref.shape
    n_total = w_ref.shape[1]
    pid_m, pid_n, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows = pid_m * block_m + jnp.arange(block_m, dtype=jnp.int32)
    cols = pid_n * block_n + jnp.arange(block_n, dtype=jnp.int32)
    row_ok, col_ok = rows < m_total, cols < n_total
    rows_c, cols_c = jnp.where(row_ok, rows, 0), jnp.where(col_ok, cols, 0)
    k_tiles = (kp_total + block_kp - 1) // block_kp
    t_lo = jnp.minimum(split * tiles_per_split, k_tiles)
    t_hi = jnp.minimum(t_lo + tiles_per_split, k_tiles)
    offsets = jnp.arange(block_kp, dtype=jnp.int32)
    compute_dtype = x_ref.dtype

    def body(t, acc):
        kr = t * block_kp + offsets  # packed rows of this tile
        k_ok = kr < kp_total
        kr_c = jnp.where(k_ok, kr, 0)
        w_mask = k_ok[:, None] & col_ok[None, :]
        words = _load(w_ref.at[kr_c[:, None], cols_c[None, :]], mask=w_mask, other=0)  # [bkp, bn] int32, once
        x_mask = row_ok[:, None] & k_ok[None, :]
        if one_group_per_tile:
            group = (t * block_kp * pack) // group_size
            scale = _load(s_ref.at[group, cols_c], mask=col_ok, other=0.0).astype(jnp.float32)[None, :]
            zero = _load(z_ref.at[group, cols_c], mask=col_ok, other=0.0).astype(jnp.float32)[None, :]
        for j in range(pack):
            q = jnp.right_shift(words, j * bits) & mask_bits
            if not one_group_per_tile:
                group = _load(g_ref.at[kr_c, j], mask=k_ok, other=0)[:, None]  # [bkp, 1]
                scale = _load(s_ref.at[group, cols_c[None, :]], mask=w_mask, other=0.0).astype(jnp.float32)
                zero = _load(z_ref.at[group, cols_c[None, :]], mask=w_mask, other=0.0).astype(jnp.float32)
            w = ((q.astype(jnp.float32) - zero) * scale).astype(compute_dtype)  # [bkp, bn]
            x = _load(x_ref.at[j, rows_c[:, None], kr_c[None, :]], mask=x_mask, other=0.0)  # [bm, bkp]
            acc += _dot(x, w, precision=precision)
        return acc

    acc = lax.fori_loop(t_lo, t_hi, body, jnp.zeros((block_m, block_n), jnp.float32))
    # Masked-off rows / columns store out of range: dropped by the GPU mask and by interpret-mode scatter.
    store_rows = jnp.where(row_ok, rows, m_total)[:, None]
    store_cols = jnp.where(col_ok, cols, n_total)[None, :]
    _store(out_ref.at[split, store_rows, store_cols], acc, mask=row_ok[:, None] & col_ok[None, :])


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "interpret", "block_m", "block_n", "block_kp",
                                             "split_k", "num_warps", "num_stages"))
def weight_only_matmul_pallas(x, qweight, scales, zeros, g_idx=None, *, bits: int, group_size: int,
                              interpret: bool = False, block_m: int | None = None, block_n: int | None = None,
                              block_kp: int | None = None, split_k: int | None = None, num_warps: int | None = None,
                              num_stages: int = 2) -> jax.Array:
    """``x[M, K] @ dequantized(qweight int32[K*bits/32, N], scales [G, N], zeros [G, N], g_idx int32[K] | None)``
    -> ``[M, N]`` in ``x.dtype`` (fp32 accumulation); same contract as ``weight_only_matmul_reference``.
    ``interpret=True`` runs the kernel on CPU. Tuning knobs: ``default_tuning``."""
    m, k = x.shape
    pack = 32 // bits
    n = qweight.shape[1]
    if qweight.shape[0] * pack != k:
        raise ValueError(f"qweight {qweight.shape} packs {qweight.shape[0] * pack} input rows, x has {k}")
    tuning = default_tuning(m, n, k, bits, block_m=block_m, block_n=block_n, block_kp=block_kp, split_k=split_k,
                            num_warps=num_warps, num_stages=num_stages)
    bm, bn, bkp, splits = tuning["block_m"], tuning["block_n"], tuning["block_kp"], tuning["split_k"]
    k_tiles = -(-(k // pack) // bkp)
    tiles_per_split = -(-k_tiles // splits)
    x_planes = x.reshape(m, k // pack, pack).transpose(2, 0, 1)  # [pack, M, K/pack]: plane j = rows pack*r + j
    groups = (jnp.arange(k, dtype=jnp.int32) // group_size) if g_idx is None else g_idx.astype(jnp.int32)
    groups = groups.reshape(k // pack, pack)
    one_group_per_tile = g_idx is None and group_size % (bkp * pack) == 0
    kernel = functools.partial(
        _kernel, bits=bits, block_m=bm, block_n=bn, block_kp=bkp, tiles_per_split=tiles_per_split,
        one_group_per_tile=one_group_per_tile, group_size=group_size,
        precision=lax.Precision.HIGHEST if x.dtype == jnp.float32 else None)
    partial_sums = pl.pallas_call(
        kernel,
        grid=(-(-m // bm), -(-n // bn), splits),
        out_shape=jax.ShapeDtypeStruct((splits, m, n), jnp.float32),
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=tuning["num_warps"], num_stages=tuning["num_stages"]),
        name=f"weight_only_int{bits}_matmul_bm{bm}_bn{bn}_bkp{bkp}_s{splits}{'_g' if not one_group_per_tile else ''}",
    )(x_planes, qweight, scales, zeros, groups)
    return jnp.sum(partial_sums, axis=0).astype(x.dtype)


register_weight_only_matmul("pallas", weight_only_matmul_pallas)

__all__ = ["default_tuning", "weight_only_matmul_pallas", "weight_only_matmul_reference"]
