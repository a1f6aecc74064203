"""Multi-head latent attention (DeepSeek-V2 / V3, ``models.mla``) over the paged latent cache, absorbed-weight form,
as a Pallas GPU kernel (Triton lowering), runnable on CPU with ``interpret=True``.

The call is ``ragged_paged_attention``'s for a latent cache: q ``[T, H, L + R]`` (each head's query absorbed into
latent space, then its rotated rope part), one KV head whose pool rows are ``[latent | k_pe]`` (``k_pages``
``[num_blocks, block_size, 1, L + R]``, ``v_pages`` of width 0) and values ``V = K[..., :L]``; the output is the
latent attention ``[T, H, L]``. ``L`` (``kv_lora_rank``, 512 in DeepSeek) and ``R`` (``qk_rope_head_dim``, 64) must
be powers of two >= 16 (Triton block shapes; ``supported``).

Work decomposition (FlashMLA's, on the Triton kernel's tile map)
----------------------------------------------------------------
* Every query head shares the one latent KV head, so a program takes a *tile* of ``block_q`` consecutive query
  tokens of ONE sequence times ``block_h`` consecutive heads: ``rows = block_q * block_h`` rows (padded to a power
  of two >= 16 for the tensor-core dot). Row ``r`` is token ``r // block_h``, head ``head_block * block_h + r %
  block_h``. A decode tile of DeepSeek-V2-Lite (16 heads) is one token x 16 heads: every key row it loads serves 16
  query rows.
* Grid ``(num_head_blocks, num_tiles, num_kv_splits)``: axis 0 is CUDA's x axis, dispatched fastest, so the head
  blocks of one tile (DeepSeek-V3's 128 heads: four) run side by side and read the same pages through L2. The tile
  -> (sequence, first token) map is ``common.tile_map``'s, read from GMEM (as ``triton_kernel``). Tiles past the
  real count exit through ``pl.when``.
* Each step loads a ``[block_k, L]`` latent tile and a ``[block_k, R]`` rope tile of the same pool rows, through
  the block table; scores are ``q_nope @ latent^T + q_pe @ k_pe^T`` and the latent tile is also V:
  ``acc += p @ latent`` (``acc`` ``[rows, L]`` f32). The cache is read once per (tile, head block), never expanded.
* Online softmax in fp32 with ``exp2`` (``log2(e)`` folded into the scale); P is cast to the K tile's dot dtype
  (q's) for the second dot, fp32 inputs use IEEE fp32 dots. An FP8 pool is upcast to q's dtype on load.
* Key blocks entirely before the tile's first query run an unmasked body; the causal diagonal and the context end
  run the masked body, whose loads zero the rows past the context (stale slots must not make ``0 * NaN``).
* Flash decoding: the tile's key blocks are cut into ``num_kv_splits`` contiguous chunks, one per program; with
  several, each writes unnormalised ``(acc, max, sum)`` rows and ``combine.combine_kv_splits`` merges them (its rows
  are ``token * H + head``, its width ``L``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from paged_jax.ops.ragged_paged_attention.combine import combine_kv_splits
from paged_jax.ops.ragged_paged_attention.common import (LOG2_E, MASK_VALUE, int32_metadata, query_tile, tile_map,
                                                         zero_padding_tokens)
from paged_jax.ops.ragged_paged_attention.common import TRITON_COMPILER_PARAMS as _CompilerParams
from paged_jax.ops.ragged_paged_attention.common import next_pow2 as _next_pow2
from paged_jax.ops.ragged_paged_attention.common import triton_load as _load, triton_store as _store

_dot = getattr(plgpu, "dot", None) or pl.dot

# Programs wanted in flight to fill an H100 / H200 (132 SMs, 2 resident programs each) when choosing kv splits.
_TARGET_PROGRAMS = 264
_MAX_KV_SPLITS = 64
_MAX_GRID_YZ = 65535


def supported(q_shape, k_pages_shape, v_head_dim: int | None) -> str | None:
    """None if the kernel runs this latent call shape, else why not: one KV head, ``L = v_head_dim`` and
    ``R = D - L`` powers of two >= 16."""
    if v_head_dim is None:
        return "not a latent cache (no v_head_dim)"
    if k_pages_shape[2] != 1:
        return f"a latent cache has one KV head, got {k_pages_shape[2]}"
    rope_dim = q_shape[-1] - v_head_dim
    for name, dim in (("latent width (v_head_dim)", v_head_dim), ("rope width (head_dim - v_head_dim)", rope_dim)):
        if dim < 16 or dim & (dim - 1):
            return f"the {name} must be a power of two >= 16, got {dim}"
    return None


def default_tuning(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    latent_dim: int,
    max_blocks: int,
    block_size: int,
    *,
    block_h: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> dict:
    """Static tuning for one call shape; any argument given explicitly wins.

    * ``block_h`` (heads per tile): all heads up to 32 (DeepSeek-V2-Lite's 16 in one tile; V3's 128 in four).
    * ``block_q`` (tokens per tile): decode-like batches (``T <= 2 S``) fill 16 rows (``16 // block_h`` tokens, at
      least one), prefill-heavy ones 64 rows.
    * ``block_k`` (keys per step): 32 for a latent row wider than 256 elements (a ``[32, L + R]`` bf16 tile is
      36 KB of shared memory per pipeline stage at DeepSeek's 576), else 64.
    * ``num_kv_splits``: enough programs to fill the GPU (``ceil(264 / (num_tiles * num_head_blocks))``), at most
      one split per ``block_k`` keys of the longest possible context and at most 64.
    * ``num_warps`` 4 for tiles of up to 32 rows, else 8 (the ``[rows, L]`` f32 accumulator lives in registers);
      ``num_stages`` 2.
    """
    if block_h is None:
        block_h = min(num_heads, 32)
    block_h = int(max(1, min(block_h, num_heads)))
    block_q, rows = query_tile(num_tokens, num_seqs, block_h, block_q)
    if block_k is None:
        block_k = 32 if latent_dim > 256 else 64
    num_tiles = max(1, min(num_tokens, num_tokens // block_q + num_seqs))
    num_head_blocks = -(-num_heads // block_h)
    max_kv_blocks = max(1, -(-(max_blocks * block_size) // block_k))
    if num_kv_splits is None:
        programs = num_tiles * num_head_blocks
        num_kv_splits = max(1, min(_MAX_KV_SPLITS, max_kv_blocks, -(-_TARGET_PROGRAMS // programs)))
    if num_warps is None:
        num_warps = 4 if rows <= 32 else 8
    if num_stages is None:
        num_stages = 2
    return dict(block_h=block_h, block_q=block_q, rows=rows, block_k=int(block_k), num_tiles=num_tiles,
                num_head_blocks=num_head_blocks, num_kv_splits=int(num_kv_splits), num_warps=int(num_warps),
                num_stages=int(num_stages))


class _Static(NamedTuple):
    """The kernel's static configuration (one call shape and its tuning)."""

    num_seqs: int
    num_heads: int
    latent_dim: int
    rope_dim: int
    block_h: int
    block_q: int
    rows: int
    block_k: int
    block_size: int
    max_blocks: int
    num_kv_splits: int
    scale_log2: float
    precision: Any


def _kernel(tile_seq_ref, tile_start_ref, cu_q_lens_ref, kv_lens_ref, block_tables_ref, q_ref, k_ref, *out_refs,
            c: _Static):
    """Refs: tile_seq / tile_start int32[num_tiles], cu_q_lens int32[S+1], kv_lens int32[S], block_tables
    int32[S, max_blocks], q [T * H, L + R], k [num_blocks * block_size, L + R]; out_refs: with one kv split out
    [T * H, L], else acc f32[NS, T * H, L], m f32[NS, T * H], l f32[NS, T * H]."""
    head_block, tile, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = tile_seq_ref[tile]

    @pl.when(seq < c.num_seqs)
    def _():
        q_end, kv_len, tile_start = cu_q_lens_ref[seq + 1], kv_lens_ref[seq], tile_start_ref[tile]
        num_tile_tokens = jnp.minimum(c.block_q, q_end - tile_start)
        # Context position of the tile's first query token; later tokens follow consecutively.
        pos_first = kv_len - (q_end - cu_q_lens_ref[seq]) + (tile_start - cu_q_lens_ref[seq])

        row = jnp.arange(c.rows, dtype=jnp.int32)
        row_token, row_head = row // c.block_h, head_block * c.block_h + row % c.block_h
        row_valid = (row < c.block_q * c.block_h) & (row_token < num_tile_tokens) & (row_head < c.num_heads)
        q_row_index = (tile_start + row_token) * c.num_heads + row_head
        # Padded rows act like the tile's last real token so that they never see fewer keys than it (finite).
        row_pos = pos_first + jnp.minimum(row_token, num_tile_tokens - 1)
        lat, rope = _columns(c)
        # Only integer-array indexers (no slices), so that the same code runs in interpret mode.
        q_load_row = jnp.where(row_valid, q_row_index, 0)[:, None]
        lat_mask = jnp.broadcast_to(row_valid[:, None], (c.rows, c.latent_dim))
        q_nope = _load(q_ref.at[q_load_row, lat], mask=lat_mask, other=0.0)  # [rows, L]
        q_pe = _load(q_ref.at[q_load_row, rope], mask=jnp.broadcast_to(row_valid[:, None], (c.rows, c.rope_dim)),
                     other=0.0)  # [rows, R]

        # Key blocks: [0, kb_hi) in all; those before the tile's first query position are visible to every row.
        kb_hi = (pos_first + num_tile_tokens + c.block_k - 1) // c.block_k
        blocks_per_split = (kb_hi + c.num_kv_splits - 1) // c.num_kv_splits
        split_lo = jnp.minimum(split * blocks_per_split, kb_hi)
        split_hi = jnp.minimum(split_lo + blocks_per_split, kb_hi)
        u_hi = jnp.clip((pos_first + 1) // c.block_k, split_lo, split_hi)
        step = functools.partial(_key_block, k_ref, block_tables_ref, seq, kv_len, q_nope, q_pe, row_pos, c=c)
        carry = (jnp.zeros((c.rows, c.latent_dim), jnp.float32), jnp.full((c.rows,), MASK_VALUE, jnp.float32),
                 jnp.zeros((c.rows,), jnp.float32))
        carry = lax.fori_loop(split_lo, u_hi, lambda kb, carry: step(kb, carry, masked=False), carry)
        acc, m_i, l_i = lax.fori_loop(u_hi, split_hi, lambda kb, carry: step(kb, carry, masked=True), carry)

        # Masked-off rows store to an out-of-range row: dropped by the GPU mask and by interpret-mode scatter.
        store_row = jnp.where(row_valid, q_row_index, q_ref.shape[0])
        if c.num_kv_splits == 1:
            (out_ref,) = out_refs
            out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
            _store(out_ref.at[store_row[:, None], lat], out.astype(out_ref.dtype), mask=lat_mask)
        else:
            acc_ref, m_ref, l_ref = out_refs
            _store(acc_ref.at[split, store_row[:, None], lat], acc, mask=lat_mask)
            _store(m_ref.at[split, store_row], m_i, mask=row_valid)
            _store(l_ref.at[split, store_row], l_i, mask=row_valid)


def _columns(c: _Static) -> tuple[jax.Array, jax.Array]:
    """Column indices int32[1, L] of the latent part and int32[1, R] of the rope part of a q or pool row."""
    return (jnp.arange(c.latent_dim, dtype=jnp.int32)[None, :],
            c.latent_dim + jnp.arange(c.rope_dim, dtype=jnp.int32)[None, :])


def _key_block(k_ref, block_tables_ref, seq, kv_len, q_nope, q_pe, row_pos, kb, carry, *, masked: bool,
               c: _Static):
    """One step of the online softmax over key block ``kb`` of sequence ``seq``: carry ``(acc f32[rows, L],
    max f32[rows], sum f32[rows])`` in log2 units; ``masked``: mask keys past ``row_pos`` int32[rows] (causal) or
    ``kv_len``, whose rows load as zeros (stale slots must not make ``0 * NaN``)."""
    acc, m_prev, l_prev = carry
    lat, rope = _columns(c)
    key_pos = kb * c.block_k + jnp.arange(c.block_k, dtype=jnp.int32)
    page_slot = key_pos // c.block_size
    # Slots past the table read entry 0 (never visible).
    page = _load(block_tables_ref.at[seq, jnp.minimum(page_slot, c.max_blocks - 1)], mask=page_slot < c.max_blocks,
                 other=0)
    pool_row = (page * c.block_size + key_pos % c.block_size)[:, None]
    if masked:
        in_context = (key_pos < kv_len)[:, None]
        latent = _load(k_ref.at[pool_row, lat], mask=jnp.broadcast_to(in_context, (c.block_k, c.latent_dim)),
                       other=0.0)
        k_pe = _load(k_ref.at[pool_row, rope], mask=jnp.broadcast_to(in_context, (c.block_k, c.rope_dim)), other=0.0)
    else:
        latent, k_pe = k_ref[pool_row, lat], k_ref[pool_row, rope]
    latent, k_pe = latent.astype(q_nope.dtype), k_pe.astype(q_nope.dtype)  # an FP8 pool: upcast on load
    s = _dot(q_nope, latent, trans_b=True, precision=c.precision)  # [rows, block_k] f32
    s = (s + _dot(q_pe, k_pe, trans_b=True, precision=c.precision)) * c.scale_log2
    if masked:
        visible = (key_pos[None, :] <= row_pos[:, None]) & (key_pos[None, :] < kv_len)
        s = jnp.where(visible, s, MASK_VALUE)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    correction = jnp.exp2(m_prev - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = l_prev * correction + jnp.sum(p, axis=1)
    acc = acc * correction[:, None] + _dot(p.astype(latent.dtype), latent, precision=c.precision)
    return acc, m_next, l_next


def mla_paged_attention(q, k_pages, kv_lens, block_tables, cu_q_lens, *, sm_scale: float, v_head_dim: int,
                        interpret: bool = False, **tuning) -> jax.Array:
    """Absorbed-weight latent attention over the paged latent cache (module docstring).

    Args:
      q: ``[T, H, L + R]``: each head's absorbed query ``W_UK[h] q_nope[h]`` then its rotated ``q_pe[h]``.
      k_pages: ``[num_blocks, block_size, 1, L + R]`` rows ``[latent | k_pe]``, new rows already written; any float
        dtype (an FP8 pool is upcast to q's dtype on load).
      kv_lens ``int32[S]``, block_tables ``int32[S, max_blocks]``, cu_q_lens ``int32[S+1]``: as in
        ``ragged_paged_attention``.
      sm_scale: static Python float multiplying ``q . k``.
      v_head_dim: ``L``, the values' width (the K rows' first ``L`` columns).
      tuning: the keyword-only arguments of ``default_tuning``.

    Returns:
      ``[T, H, L]`` in ``q.dtype``, zeros for padding tokens (index >= ``cu_q_lens[S]``).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, _, _ = k_pages.shape
    num_seqs, max_blocks = block_tables.shape
    reason = supported(q.shape, k_pages.shape, v_head_dim)
    if reason is not None:
        raise ValueError(f"the MLA kernel does not run this call: {reason}")
    tuning = default_tuning(num_tokens, num_seqs, num_heads, v_head_dim, max_blocks, block_size, **tuning)
    block_k, num_splits = tuning["block_k"], tuning["num_kv_splits"]
    if block_k < 16 or block_k != _next_pow2(block_k):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    if max(tuning["num_tiles"], num_splits) > _MAX_GRID_YZ:  # CUDA's y / z grid sides
        raise ValueError(f"{tuning['num_tiles']} query tiles x {num_splits} kv splits exceed the GPU grid's "
                         f"{_MAX_GRID_YZ} per side: fewer tokens per call or a larger block_q")

    kv_lens, block_tables, cu_q_lens = int32_metadata(kv_lens, block_tables, cu_q_lens)
    tile_seq, tile_start = tile_map(cu_q_lens, tuning["num_tiles"], tuning["block_q"])
    kernel = functools.partial(_kernel, c=_Static(
        num_seqs=num_seqs, num_heads=num_heads, latent_dim=v_head_dim, rope_dim=head_dim - v_head_dim,
        block_h=tuning["block_h"], block_q=tuning["block_q"], rows=tuning["rows"], block_k=block_k,
        block_size=block_size, max_blocks=max_blocks, num_kv_splits=num_splits,
        scale_log2=float(sm_scale) * LOG2_E, precision=lax.Precision.HIGHEST if q.dtype == jnp.float32 else None))
    n_rows = num_tokens * num_heads
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((n_rows, v_head_dim), q.dtype)]
    else:
        out_shape = [jax.ShapeDtypeStruct((num_splits, n_rows, v_head_dim), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, n_rows), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, n_rows), jnp.float32)]
    outs = pl.pallas_call(
        kernel,
        grid=(tuning["num_head_blocks"], tuning["num_tiles"], num_splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=tuning["num_warps"], num_stages=tuning["num_stages"]),
        name=f"mla_paged_attention_bh{tuning['block_h']}_bq{tuning['block_q']}_bk{block_k}_s{num_splits}",
    )(tile_seq, tile_start, cu_q_lens, kv_lens, block_tables, q.reshape(n_rows, head_dim),
      k_pages.reshape(num_blocks * block_size, head_dim))
    if num_splits > 1:  # one kernel: the weighted sum over splits, normalised, padding rows zeroed
        return combine_kv_splits(*outs, cu_q_lens, num_heads, q.dtype, interpret=interpret).reshape(
            num_tokens, num_heads, v_head_dim)
    return zero_padding_tokens(outs[0].reshape(num_tokens, num_heads, v_head_dim), cu_q_lens)
