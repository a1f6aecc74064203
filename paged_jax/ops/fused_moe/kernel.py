"""The grouped matmul of a mixture-of-experts layer as a Pallas (Triton) kernel: vLLM's ``fused_moe_kernel``.

The rows (one per (token, expert) pair) are sorted by expert; ``group_sizes[e]`` consecutive rows go to expert
``e``. ``tile_schedule`` cuts each expert's rows into tiles of ``block_m`` rows (an expert with no rows gets no
tile), so every tile multiplies by one expert's weights; the grid is (tiles, output column blocks) with a static
tile count ``cdiv(M, block_m) + min(E, M)`` (each expert adds at most one partial tile), the tiles past the real
ones doing nothing. Each program walks K in ``block_k`` steps (a loop inside the kernel) with a float32
accumulator, so the weights an expert's tile reads are read once per tile, and experts without rows cost nothing.

Block-FP8 weights (``models.quantization.block_fp8.BlockFp8Experts``: ``float8_e4m3fn`` with one float32 scale per
``block`` of ``[out, in]``) are dequantized per tile: the program loads the tile's float8 weights and its one scale
(the tile's sides divide the scale block, ``fp8_blocks``), and multiplies ``rows @ (float32(w) * scale)`` rounded to
the rows' dtype, as the reference dequantizes them; the weights cross memory as one byte each.

Two fusions save a pass over memory each:
* ``row_index``: a tile gathers its rows from the unsorted activations (token ``row_index[r]``) instead of
  reading a sorted copy;
* ``up_rhs``: gate and up run in the same program (two accumulators over the same rows), and the program stores
  ``silu(gate) * up`` rounded once: the experts' SwiGLU activation.

The oracle is ``models.moe.grouped_matmul_reference`` (``lax.ragged_dot``); same contract, float32 accumulation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from models.quantization.block_fp8 import BlockFp8Experts
from paged_jax.ops.ragged_paged_attention.common import TRITON_COMPILER_PARAMS as _CompilerParams
from paged_jax.ops.ragged_paged_attention.common import next_pow2
from paged_jax.ops.ragged_paged_attention.common import triton_load as _load, triton_store as _store

_dot = getattr(plgpu, "dot", None) or pl.dot
# Dtypes of the rows and weights the kernel takes.
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)  # block-FP8 weights' storage
# Triton's dot needs tile sides of at least 16.
MIN_BLOCK = 16


def num_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """The static tile count of ``num_rows`` sorted rows over ``num_experts`` experts: enough for any split."""
    return -(-num_rows // block_m) + min(num_experts, num_rows)


def tile_schedule(group_sizes: jax.Array, num_rows: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``group_sizes int32[E]`` -> ``(tile_expert, tile_start, tile_end)``, each ``int32[num_tiles(...)]``: tile
    ``j`` multiplies sorted rows ``[tile_start[j], tile_end[j])`` (at most ``block_m``) by expert ``tile_expert[j]``;
    tiles past the real ones have ``tile_start == tile_end == 0`` and expert 0. No loops: compare-all search."""
    num_experts = group_sizes.shape[0]
    total = num_tiles(num_rows, num_experts, block_m)
    sizes = group_sizes.astype(jnp.int32)
    row_ends = jnp.cumsum(sizes)
    row_starts = row_ends - sizes
    tiles = (sizes + block_m - 1) // block_m
    tile_ends = jnp.cumsum(tiles)  # expert e owns tiles [tile_ends[e] - tiles[e], tile_ends[e])
    j = jnp.arange(total, dtype=jnp.int32)
    expert = jnp.searchsorted(tile_ends, j, side="right", method="compare_all").astype(jnp.int32)
    real = expert < num_experts
    expert = jnp.where(real, expert, 0)
    local = j - (tile_ends[expert] - tiles[expert])
    start = row_starts[expert] + local * block_m
    end = jnp.minimum(start + block_m, row_ends[expert])
    return expert, jnp.where(real, start, 0), jnp.where(real, end, 0)


