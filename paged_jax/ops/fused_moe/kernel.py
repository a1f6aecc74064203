"""The grouped matmul of a mixture-of-experts layer as a Pallas (Triton) kernel: vLLM's ``fused_moe_kernel``.

The rows (one per (token, expert) pair) are sorted by expert; ``group_sizes[e]`` consecutive rows go to expert
``e``. Each expert's rows are cut into tiles of ``block_m`` rows (an expert with no rows gets no tile), so every
tile multiplies by one expert's weights. The grid is (tiles, output column blocks, K splits) with a static tile
count ``num_tiles`` (enough for any split of the rows), the tiles past the real ones doing nothing. Each program
finds its tile's expert and rows from ``group_sizes`` itself (``tile_of``: a few reductions over the experts), so
no schedule is computed outside the kernel, and walks its share of K in ``block_k`` steps (a pipelined loop) with a
float32 accumulator: the weights a tile reads are read once, and experts without rows cost nothing.

Weights are stored ``[E, K, N]`` (N contiguous), so a program reads ``block_k`` rows of ``block_n`` contiguous
weights per step: wide column blocks keep the reads coalesced, and at decode sizes (a few rows per expert) the
parallelism comes from splitting K over ``split_k`` programs instead. Split programs write float32 partial sums
``[split_k, M, N]``, which the wrapper adds (with the SwiGLU when fused) in one XLA fusion; XLA fuses the down
projection's sum into the top-k combine that reads it.

Block-FP8 weights (``models.quantization.block_fp8.BlockFp8Experts``: ``float8_e4m3fn`` with one float32 scale per
``block`` of ``[out, in]``) are dequantized per tile: the program loads the tile's float8 weights and its one scale
(the tile's sides divide the scale block, ``fp8_blocks``), and multiplies ``rows @ (float32(w) * scale)`` rounded to
the rows' dtype, as the reference dequantizes them; the weights cross memory as one byte each.

MXFP4 weights (``models.quantization.mxfp4.Mxfp4Experts``, gpt-oss's experts as published: ``uint8[E, N, K / 32,
16]``, two fp4 codes a byte, and an e8m0 scale ``uint8[E, N, K / 32]`` per 32 inputs) keep the checkpoint's
``[out, in]`` orientation: a program loads ``block_n`` rows of ``block_k / 2`` contiguous packed bytes and their
``block_k / 32`` scales, decodes the low and high codes by bit arithmetic (``mxfp4.decode_fp4``, ``decode_e8m0``;
in bfloat16 for bfloat16 rows, else float32), scales them, interleaves them back into K order and multiplies the
``[block_n, block_k]`` tile transposed. K steps are whole 32-runs (``_fit_config``); the weights cross memory at
4.25 bits each and no dequantized copy exists.

Two fusions save a pass over memory each:
* ``row_index``: a tile gathers its rows from the unsorted activations (token ``row_index[r]``) instead of
  reading a sorted copy;
* ``up_rhs``: gate and up run in the same program (two accumulators over the same rows), and the program stores
  ``silu(gate) * up`` rounded once: the experts' SwiGLU activation.

Launch parameters (``KernelConfig``: tile sides, K splits, Triton's ``num_warps`` / ``num_stages``) come from
``default_config`` by rows per expert, or are given (``benchmarks.moe_kernel --configs`` sweeps them).

The oracle is ``models.moe.grouped_matmul_reference`` (``lax.ragged_dot``); same contract, float32 accumulation.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from models.quantization import mxfp4
from models.quantization.block_fp8 import BlockFp8Experts
from models.quantization.mxfp4 import Mxfp4Experts
from paged_jax.ops.ragged_paged_attention.common import TRITON_COMPILER_PARAMS as _CompilerParams
from paged_jax.ops.ragged_paged_attention.common import next_pow2
from paged_jax.ops.ragged_paged_attention.common import triton_load as _load, triton_store as _store

_dot = getattr(plgpu, "dot", None) or pl.dot
# Dtypes of the rows and weights the kernel takes.
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)  # block-FP8 weights' storage
# Triton's dot needs tile sides of at least 16.
MIN_BLOCK = 16
# Programs a decode-sized launch aims for (``split_k=None``): a few per SM of an H100 / H200 (132 SMs), so the
# weight reads of every SM overlap.
TARGET_PROGRAMS = 512


class KernelConfig(NamedTuple):
    """Launch parameters of ``grouped_matmul_pallas``: tile sides (powers of two, at least ``MIN_BLOCK``),
    ``split_k`` programs per tile and column block along K (None: enough for ``TARGET_PROGRAMS``; 1: no split),
    and Triton's ``num_warps`` and ``num_stages`` (software-pipelined loads in the K loop)."""
    block_m: int
    block_n: int
    block_k: int
    split_k: int | None = None
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:
        split = "auto" if self.split_k is None else self.split_k
        return f"{self.block_m}/{self.block_n}/{self.block_k}/{split}/{self.num_warps}/{self.num_stages}"

    @classmethod
    def parse(cls, text: str) -> "KernelConfig":
        """``"block_m/block_n/block_k/split_k/num_warps/num_stages"`` (``split_k`` "auto" for None): the
        ``--configs`` spelling, ``str``'s inverse; ValueError naming the text otherwise."""
        fields = text.strip().split("/")
        try:
            if len(fields) != 6:
                raise ValueError
            values = [None if f == "auto" and i == 3 else int(f) for i, f in enumerate(fields)]
        except ValueError:
            raise ValueError(f"kernel config {text!r} must be block_m/block_n/block_k/split_k/num_warps/num_stages "
                             "(split_k an int or 'auto')") from None
        config = cls(*values)
        config.validate()
        return config

    def validate(self) -> None:
        """ValueError naming the field that Triton cannot run."""
        for name in ("block_m", "block_n", "block_k"):
            side = getattr(self, name)
            if side < MIN_BLOCK or side & (side - 1):
                raise ValueError(f"{name} must be a power of two >= {MIN_BLOCK}, got {side}")
        if self.split_k is not None and self.split_k < 1:
            raise ValueError(f"split_k must be >= 1 or None, got {self.split_k}")
        if self.num_warps < 1 or self.num_warps & (self.num_warps - 1) or self.num_stages < 1:
            raise ValueError(f"num_warps must be a power of two and num_stages >= 1, got {self.num_warps}, "
                             f"{self.num_stages}")


