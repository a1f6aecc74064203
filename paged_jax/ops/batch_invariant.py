"""Batch-invariant matmul: ``x[M, K] @ w[K, N]`` whose every output row is the same bits whatever M and the other
rows are (the engine's ``batch_invariant`` mode, ``paged_jax.worker.batch_invariant``).

A library GEMM is not batch invariant: cuBLAS and XLA's Triton GEMMs pick tiles and split-K by shape, XLA merges
dots that share an operand into one, and XLA's CPU dot takes a matrix-vector path for one row and re-blocks K by
shape, so a token's hidden state changes in its last bits with the number of tokens beside it. Here a row's bits
depend only on its own values and the weights:

* ``"chunks"`` (the default off a GPU): the rows padded to a multiple of ``ROW_TILE`` and multiplied one ``[ROW_TILE, K]``
  chunk at a time by XLA's own dot (cuBLAS or XLA's Triton GEMM on a GPU). Every chunk is the same dot of one shape,
  so the compiler picks one algorithm for it whatever M is; optimization barriers keep each chunk's dot apart from
  what surrounds it (no prologue or epilogue fused in that another program would not fuse) and chain the chunks
  one after the other (the dot merger cannot join them into one GEMM of another shape). The chunks are unrolled:
  no XLA while loop in the step. On a GPU the chunk's algorithm comes from autotuning, which times candidates
  per compilation: two programs may pick different algorithms for the same chunk, and on the H100 the engine's
  programs did (``benchmarks.batch_invariant``), with or without autotuning. So "chunks" is not the GPU's choice.
* ``"pallas"`` (the default on a GPU): a Pallas (Triton) kernel with fixed tiles: program ``(i, j)`` owns rows
  ``[i * ROW_TILE_PALLAS, (i + 1) * ROW_TILE_PALLAS)`` and a column tile, and walks K in ``BLOCK_K`` steps from 0
  up, accumulating each step's tensor-core ``dot`` into a float32 tile, rows, columns and K past the operands
  masked. Whole-array refs loaded in contiguous ``pl.ds`` tiles (no BlockSpecs: the K loop is the kernel's own), so
  interpret mode runs the same code on the CPU. Its bits do not depend on the compiler's choices.
  With K split in S (``split_k``; a one-row matmul with few column tiles runs too few programs to stream its weights
  at full bandwidth), the grid gains a split axis: program ``(i, j, s)`` walks split ``s``'s K steps (``split_steps``:
  consecutive runs of ``ceil(steps / S)`` steps, the last one shorter) in ``BLOCK_K`` steps from its first into a
  float32 tile and writes it to a float32 ``[S, M, N]`` output; XLA adds the partials left to right,
  ``((p[0] + p[1]) + p[2]) + ...``, in float32. S and the splits' bounds are a function of the weight's shape (K, N)
  and the tiles only (``split_k_for``, off by default: ``DEFAULT_SPLIT_K_RULE``; ``SPLIT_K_ENV`` picks S for every
  program of the process), never of M, so a row's bits depend on (K, N, tiles, S) only.

Both accumulate in float32 and round once to the output dtype; the two are not bit-equal to each other. The
environment variable ``PAGED_JAX_BATCH_INVARIANT_MATMUL`` (``chunks`` or ``pallas``) picks the one "auto" runs, for
every program of the process (the engine's, ``generate``'s and ``score_tokens``', so their bits still agree).

RMSNorm registers ``rms_norm_impl="batch_invariant"`` here: the Pallas kernel on a GPU (one program per row), and
elsewhere the jnp norm one ``[ROW_TILE, H]`` tile at a time under ``lax.map``: XLA's CPU backend emits a norm's
row reductions differently with the row count and with what it fuses them with (a matmul's output before it).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from models.norm import register_rms_norm, rms_norm_reference
from paged_jax.ops.ragged_paged_attention.common import TRITON_COMPILER_PARAMS as _CompilerParams
from paged_jax.ops.ragged_paged_attention.common import triton_load as _load, triton_store as _store
from paged_jax.ops.rms_norm import AUTO_MAX_HIDDEN, KERNEL_DTYPES, rms_norm_pallas
from jax.experimental.pallas import triton as plgpu

_dot = getattr(plgpu, "dot", None) or pl.dot

MATMUL_IMPLS = ("auto", "chunks", "pallas")
IMPL_ENV = "PAGED_JAX_BATCH_INVARIANT_MATMUL"  # what "auto" runs, when set
# Rows per chunk of the "chunks" matmul and per tile of the CPU norm: fixed, so a row's instructions never depend on
# how many rows there are. A decode row is padded to it: small enough that a chunk's dot stays bound by reading the
# weights (batch-1 decode), large enough that a prefill needs few chunks.
ROW_TILE = 128
# Rows per program of the Pallas kernel.
ROW_TILE_PALLAS = 64
# K per step of the kernel's accumulation loop: fixed, so the order of a row's sums depends on K alone.
BLOCK_K = 128
# Columns per program: wide tiles keep many-row matmuls near XLA's dot, and one row still reads the weights once
# (benchmarks.batch_invariant's tile sweep).
BLOCK_N = 128
_MIN_DOT = 16  # Triton's smallest dot tile side
# K splits (``split_k_for``): a one-row matmul with few column tiles runs too few programs to stream the weights at
# full bandwidth, so its K is split until one row tile runs about this many programs (an H100 has 132 SMs) ...
SPLIT_K_TARGET_PROGRAMS = 128
# ... while each split keeps this much of K (a split's partial sum costs a float32 [M, N] write and read) ...
SPLIT_K_MIN_K = 1024
# ... and the splits stay few (the fixed-order sum is one add per split).
SPLIT_K_MAX = 8
# Whether the kernel splits K by ``split_k_for`` when no split is given (else one split).
DEFAULT_SPLIT_K_RULE = False
SPLIT_K_ENV = "PAGED_JAX_BATCH_INVARIANT_SPLIT_K"  # the splits when none is given, when set: an int or "auto"


def block_n_for(n: int) -> int:
    """The kernel's column tile for N columns (a function of N only): ``BLOCK_N``, or the power of two (at least 16)
    that covers a narrower N."""
    return min(BLOCK_N, max(_MIN_DOT, 1 << (n - 1).bit_length()))


def resolve_impl(impl: str) -> str:
    """``impl`` (one of ``MATMUL_IMPLS``) as run here: "auto" is ``IMPL_ENV``'s choice when set, else "pallas" on a
    GPU, whose bits do not depend on the compiler's algorithm choices (there "chunks" follow the autotuner's choice
    per compilation), and "chunks" elsewhere. ValueError naming ``IMPL_ENV`` for another value."""
    if impl not in MATMUL_IMPLS:
        raise ValueError(f"batch-invariant matmul impl must be one of {', '.join(MATMUL_IMPLS)}, got {impl!r}")
    if impl == "auto":
        chosen = os.environ.get(IMPL_ENV)
        if chosen is not None and chosen not in MATMUL_IMPLS[1:]:
            raise ValueError(f"{IMPL_ENV} must be one of {', '.join(MATMUL_IMPLS[1:])}, got {chosen!r}")
        return chosen or ("pallas" if jax.default_backend() == "gpu" else "chunks")
    return impl


def split_k_for(k: int, n: int, *, block_n: int | None = None, block_k: int = BLOCK_K) -> int:
    """The rule's K splits for a ``[K, N]`` weight (a function of the shape and tiles only, never of M): the
    fewest powers of two that give one row tile ``SPLIT_K_TARGET_PROGRAMS`` programs, each split at least
    ``SPLIT_K_MIN_K`` of K and at most ``SPLIT_K_MAX`` splits; 1 for wide N (many column tiles already)."""
    tiles = -(-n // (block_n or block_n_for(n)))
    splits = 1
    while (tiles * splits < SPLIT_K_TARGET_PROGRAMS and 2 * splits <= SPLIT_K_MAX
           and k // (2 * splits) >= max(SPLIT_K_MIN_K, block_k)):
        splits *= 2
    return splits


def resolve_split_k(split_k: int | str | None, k: int, n: int, *, block_n: int | None = None,
                    block_k: int = BLOCK_K) -> int:
    """The K splits ``matmul_pallas`` runs for a ``[K, N]`` weight: ``split_k`` (an int >= 1, or "auto":
    ``split_k_for``); None: ``SPLIT_K_ENV``'s value when set (the same spellings), else the rule when
    ``DEFAULT_SPLIT_K_RULE``, else 1. ValueError naming ``split_k`` or ``SPLIT_K_ENV`` for another value."""
    name = "split_k"
    if split_k is None:
        split_k = os.environ.get(SPLIT_K_ENV) or ("auto" if DEFAULT_SPLIT_K_RULE else 1)
        name = SPLIT_K_ENV
    if isinstance(split_k, str) and split_k.strip().isdigit():
        split_k = int(split_k)
    if split_k == "auto":
        return split_k_for(k, n, block_n=block_n, block_k=block_k)
    if not isinstance(split_k, int) or isinstance(split_k, bool) or split_k < 1:
        raise ValueError(f"{name} must be an integer >= 1 or 'auto', got {split_k!r}")
    return split_k


def split_steps(k: int, block_k: int, split_k: int) -> tuple[int, int]:
    """``(splits, steps_per_split)``: split ``s`` walks the K steps ``[s * steps_per_split, (s + 1) *
    steps_per_split)`` of ``ceil(K / block_k)`` (the last one fewer): ``split_k`` at most, none empty."""
    k_steps = max(1, -(-k // block_k))
    per = -(-k_steps // max(1, split_k))
    return -(-k_steps // per), per


def _matmul_kernel(x_ref, w_ref, out_ref, *, block_n: int, block_k: int, steps_per_split: int | None, precision):
    """Program (i, j[, s]): the i-th row tile x j-th column tile over K in ``block_k`` steps, from 0 up (no split:
    ``steps_per_split`` None, out ``[M, N]`` in its dtype) or over split ``s``'s steps (out ``[S, M, N]`` float32,
    the split's partial sum at ``out[s]``). x [M, K], w [K, N]. Contiguous ``pl.ds`` tiles (vectorized loads), masked
    past M, N and K."""
    m_total, k_total = x_ref.shape
    n_total = w_ref.shape[1]
    row0, col0 = pl.program_id(0) * ROW_TILE_PALLAS, pl.program_id(1) * block_n
    row_ok = row0 + jnp.arange(ROW_TILE_PALLAS, dtype=jnp.int32) < m_total
    col_ok = col0 + jnp.arange(block_n, dtype=jnp.int32) < n_total
    offsets = jnp.arange(block_k, dtype=jnp.int32)

    def step(s, acc):
        k0 = s * block_k
        k_ok = k0 + offsets < k_total
        x = _load(x_ref.at[pl.ds(row0, ROW_TILE_PALLAS), pl.ds(k0, block_k)], mask=row_ok[:, None] & k_ok[None, :],
                  other=0.0)
        w = _load(w_ref.at[pl.ds(k0, block_k), pl.ds(col0, block_n)], mask=k_ok[:, None] & col_ok[None, :],
                  other=0.0)
        return acc + _dot(x, w, precision=precision)

    k_steps = -(-k_total // block_k)
    acc = jnp.zeros((ROW_TILE_PALLAS, block_n), jnp.float32)
    mask = row_ok[:, None] & col_ok[None, :]
    if steps_per_split is None:
        acc = lax.fori_loop(0, k_steps, step, acc)
        _store(out_ref.at[pl.ds(row0, ROW_TILE_PALLAS), pl.ds(col0, block_n)], acc.astype(out_ref.dtype), mask=mask)
        return
    split = pl.program_id(2)
    first = split * steps_per_split
    acc = lax.fori_loop(first, jnp.minimum(first + steps_per_split, k_steps), step, acc)
    _store(out_ref.at[split, pl.ds(row0, ROW_TILE_PALLAS), pl.ds(col0, block_n)], acc, mask=mask)


def sum_splits(partials: jax.Array, out_dtype) -> jax.Array:
    """``partials [S, M, N]`` float32 -> ``[M, N]`` in ``out_dtype``: ``((p[0] + p[1]) + p[2]) + ...`` in float32,
    one elementwise add per split in this order (S static), rounded once. Elementwise, so a row's sum is the same
    whatever M; XLA keeps the order of floating-point adds (it does not reassociate them)."""
    total = partials[0]
    for s in range(1, partials.shape[0]):
        total = total + partials[s]
    return total.astype(out_dtype)


def matmul_pallas(x: jax.Array, w: jax.Array, *, out_dtype=None, interpret: bool = False, block_n: int | None = None,
                  block_k: int = BLOCK_K, split_k: int | str | None = None) -> jax.Array:
    """``x[M, K] @ w[K, N]`` -> ``[M, N]`` in ``out_dtype`` (default x's), float32 accumulation, by the fixed-tile
    kernel (module docstring). Both operands in one dtype; float32 ones multiply at full precision. ``block_n``
    (default ``block_n_for(N)``) and ``block_k`` are the tiles, ``split_k`` the K splits (``resolve_split_k``); a
    row's bits depend on them and on (K, N), never on M."""
    k, n = w.shape
    block_n = block_n or block_n_for(n)
    splits, per = split_steps(k, block_k, resolve_split_k(split_k, k, n, block_n=block_n, block_k=block_k))
    out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
    return _matmul_pallas(x, w, out_dtype=out_dtype, interpret=interpret, block_n=block_n, block_k=block_k,
                          splits=splits, steps_per_split=per)


@functools.partial(jax.jit, static_argnames=("out_dtype", "interpret", "block_n", "block_k", "splits",
                                             "steps_per_split"))
def _matmul_pallas(x, w, *, out_dtype, interpret, block_n, block_k, splits, steps_per_split):
    """``matmul_pallas`` with its tiles and splits resolved: ``splits`` == 1 writes ``[M, N]`` in ``out_dtype`` from
    the kernel, more the float32 partials ``[splits, M, N]`` summed by ``sum_splits``."""
    m, k = x.shape
    n = w.shape[1]
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    grid = (-(-m // ROW_TILE_PALLAS), -(-n // block_n))
    split_name = ""
    if splits == 1:
        out_shape = jax.ShapeDtypeStruct((m, n), out_dtype)
        steps_per_split = None
    else:
        grid, out_shape = grid + (splits,), jax.ShapeDtypeStruct((splits, m, n), jnp.float32)
        split_name = f"_sk{splits}"
    out = pl.pallas_call(
        functools.partial(_matmul_kernel, block_n=block_n, block_k=block_k, steps_per_split=steps_per_split,
                          precision=precision),
        grid=grid,
        out_shape=out_shape,
        interpret=interpret,
        # Three stages of 16-bit tiles fit an H100's shared memory; float32 tiles are twice the bytes: one stage.
        compiler_params=_CompilerParams(num_warps=4, num_stages=3 if x.dtype.itemsize <= 2 else 1),
        name=f"batch_invariant_matmul_bm{ROW_TILE_PALLAS}_bn{block_n}_bk{block_k}{split_name}",
    )(x, w)
    return out if splits == 1 else sum_splits(out, out_dtype)


def map_row_chunks(fn, x: jax.Array) -> jax.Array:
    """``fn`` (rows ``[ROW_TILE, ...] -> [ROW_TILE, ...]``, each output row from its input row alone) over ``x``'s
    rows in chunks of ``ROW_TILE`` (zero-padded), each chunk between optimization barriers and after the previous
    one (module docstring): every row computed by the same program of one shape, whatever the row count."""
    m = x.shape[0]
    chunks = -(-m // ROW_TILE)
    padded = jnp.pad(x, ((0, chunks * ROW_TILE - m),) + ((0, 0),) * (x.ndim - 1))
    outs = []
    for c in range(chunks):
        chunk = padded[c * ROW_TILE:(c + 1) * ROW_TILE]
        # The previous chunk's result passes the barrier with this chunk's rows: a data dependence, so no two
        # chunks' computations can be merged into one of another shape.
        chunk = lax.optimization_barrier(chunk) if not outs else lax.optimization_barrier((chunk, outs[-1]))[0]
        outs.append(lax.optimization_barrier(fn(chunk)))
    out = outs[0] if chunks == 1 else jnp.concatenate(outs)
    return out[:m]


def matmul_chunks(x: jax.Array, w: jax.Array, *, out_dtype=None) -> jax.Array:
    """``matmul_pallas``'s contract by XLA's dot: one ``[ROW_TILE, K] @ [K, N]`` dot per chunk of rows
    (``map_row_chunks``)."""
    out_dtype = out_dtype or x.dtype
    precision = lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
    return map_row_chunks(
        lambda chunk: jnp.dot(chunk, w, precision=precision, preferred_element_type=jnp.float32).astype(out_dtype), x)


def logsumexp_batch_invariant(logits: jax.Array) -> jax.Array:
    """``logsumexp(logits [R, V], axis=-1)`` -> f32[R], each row's bits independent of R and of the program around
    it (``map_row_chunks``): a compiler emits a row reduction by the row count and by what it fuses it with."""
    return map_row_chunks(lambda chunk: jax.nn.logsumexp(chunk, axis=-1), logits)


def batch_invariant_matmul(x: jax.Array, w: jax.Array, *, out_dtype=None, impl: str = "auto",
                           interpret: bool = False) -> jax.Array:
    """``x[..., K] @ w[K, N]`` -> ``[..., N]`` in ``out_dtype`` (default x's), each row independent of the others
    (module docstring). ``impl``: one of ``MATMUL_IMPLS``; ``interpret`` runs the Pallas kernel on the CPU."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    if resolve_impl(impl) == "pallas":
        out = matmul_pallas(flat, w, out_dtype=out_dtype, interpret=interpret)
    else:
        out = matmul_chunks(flat, w, out_dtype=out_dtype)
    return out.reshape(*lead, w.shape[1])


def batch_invariant_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                                out_sharding=None, *, impl: str = "auto"):
    """``jax.lax.dot_general``'s signature for ``nnx.Linear.dot_general``: the contraction of lhs's last axis with
    rhs's first (no batch axes), by ``batch_invariant_matmul``. ``precision`` is the operands' (float32: full);
    other contractions, and an ``out_sharding``, are a ValueError."""
    del precision
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    if (tuple(lhs_contract) != (lhs.ndim - 1,) or tuple(rhs_contract) != (0,) or lhs_batch or rhs_batch
            or rhs.ndim != 2):
        raise ValueError(f"batch_invariant: only x[..., K] @ w[K, N] contractions are batch invariant, got "
                         f"{dimension_numbers} for {lhs.shape} @ {rhs.shape}")
    if out_sharding is not None:
        raise ValueError("batch_invariant: a sharded matmul output is not supported (one device only)")
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    return batch_invariant_matmul(lhs.astype(dtype), rhs.astype(dtype), out_dtype=preferred_element_type or dtype,
                                  impl=impl)


def rms_norm_batch_invariant(x: jax.Array, weight: jax.Array, residual: jax.Array | None = None, *, eps: float,
                             dtype=None, unit_offset: bool = False):
    """``models.norm.rms_norm_reference``'s contract on rows ``x [N, H]`` (module docstring), each row's bits
    independent of the others: the Pallas kernel on a GPU (rows up to ``AUTO_MAX_HIDDEN`` wide, its dtypes), else
    the jnp norm per tile of ``ROW_TILE`` rows."""
    if (jax.default_backend() == "gpu" and x.shape[-1] <= AUTO_MAX_HIDDEN and jnp.dtype(x.dtype) in KERNEL_DTYPES):
        return rms_norm_pallas(x, weight, residual, eps=eps, dtype=dtype, unit_offset=unit_offset)
    num_rows, hidden = x.shape
    tiles = -(-num_rows // ROW_TILE)

    def as_tiles(a):
        return jnp.pad(a, ((0, tiles * ROW_TILE - num_rows), (0, 0))).reshape(tiles, ROW_TILE, hidden)

    def one_tile(args):
        return rms_norm_reference(args[0], weight, args[1], eps=eps, dtype=dtype, unit_offset=unit_offset)

    out = lax.map(one_tile, (as_tiles(x), None if residual is None else as_tiles(residual)))
    return jax.tree.map(lambda a: a.reshape(tiles * ROW_TILE, hidden)[:num_rows], out)


register_rms_norm("batch_invariant", rms_norm_batch_invariant)