def _grouped_matmul_kernel(expert_ref, start_ref, end_ref, row_index_ref, lhs_ref, *refs, block_m: int,
                           block_n: int, block_k: int, gather: bool, swiglu: bool, precision,
                           scale_block: tuple[int, int] | None):
    """Program (tile j, column block c). refs: rhs [E, K, N] (and its scales with ``scale_block``), then the same of
    up_rhs when ``swiglu``, then out [M, N]."""
    per_weight = 1 if scale_block is None else 2
    weights = [refs[i:i + per_weight] for i in range(0, per_weight * (2 if swiglu else 1), per_weight)]
    out_ref = refs[-1]
    num_rows, n_total = out_ref.shape
    k_total = lhs_ref.shape[1]
    tile, column_block = pl.program_id(0), pl.program_id(1)  # outside pl.when: interpret mode needs them there
    expert, start, end = expert_ref[tile], start_ref[tile], end_ref[tile]

    @pl.when(end > start)
    def _():
        rows = start + jnp.arange(block_m, dtype=jnp.int32)
        row_ok = rows < end
        rows_c = jnp.where(row_ok, rows, 0)
        src = _load(row_index_ref.at[rows_c], mask=row_ok, other=0) if gather else rows_c
        cols = column_block * block_n + jnp.arange(block_n, dtype=jnp.int32)
        col_ok = cols < n_total
        cols_c = jnp.where(col_ok, cols, 0)

        def body(step, accs):
            k = step * block_k + jnp.arange(block_k, dtype=jnp.int32)
            k_ok = k < k_total
            k_c = jnp.where(k_ok, k, 0)
            a = _load(lhs_ref.at[src[:, None], k_c[None, :]], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            out = []
            for acc, (w_ref, *scale_ref) in zip(accs, weights):
                if scale_block is None:
                    w = _load(w_ref.at[expert, k_c[:, None], cols_c[None, :]], mask=w_mask, other=0.0)
                else:
                    # The clamped indices keep every address in bounds, so no float8 fill value is needed: the
                    # entries outside the matrix are zeroed after the conversion (a float8 NaN code cannot leak).
                    w = _load(w_ref.at[expert, k_c[:, None], cols_c[None, :]])
                    # The tile lies in one scale block: scale_inv[e, out // rows, in // cols].
                    scale = scale_ref[0][expert, column_block * block_n // scale_block[0],
                                         step * block_k // scale_block[1]]
                    w = jnp.where(w_mask, w.astype(jnp.float32) * scale, 0.0).astype(a.dtype)
                out.append(acc + _dot(a, w, precision=precision))
            return tuple(out)

        zeros = jnp.zeros((block_m, block_n), jnp.float32)
        accs = lax.fori_loop(0, -(-k_total // block_k), body, (zeros, zeros) if swiglu else (zeros,))
        result = jax.nn.silu(accs[0]) * accs[1] if swiglu else accs[0]
        # Masked-off rows / columns store out of range: dropped by the GPU mask and by interpret-mode scatter.
        store_rows = jnp.where(row_ok, rows, num_rows)
        store_cols = jnp.where(col_ok, cols, n_total)
        _store(out_ref.at[store_rows[:, None], store_cols[None, :]], result.astype(out_ref.dtype),
               mask=row_ok[:, None] & col_ok[None, :])


def default_blocks(num_rows: int, num_experts: int, n: int, k: int) -> tuple[int, int, int]:
    """``(block_m, block_n, block_k)``: 16-row tiles when an expert averages few rows (decode: each tile's rows are
    mostly padding otherwise), 64 beyond; 64-wide column and K blocks (at most the padded dimension)."""
    rows_per_expert = num_rows / max(num_experts, 1)
    block_m = MIN_BLOCK if rows_per_expert <= 16 else 64
    return block_m, max(MIN_BLOCK, min(64, next_pow2(n))), max(MIN_BLOCK, min(64, next_pow2(k)))


def fp8_scale_block_supported(scale_block: tuple[int, int]) -> bool:
    """Whether the kernel takes block-FP8 experts of this ``(rows, cols)`` scale block (``fp8_blocks`` finds a tile
    side of at least ``MIN_BLOCK`` dividing each side)."""
    return all(side % MIN_BLOCK == 0 for side in scale_block)


def fp8_blocks(block_n: int, block_k: int, scale_block: tuple[int, int]) -> tuple[int, int]:
    """``(block_n, block_k)`` shrunk to divide the scale block ``(rows, cols)`` (rows along N, cols along K), so
    each tile has one scale; ValueError naming ``weight_block_size`` when a side has no power-of-two divisor of at
    least ``MIN_BLOCK``."""
    sides = []
    for block, side in zip((block_n, block_k), scale_block):
        while block >= MIN_BLOCK and side % block:
            block //= 2
        if block < MIN_BLOCK:
            raise ValueError(f"the fused MoE kernel needs block-FP8 scale blocks (weight_block_size "
                             f"{list(scale_block)}) whose sides are multiples of {MIN_BLOCK}; use moe_impl='xla' "
                             "(models.moe.set_moe_impl)")
        sides.append(block)
    return sides[0], sides[1]


def _check_operands(lhs, rhs, up_rhs, group_sizes) -> None:
    """ValueError naming the operand whose shape or dtype does not fit ``grouped_matmul_pallas``."""
    num_experts, k, _ = rhs.shape
    if lhs.ndim != 2 or lhs.shape[1] != k:
        raise ValueError(f"lhs must be [R, {k}] to match rhs {rhs.shape}, got {lhs.shape}")
    if up_rhs is not None and (up_rhs.shape != rhs.shape or type(up_rhs) is not type(rhs)):
        raise ValueError(f"up_rhs must match rhs {rhs.shape} ({type(rhs).__name__}), got {up_rhs.shape}")
    if group_sizes.shape != (num_experts,):
        raise ValueError(f"group_sizes must be int32[{num_experts}], got shape {group_sizes.shape}")
    if isinstance(rhs, BlockFp8Experts):
        if jnp.dtype(lhs.dtype) not in KERNEL_DTYPES or any(
                jnp.dtype(w.weight.dtype) != FP8_DTYPE for w in (rhs, up_rhs) if w is not None):
            raise ValueError(f"block-FP8 rhs needs float8_e4m3fn weights and lhs of one of "
                             f"{', '.join(map(str, KERNEL_DTYPES))}; got lhs {lhs.dtype}, rhs {rhs.weight.dtype}")
        return
    dtypes = {jnp.dtype(a.dtype) for a in (lhs, rhs, up_rhs) if a is not None}
    if len(dtypes) != 1 or not dtypes <= set(KERNEL_DTYPES):
        raise ValueError(f"lhs, rhs (and up_rhs) must share one of {', '.join(map(str, KERNEL_DTYPES))}; got "
                         f"{', '.join(map(str, dtypes))}")


@functools.partial(jax.jit, static_argnames=("interpret", "block_m", "block_n", "block_k", "num_warps",
                                             "num_stages"))
def grouped_matmul_pallas(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                          row_index: jax.Array | None = None, up_rhs: jax.Array | None = None,
                          interpret: bool = False, block_m: int | None = None, block_n: int | None = None,
                          block_k: int | None = None, num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """``models.moe.grouped_matmul_reference`` as one Pallas Triton kernel.

    Args:
      lhs: ``dtype[R, K]`` (bf16 / fp16 / fp32); the sorted rows are ``lhs[row_index]`` (``int32[M]``, gathered
        in the kernel) or ``lhs`` itself (``M == R``).
      rhs: ``[E, K, N]`` of ``lhs``'s dtype, or a ``BlockFp8Experts`` of that shape (dequantized per tile);
        up_rhs: None or as ``rhs`` (then ``silu(rows @ rhs) * (rows @ up_rhs)``, one rounding).
      group_sizes: ``int32[E]``, summing to ``M`` (rows past the sum are not written).
      interpret: Pallas interpret mode (CPU tests); block_m / block_n / block_k: tile sides (powers of two, at least
        16; None: ``default_blocks``); num_warps, num_stages: Triton's.
    Returns:
      ``lhs.dtype[M, N]``.
    """
    _check_operands(lhs, rhs, up_rhs, group_sizes)
    num_experts, k, n = rhs.shape
    num_rows = lhs.shape[0] if row_index is None else row_index.shape[0]
    defaults = default_blocks(num_rows, num_experts, n, k)
    block_m, block_n, block_k = (given or default for given, default in zip((block_m, block_n, block_k), defaults))
    scale_block = rhs.block if isinstance(rhs, BlockFp8Experts) else None
    if scale_block is not None:
        block_n, block_k = fp8_blocks(block_n, block_k, scale_block)
    if num_rows == 0:
        return jnp.zeros((0, n), lhs.dtype)
    expert, start, end = tile_schedule(group_sizes, num_rows, block_m)
    gather = row_index is not None
    kernel = functools.partial(
        _grouped_matmul_kernel, block_m=block_m, block_n=block_n, block_k=block_k, gather=gather,
        swiglu=up_rhs is not None, precision=lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None,
        scale_block=scale_block)
    weights = [leaf for w in (rhs, up_rhs) if w is not None
               for leaf in ((w,) if scale_block is None else (w.weight, w.scale_inv))]
    inputs = (expert, start, end, row_index.astype(jnp.int32) if gather else jnp.zeros((1,), jnp.int32), lhs,
              *weights)
    return pl.pallas_call(
        kernel,
        grid=(expert.shape[0], -(-n // block_n)),
        out_shape=jax.ShapeDtypeStruct((num_rows, n), lhs.dtype),
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=num_warps, num_stages=num_stages),
        name=f"moe_grouped_matmul{'_gather' if gather else ''}{'_swiglu' if up_rhs is not None else ''}"
             f"{'_fp8' if scale_block else ''}_bm{block_m}_bn{block_n}_bk{block_k}",
    )(*inputs)
