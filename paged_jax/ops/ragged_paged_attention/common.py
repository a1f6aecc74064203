"""What the ragged paged attention implementations share: input validation, int32 metadata, the tile map of the two
Pallas kernels (``triton_kernel``, ``mgpu_kernel``) and the zeroing of padding tokens.

Shapes, as in ``ragged_paged_attention``: q ``[T, Hq, D]``; pools ``[num_blocks, block_size, Hkv, D]``;
``kv_lens int32[S]``, ``block_tables int32[S, max_blocks]``, ``cu_q_lens int32[S+1]``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

LOG2_E = math.log2(math.e)
# Finite "minus infinity": exp2(MASK - real_max) underflows to exactly 0, and a fully masked row never makes
# NaNs (inf - inf). Same choice as JAX's own Pallas attention kernels.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

# The Triton lowering's names moved between JAX releases (the kernels here run on either spelling).
TRITON_COMPILER_PARAMS = getattr(plgpu, "CompilerParams", None) or getattr(plgpu, "TritonCompilerParams")
triton_load = getattr(plgpu, "load", None) or pl.load
triton_store = getattr(plgpu, "store", None) or pl.store


def next_pow2(x: int) -> int:
    """The smallest power of two >= ``x`` (1 for ``x`` <= 1): Triton tiles have power-of-two sides."""
    return 1 << max(0, (int(x) - 1).bit_length())


def query_tile(num_tokens: int, num_seqs: int, heads_per_tile: int, block_q: int | None) -> tuple[int, int]:
    """``(block_q, rows)`` of a kernel tile that holds ``block_q`` query tokens of one sequence times
    ``heads_per_tile`` heads: by default 16 rows for decode-like steps (at most two tokens a sequence) and 64 for
    prefill, at least one token and at most ``num_tokens``; ``rows`` is the tile's row count, a power of two >= 16
    (Triton's dot)."""
    if block_q is None:
        rows_wanted = 16 if num_tokens <= 2 * num_seqs else 64
        block_q = max(1, rows_wanted // heads_per_tile)
    block_q = int(max(1, min(block_q, num_tokens)))
    return block_q, max(16, next_pow2(block_q * heads_per_tile))


def validate_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, sliding_window,
                    logit_soft_cap=None, sinks=None, v_head_dim=None, attention_chunk_size=None) -> None:
    """ValueError naming the argument when the shapes, dtypes, ``sliding_window``, ``logit_soft_cap``, ``sinks``,
    ``v_head_dim`` (a latent cache's value width) or ``attention_chunk_size`` do not fit the interface."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [num_blocks, block_size, Hkv, D], got shape {k_pages.shape}")
    latent = v_pages.shape[:-1] == k_pages.shape[:-1] and v_pages.shape[-1] == 0
    if v_pages.shape != k_pages.shape and not latent:
        raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape} (or have width 0: "
                         "a latent cache)")
    if latent != (v_head_dim is not None) or (latent and not 0 < v_head_dim <= k_pages.shape[-1]):
        raise ValueError(f"v_head_dim ({v_head_dim}) must be given exactly for a latent cache (v_pages of width 0), "
                         f"in 1..{k_pages.shape[-1]}")
    _, num_q_heads, head_dim = q.shape
    _, _, num_kv_heads, kv_head_dim = k_pages.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"k_pages head_dim {kv_head_dim} must equal q head_dim {head_dim}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q heads ({num_q_heads}) must be a multiple of k_pages kv heads ({num_kv_heads})")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [S, max_blocks], got shape {block_tables.shape}")
    num_seqs = block_tables.shape[0]
    if num_seqs < 1:
        raise ValueError("block_tables must have at least one sequence row")
    if kv_lens.shape != (num_seqs,):
        raise ValueError(f"kv_lens must be [S={num_seqs}], got shape {kv_lens.shape}")
    if cu_q_lens.shape != (num_seqs + 1,):
        raise ValueError(f"cu_q_lens must be [S+1={num_seqs + 1}], got shape {cu_q_lens.shape}")
    for name, arr in (("kv_lens", kv_lens), ("block_tables", block_tables), ("cu_q_lens", cu_q_lens)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got dtype {arr.dtype}")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if attention_chunk_size is not None and int(attention_chunk_size) < 1:
        raise ValueError(f"attention_chunk_size must be a positive int or None, got {attention_chunk_size}")
    if logit_soft_cap is not None and not float(logit_soft_cap) > 0:
        raise ValueError(f"logit_soft_cap must be a positive float or None, got {logit_soft_cap}")
    if sinks is not None and (sinks.shape != (q.shape[1],) or not jnp.issubdtype(sinks.dtype, jnp.floating)):
        raise ValueError(f"sinks must be a float [Hq={q.shape[1]}] array, got {sinks.dtype}{list(sinks.shape)}")


def int32_metadata(kv_lens, block_tables, cu_q_lens) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(kv_lens, block_tables, cu_q_lens)`` as int32 (the kernels index with int32 scalars)."""
    return kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32), cu_q_lens.astype(jnp.int32)