# Decode sizes (few rows per expert): 16-row tiles (Triton's least), 128 contiguous columns, K split over programs.
DECODE_CONFIG = KernelConfig(block_m=16, block_n=128, block_k=64, split_k=None, num_warps=4, num_stages=3)
# Prefill sizes: 128 x 128 tiles over 8 warps, K unsplit (the sweep's fastest at 64 and more rows per expert).
PREFILL_CONFIG = KernelConfig(block_m=128, block_n=128, block_k=64, split_k=1, num_warps=8, num_stages=3)
# (most rows an expert averages, launch): the first entry whose bound holds is the default
# (benchmarks.moe_kernel's sweep measures the alternatives per token count).
DEFAULT_CONFIGS = ((16, DECODE_CONFIG), (float("inf"), PREFILL_CONFIG))
# Environment variables replacing DECODE_CONFIG / PREFILL_CONFIG (``KernelConfig.parse``'s spelling), read when a
# step is traced: a launch swept inside the engine's own step, fusions around the kernel included.
CONFIG_ENVS = ("PAGED_JAX_MOE_DECODE_CONFIG", "PAGED_JAX_MOE_PREFILL_CONFIG")


def default_config(num_rows: int, num_experts: int, n: int, k: int, itemsize: int = 2) -> KernelConfig:
    """The launch parameters for ``num_rows`` sorted rows over ``num_experts`` experts of ``[K, N]`` whose rows
    take ``itemsize`` bytes: the first of ``DEFAULT_CONFIGS`` whose bound holds for the rows an expert averages
    (16-row tiles while they are mostly padding otherwise; its ``CONFIG_ENVS`` variable's config when set), its tile
    sides at most the padded dimensions. The
    configs are sized for 16-bit tiles; 4-byte ones take half the columns and two pipeline stages, so the staged
    tiles stay within an H100's shared memory."""
    per_expert = num_rows / max(num_experts, 1)
    index = next(i for i, (bound, _) in enumerate(DEFAULT_CONFIGS) if per_expert <= bound)
    config = _from_env(CONFIG_ENVS[index]) or DEFAULT_CONFIGS[index][1]
    if itemsize > 2:
        config = config._replace(block_n=max(MIN_BLOCK, config.block_n // 2), num_stages=min(config.num_stages, 2))
    return config._replace(block_n=max(MIN_BLOCK, min(config.block_n, next_pow2(n))),
                           block_k=max(MIN_BLOCK, min(config.block_k, next_pow2(k))))


def _from_env(name: str) -> KernelConfig | None:
    """The config environment variable ``name`` spells, None when unset; ValueError naming it otherwise."""
    text = os.environ.get(name)
    if not text:
        return None
    try:
        return KernelConfig.parse(text)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def num_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """The static tile count of ``num_rows`` sorted rows over ``num_experts`` experts: enough for any split (each
    expert with rows adds at most ``block_m - 1`` padding rows to the ``num_rows``)."""
    return (num_rows + min(num_experts, num_rows) * (block_m - 1)) // block_m


def split_steps(k: int, block_k: int, split_k: int | None, base_programs: int,
                target_programs: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """``(splits, steps)``: K's ``cdiv(k, block_k)`` steps cut into ``splits`` programs of ``steps`` each (the last
    maybe partial, none empty); ``split_k`` None picks the largest power of two keeping ``base_programs * splits``
    within ``target_programs``."""
    total = -(-k // block_k)
    if split_k is None:
        split_k = 1
        while base_programs * split_k * 2 <= target_programs and split_k * 2 <= total:
            split_k *= 2
    steps = -(-total // max(1, min(split_k, total)))
    return -(-total // steps), steps


def tile_of(tile: jax.Array, group_sizes: jax.Array, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Tile ``tile`` (int32 scalar) of ``group_sizes int32[E]`` -> int32 scalars ``(expert, start, end)``: the tile
    multiplies sorted rows ``[start, end)`` by ``expert``; ``end <= start`` for a tile past the real ones (expert
    past the last then). Reductions over the experts only (what a program computes for itself)."""
    tiles = (group_sizes + block_m - 1) // block_m
    tile_ends = jnp.cumsum(tiles)  # expert e owns tiles [tile_ends[e] - tiles[e], tile_ends[e])
    row_ends = jnp.cumsum(group_sizes)
    expert = jnp.sum((tile_ends <= tile).astype(jnp.int32))
    mine = lax.broadcasted_iota(jnp.int32, group_sizes.shape, 0) == expert
    first_tile = jnp.sum(jnp.where(mine, tile_ends - tiles, 0))
    row_end = jnp.sum(jnp.where(mine, row_ends, 0))
    start = row_end - jnp.sum(jnp.where(mine, group_sizes, 0)) + (tile - first_tile) * block_m
    return expert, start, jnp.minimum(start + block_m, row_end)


def tile_schedule(group_sizes: jax.Array, num_rows: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``group_sizes int32[E]`` -> ``(tile_expert, tile_start, tile_end)``, each ``int32[num_tiles(...)]``: what
    the kernel's programs compute (``tile_of``); tiles past the real ones get ``start == end == 0`` and expert 0."""
    sizes = group_sizes.astype(jnp.int32)
    tiles = jnp.arange(num_tiles(num_rows, sizes.shape[0], block_m), dtype=jnp.int32)
    expert, start, end = jax.vmap(lambda j: tile_of(j, sizes, block_m))(tiles)
    real = end > start
    return jnp.where(real, expert, 0), jnp.where(real, start, 0), jnp.where(real, end, 0)


def _grouped_matmul_kernel(sizes_ref, row_index_ref, lhs_ref, *refs, config: KernelConfig, steps: int,
                           num_experts: int, gather: bool, swiglu: bool, precision, fmt: tuple):
    """Program (tile, column block, K split). refs: rhs (``_weight_operands``: one ref, or two with its scales),
    then the same of up_rhs when ``swiglu``, then the outputs: [M, N] (unsplit), or float32 [splits, M, N] per
    accumulator. ``fmt``: the weights' format (``_weight_format``)."""
    per_weight = 1 if fmt[0] == "float" else 2
    num_weights = 2 if swiglu else 1
    weights = [refs[i:i + per_weight] for i in range(0, per_weight * num_weights, per_weight)]
    out_refs = refs[per_weight * num_weights:]
    split_out = out_refs[0].ndim == 3
    num_rows, n_total = out_refs[0].shape[-2:]
    k_total = lhs_ref.shape[1]
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    # Program ids outside pl.when: interpret mode needs them there.
    tile, column_block, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    padded = next_pow2(num_experts)
    experts = jnp.arange(padded, dtype=jnp.int32)
    sizes = (_load(sizes_ref.at[pl.ds(0, padded)]) if padded == num_experts
             else _load(sizes_ref.at[pl.ds(0, padded)], mask=experts < num_experts, other=0))
    expert, start, end = tile_of(tile, sizes, bm)

    @pl.when(end > start)
    def _():
        rows = start + jnp.arange(bm, dtype=jnp.int32)
        row_ok = rows < end
        rows_c = jnp.where(row_ok, rows, 0)
        src = _load(row_index_ref.at[rows_c], mask=row_ok, other=0) if gather else rows_c
        c0 = column_block * bn
        cols = c0 + jnp.arange(bn, dtype=jnp.int32)  # unclamped: Triton sees them contiguous
        col_ok = cols < n_total if n_total % bn else None
        k_masked = steps * bk * -(-k_total // (steps * bk)) != k_total

        def body(step, accs):
            k0 = (split * steps + step) * bk
            k = k0 + jnp.arange(bk, dtype=jnp.int32)
            k_ok = k < k_total if k_masked else None
            a = _load(lhs_ref.at[src[:, None], k[None, :]],
                      mask=row_ok[:, None] if k_ok is None else row_ok[:, None] & k_ok[None, :], other=0.0)
            tile = _WeightTile(expert, k0, c0, bk, bn, k_total if k_masked else None, col_ok, a.dtype)
            out = []
            for acc, w_refs in zip(accs, weights):
                w, transposed = tile.load(w_refs, fmt)
                out.append(acc + _dot(a, w, trans_b=transposed, precision=precision))
            return tuple(out)

        zeros = jnp.zeros((bm, bn), jnp.float32)
        accs = lax.fori_loop(0, steps, body, (zeros,) * num_weights)
        # Masked-off rows / columns store out of range: dropped by the GPU mask and by interpret-mode scatter.
        store_rows = jnp.where(row_ok, rows, num_rows)[:, None]
        mask = _and(row_ok[:, None], None if col_ok is None else col_ok[None, :])
        if split_out:
            for out_ref, acc in zip(out_refs, accs):
                _store(out_ref.at[split, store_rows, cols[None, :]], acc, mask=mask)
        else:
            result = jax.nn.silu(accs[0]) * accs[1] if swiglu else accs[0]
            _store(out_refs[0].at[store_rows, cols[None, :]], result.astype(out_refs[0].dtype), mask=mask)


class _WeightTile(NamedTuple):
    """Where one K step's weight tile lies: ``expert``, K rows ``[k0, k0 + bk)`` and columns ``[c0, c0 + bn)``;
    ``k_total`` when the step may pass K (else None), ``col_ok bool[bn]`` when the columns may pass N (else None);
    ``dtype``: the rows' (what the tile is multiplied in)."""
    expert: jax.Array
    k0: jax.Array
    c0: jax.Array
    bk: int
    bn: int
    k_total: int | None
    col_ok: jax.Array | None
    dtype: jnp.dtype

    def load(self, refs, fmt: tuple) -> tuple[jax.Array, bool]:
        """``(tile, transposed)``: the tile in ``dtype``, ``[bk, bn]`` or, ``transposed``, ``[bn, bk]``."""
        if fmt[0] == "mxfp4":
            return self._mxfp4(*refs), True
        expert, k0, c0, bk, bn = self.expert, self.k0, self.c0, self.bk, self.bn
        k_ok = None if self.k_total is None else k0 + jnp.arange(bk, dtype=jnp.int32) < self.k_total
        mask = _and(None if k_ok is None else k_ok[:, None], None if self.col_ok is None else self.col_ok[None, :])
        tile_ref = refs[0].at[expert, pl.ds(k0, bk), pl.ds(c0, bn)]
        if fmt[0] == "float":
            return (_load(tile_ref) if mask is None else _load(tile_ref, mask=mask, other=0.0)), False
        # Block FP8. No float8 fill value: the entries outside the matrix are zeroed after the conversion (a float8
        # NaN code cannot leak). The tile lies in one scale block.
        w = _load(tile_ref) if mask is None else _load(tile_ref, mask=mask)
        scale_block, scale_ref = fmt[1], refs[1]
        # A K step past the matrix (the last split's) reads the last scale: its tile is all masked.
        scale_col = jnp.minimum(k0 // scale_block[1], scale_ref.shape[2] - 1)
        w = w.astype(jnp.float32) * scale_ref[expert, c0 // scale_block[0], scale_col]
        return (w if mask is None else jnp.where(mask, w, 0.0)).astype(self.dtype), False

    def _mxfp4(self, blocks_ref, scales_ref) -> jax.Array:
        """``[bn, bk]``: the packed bytes ``[bn, bk / 2]`` of ``blocks_ref uint8[E, N, K / 2]`` and the scales
        ``[bn, bk / 32]`` of ``scales_ref uint8[E, N, K / 32]``, decoded (``mxfp4.decode_fp4`` / ``decode_e8m0``,
        in bfloat16 for bfloat16 rows, else float32 as ``mxfp4.dequantize``), each byte's low code at even K. K
        steps are whole 32-runs, so a run is masked whole; masked bytes are code 0 and masked scales 1."""
        expert, k0, c0, bk, bn = self.expert, self.k0, self.c0, self.bk, self.bn
        half, runs = bk // 2, bk // mxfp4.BLOCK
        byte_ok = run_ok = None
        if self.k_total is not None:
            byte_ok = (k0 // 2 + jnp.arange(half, dtype=jnp.int32) < self.k_total // 2)[None, :]
            run_ok = (k0 // mxfp4.BLOCK + jnp.arange(runs, dtype=jnp.int32) < self.k_total // mxfp4.BLOCK)[None, :]
        col_ok = None if self.col_ok is None else self.col_ok[:, None]
        byte_mask, run_mask = _and(col_ok, byte_ok), _and(col_ok, run_ok)
        bytes_ref = blocks_ref.at[expert, pl.ds(c0, bn), pl.ds(k0 // 2, half)]
        runs_ref = scales_ref.at[expert, pl.ds(c0, bn), pl.ds(k0 // mxfp4.BLOCK, runs)]
        packed = _load(bytes_ref) if byte_mask is None else _load(bytes_ref, mask=byte_mask, other=0)
        scales = (_load(runs_ref) if run_mask is None
                  else _load(runs_ref, mask=run_mask, other=mxfp4.SCALE_BIAS))
        compute = jnp.bfloat16 if self.dtype == jnp.bfloat16 else jnp.float32
        factors = jnp.broadcast_to(mxfp4.decode_e8m0(scales, compute)[:, :, None], (bn, runs, mxfp4.BLOCK // 2))
        factors = factors.reshape(bn, half)
        low = mxfp4.decode_fp4(packed & 0x0F, compute) * factors
        high = mxfp4.decode_fp4(packed >> 4, compute) * factors
        return jnp.stack([low, high], axis=-1).reshape(bn, bk).astype(self.dtype)


def _and(a, b):
    """``a & b`` where None means all true."""
    return b if a is None else a if b is None else a & b


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


def _weight_format(rhs) -> tuple:
    """The kernel's static description of a weight operand: ``("float",)``, ``("fp8", scale_block)`` for
    ``BlockFp8Experts`` or ``("mxfp4",)`` for ``Mxfp4Experts``."""
    if isinstance(rhs, BlockFp8Experts):
        return "fp8", rhs.block
    return ("mxfp4",) if isinstance(rhs, Mxfp4Experts) else ("float",)


def _weight_operands(w) -> tuple:
    """The arrays the kernel reads for one weight operand: the stack, block-FP8's weights and scales, or MXFP4's
    blocks as ``uint8[E, N, K / 2]`` (a free reshape) and scales ``uint8[E, N, K / 32]``."""
    if isinstance(w, BlockFp8Experts):
        return w.weight, w.scale_inv
    if isinstance(w, Mxfp4Experts):
        return w.blocks.reshape(*w.blocks.shape[:2], -1), w.scales
    return (w,)


def _fit_config(config: KernelConfig, fmt: tuple) -> KernelConfig:
    """``config`` with tiles the format takes: block-FP8 tiles shrunk to divide the scale block (``fp8_blocks``),
    MXFP4 K steps of whole 32-runs (at least one)."""
    if fmt[0] == "fp8":
        block_n, block_k = fp8_blocks(config.block_n, config.block_k, fmt[1])
        return config._replace(block_n=block_n, block_k=block_k)
    if fmt[0] == "mxfp4":
        return config._replace(block_k=max(config.block_k, mxfp4.BLOCK))
    return config


def _check_operands(lhs, rhs, up_rhs, group_sizes) -> None:
    """ValueError naming the operand whose shape or dtype does not fit ``grouped_matmul_pallas``."""
    num_experts, k, _ = rhs.shape
    if lhs.ndim != 2 or lhs.shape[1] != k:
        raise ValueError(f"lhs must be [R, {k}] to match rhs {rhs.shape}, got {lhs.shape}")
    if up_rhs is not None and (up_rhs.shape != rhs.shape or type(up_rhs) is not type(rhs)):
        raise ValueError(f"up_rhs must match rhs {rhs.shape} ({type(rhs).__name__}), got {up_rhs.shape}")
    if group_sizes.shape != (num_experts,):
        raise ValueError(f"group_sizes must be int32[{num_experts}], got shape {group_sizes.shape}")
    if isinstance(rhs, Mxfp4Experts):
        leaves = [leaf for w in (rhs, up_rhs) if w is not None for leaf in (w.blocks, w.scales)]
        if jnp.dtype(lhs.dtype) not in KERNEL_DTYPES or any(jnp.dtype(leaf.dtype) != jnp.uint8 for leaf in leaves):
            raise ValueError(f"MXFP4 rhs needs uint8 blocks and scales and lhs of one of "
                             f"{', '.join(map(str, KERNEL_DTYPES))}; got lhs {lhs.dtype}, rhs {rhs.blocks.dtype}")
        return
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


@functools.partial(jax.jit, static_argnames=("interpret", "config"))
def grouped_matmul_pallas(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
                          row_index: jax.Array | None = None, up_rhs: jax.Array | None = None,
                          interpret: bool = False, config: KernelConfig | None = None) -> jax.Array:
    """``models.moe.grouped_matmul_reference`` as one Pallas Triton kernel.

    Args:
      lhs: ``dtype[R, K]`` (bf16 / fp16 / fp32); the sorted rows are ``lhs[row_index]`` (``int32[M]``, gathered
        in the kernel) or ``lhs`` itself (``M == R``).
      rhs: ``[E, K, N]`` of ``lhs``'s dtype, or a ``BlockFp8Experts`` or ``Mxfp4Experts`` of that shape
        (dequantized per tile);
        up_rhs: None or as ``rhs`` (then ``silu(rows @ rhs) * (rows @ up_rhs)``, one rounding).
      group_sizes: ``int32[E]``, summing to at most ``M`` (rows past the sum are not written).
      interpret: Pallas interpret mode (CPU tests); config: the launch parameters (None: ``default_config``;
        refitted to the format, ``_fit_config``).
    Returns:
      ``lhs.dtype[M, N]``.
    """
    _check_operands(lhs, rhs, up_rhs, group_sizes)
    num_experts, k, n = rhs.shape
    num_rows = lhs.shape[0] if row_index is None else row_index.shape[0]
    config = config or default_config(num_rows, num_experts, n, k, lhs.dtype.itemsize)
    config.validate()
    fmt = _weight_format(rhs)
    config = _fit_config(config, fmt)
    if num_rows == 0:
        return jnp.zeros((0, n), lhs.dtype)
    tiles, column_blocks = num_tiles(num_rows, num_experts, config.block_m), -(-n // config.block_n)
    splits, steps = split_steps(k, config.block_k, config.split_k, min(num_experts, num_rows) * column_blocks)
    gather, swiglu = row_index is not None, up_rhs is not None
    kernel = functools.partial(
        _grouped_matmul_kernel, config=config, steps=steps, num_experts=num_experts, gather=gather, swiglu=swiglu,
        precision=lax.Precision.HIGHEST if lhs.dtype == jnp.float32 else None, fmt=fmt)
    weights = [leaf for w in (rhs, up_rhs) if w is not None for leaf in _weight_operands(w)]
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((num_rows, n), lhs.dtype)
    else:  # float32 partial sums per accumulator, added below
        out_shape = (jax.ShapeDtypeStruct((splits, num_rows, n), jnp.float32),) * (2 if swiglu else 1)
    out = pl.pallas_call(
        kernel,
        grid=(tiles, column_blocks, splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=config.num_warps, num_stages=config.num_stages),
        name=f"moe_grouped_matmul{'_gather' if gather else ''}{'_swiglu' if swiglu else ''}"
             f"{'' if fmt[0] == 'float' else '_' + fmt[0]}"
             f"_bm{config.block_m}_bn{config.block_n}_bk{config.block_k}_s{splits}",
    )(group_sizes.astype(jnp.int32), row_index.astype(jnp.int32) if gather else jnp.zeros((1,), jnp.int32), lhs,
      *weights)
    if splits == 1:
        return out
    sums = [part.sum(axis=0) for part in out]
    return (jax.nn.silu(sums[0]) * sums[1] if swiglu else sums[0]).astype(lhs.dtype)