def tile_map(cu_q_lens: jax.Array, num_tiles: int, block_q: int, align: int = 1,
             include: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Query tile -> ``(tile_seq int32[num_tiles], tile_start int32[num_tiles])``: the sequence a tile of ``block_q``
    consecutive query tokens belongs to, and its first token. Tiles beyond the real count get sequence index ``S``
    (no attention work) and, in order, the ``block_q``-token ranges of the padding tokens from ``cu_q_lens[S]`` on
    (only read by the Triton kernel's ``zero_padding_in_kernel``).

    ``align > 1``: each sequence's first tile starts at its first token rounded down to a multiple of ``align``
    (the tile's rows before the sequence belong to the previous one and must not be stored; the Mosaic kernel's TMA
    boxes need 8-row-aligned starts). At most ``sum(ceil((q_len + align - 1) / block_q))`` real tiles.

    ``include``: None, or ``bool[S]``: only those sequences get tiles (the others' rows are left to another kernel:
    the hybrid dispatch splits a batch by query length, on the device)."""
    num_seqs = cu_q_lens.shape[0] - 1
    q_start, q_end = cu_q_lens[:-1], cu_q_lens[1:]
    first_row = (q_start // align) * align
    has_tiles = q_end > q_start if include is None else (q_end > q_start) & include
    tiles_per_seq = jnp.where(has_tiles, (q_end - first_row + block_q - 1) // block_q, 0)
    tile_end = jnp.cumsum(tiles_per_seq).astype(jnp.int32)  # inclusive prefix sums
    tiles = jnp.arange(num_tiles, dtype=jnp.int32)
    # compare_all: one fused [num_tiles, S] comparison. The default binary search ("scan") lowers to an XLA
    # while loop, which on the GPU runs as host-driven iterations (log2(S) round trips per call, per layer).
    tile_seq = jnp.searchsorted(tile_end, tiles, side="right", method="compare_all").astype(jnp.int32)
    seq_clamped = jnp.minimum(tile_seq, num_seqs - 1)
    first_tile_of_seq = tile_end - tiles_per_seq
    tile_start = first_row[seq_clamped] + (tiles - first_tile_of_seq[seq_clamped]) * block_q
    padding_start = cu_q_lens[num_seqs] + (tiles - tile_end[num_seqs - 1]) * block_q
    tile_start = jnp.where(tile_seq < num_seqs, tile_start, padding_start)
    return tile_seq, tile_start.astype(jnp.int32)


def sort_tiles_longest_first(tile_seq, tile_start, cu_q_lens, kv_lens, block_q: int, sliding_window: int | None,
                             attention_chunk_size: int | None = None):
    """Permute the tile map (``tile_map``'s two int32[num_tiles] arrays) so tiles that read the most keys come
    first (ties keep their order): longest-processing-time-first dispatch, the short tiles fill the tail.

    A tile's key count is ``pos_last + 1`` (causal), capped by ``sliding_window + block_q - 1`` with a window (by
    ``attention_chunk_size + block_q - 1`` with chunks);
    empty tiles (sequence index ``S``) get ``-1`` and stay at the end, where the kernels skip them.
    """
    num_seqs = kv_lens.shape[0]
    seq = jnp.minimum(tile_seq, num_seqs - 1)
    q_end = cu_q_lens[seq + 1]
    last_token = jnp.minimum(tile_start + block_q, q_end) - 1
    keys = kv_lens[seq] - (q_end - last_token) + 1  # = pos_last + 1
    if sliding_window is not None:
        keys = jnp.minimum(keys, sliding_window + block_q - 1)
    if attention_chunk_size is not None:
        keys = jnp.minimum(keys, attention_chunk_size + block_q - 1)
    # Real tiles sort before the empty ones even when a malformed sequence (kv_len < q_len) gives a negative count.
    keys = jnp.where(tile_seq < num_seqs, jnp.maximum(keys, 0), -1)
    order = jnp.argsort(-keys, stable=True)
    return tile_seq[order], tile_start[order]


def zero_padding_tokens(out: jax.Array, cu_q_lens: jax.Array) -> jax.Array:
    """``out`` ``[T, Hq, D]`` with the rows of padding tokens (index >= ``cu_q_lens[S]``), which the kernels never
    write (garbage), set to zero."""
    token_valid = jnp.arange(out.shape[0], dtype=jnp.int32) < cu_q_lens[cu_q_lens.shape[0] - 1]
    return jnp.where(token_valid[:, None, None], out, jnp.zeros((), out.dtype))
