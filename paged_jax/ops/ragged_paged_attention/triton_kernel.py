"""Ragged paged attention as a Pallas GPU kernel (Triton lowering), runnable on CPU with ``interpret=True``.

Work decomposition
------------------
* A *query tile* holds up to ``block_q`` consecutive query tokens of ONE sequence times the ``group = Hq // Hkv``
  query heads that share one kv head: ``rows = block_q * group`` rows (padded to a power of two >= 16 for the
  tensor-core dot). Row ``r`` is token ``r // group``, query head ``kv_head * group + r % group``. Decode with GQA 4
  and ``block_q = 4`` gives a 16-row tile holding 1 real token (4 live rows); KV is read once per kv head.
* Grid ``(num_tiles, Hkv, num_kv_splits)``. ``num_tiles`` is a static upper bound ``min(T, T // block_q + S)``; the
  tile -> (sequence, first token) map (``common.tile_map``) is computed in jnp before the call (cumulative
  ``ceil(q_len / block_q)`` + searchsorted by comparison, no loop) and read from a GMEM ref in the kernel (neither
  Pallas GPU backend has scalar prefetch). Tiles past the real count exit through ``pl.when``.
* Flash decoding: the tile's KV range (in ``block_k``-key blocks) is cut into ``num_kv_splits`` contiguous chunks,
  one per program; with more than one split each program writes unnormalised partial ``(acc, max, sum)`` rows and
  a second small kernel combines them (``combine``). With one split the kernel writes the normalised output directly.
* Keys are read through the block table inside the kernel: key ``j`` of the block lives in pool row
  ``block_tables[seq, j // block_size] * block_size + j % block_size`` of the ``[num_blocks * block_size, Hkv, D]``
  view, loaded as a ``[block_k, D]`` gather (each row is ``D`` contiguous elements).
* Blocks entirely inside every row's visible range run an unmasked body; only the blocks on the causal diagonal,
  the sliding-window edge, an attention chunk's start (chunked local attention: a query sees only the keys of its own
  chunk) or the context end run the masked body.
* Online softmax in fp32 (``exp2`` with ``log2(e)`` folded into the scale); P is cast to V's dtype for the second
  dot (bf16/fp16 tensor cores), fp32 inputs use IEEE fp32 dots.
* Logit soft-capping (Gemma 2), ``cap * tanh(s / cap)`` on the scaled scores ``s``, runs in the same log2 units:
  ``log2(e) * cap * tanh(s / cap) = c * tanh(s2 / c)`` with ``s2 = log2(e) * s`` and ``c = log2(e) * cap``.
* Attention sinks (gpt-oss): the online softmax of kv split 0 starts from the row's sink instead of from nothing
  (running max ``log2(e) * sink``, running sum 1, accumulator 0), so the sink joins the denominator exactly once,
  and the combine of several splits needs no change.

Prefill tuning options (all off by default: the default kernel is the one measured in ``benchmarks/RESULTS.md``;
``benchmarks/kernels.py --sections prefill_variants`` times them):

* ``kv_heads_inner``: grid ``(Hkv, num_tiles, num_kv_splits)`` instead of ``(num_tiles, Hkv, num_kv_splits)``.
  Pallas axis 0 is CUDA's x axis, which the hardware dispatches fastest, so this launches the ``Hkv`` programs of
  one query tile next to each other.
* ``longest_tiles_first``: the tile map is sorted by descending key count (stable), so the programs with the most
  work are dispatched first and the short ones fill the tail (longest-processing-time-first scheduling). Only the
  two small GMEM tile arrays are permuted; the kernel body is unchanged. Combined with ``kv_heads_inner`` the
  order is global; without it, it is longest-first within each kv head.
* ``prefetch_pages``: the loop carries the page numbers of the *next* key block (loaded one step early), so the
  K/V addresses of a step do not wait on a block-table load issued in the same step.
* ``prescale_q``: multiply q by ``sm_scale * log2(e)`` once (rounded back to q's dtype) instead of scaling every
  ``[rows, block_k]`` score tile in fp32. Costs one rounding of the scaled q (relative 2**-8 in bf16).
* ``k_transposed``: gather K directly as ``[D, block_k]`` (the B operand of ``q @ K^T`` in K-major order, as the
  Triton flash-attention tutorial loads it) instead of ``[block_k, D]`` plus a transposed dot.
* ``zero_padding_in_kernel`` (one kv split only): ``ceil(T / block_q) + S`` tiles, enough for the padding tokens
  too; tiles past the real ones write zeros for the padding rows, so the wrapper drops its ``where`` over the whole
  output (a separate XLA pass reading and writing ``T * Hq * D`` elements). With several
  kv splits the combine kernel zeroes the padding rows anyway and the option has no effect.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from paged_jax.ops.ragged_paged_attention.combine import combine_kv_splits
from paged_jax.ops.ragged_paged_attention.common import (LOG2_E, MASK_VALUE, int32_metadata, query_tile,
                                                         sort_tiles_longest_first, tile_map, zero_padding_tokens)
from paged_jax.ops.ragged_paged_attention.common import TRITON_COMPILER_PARAMS as _CompilerParams
from paged_jax.ops.ragged_paged_attention.common import next_pow2 as _next_pow2
from paged_jax.ops.ragged_paged_attention.common import triton_load as _load, triton_store as _store

_dot = getattr(plgpu, "dot", None) or pl.dot
_FP16_MAX = float(jnp.finfo(jnp.float16).max)

# Programs wanted in flight to fill an H200 (132 SMs, 2 resident programs each) when choosing kv splits.
_TARGET_PROGRAMS = 264
_MAX_KV_SPLITS = 64


def default_tuning(
    num_tokens: int,
    num_seqs: int,
    num_q_heads: int,
    num_kv_heads: int,
    max_blocks: int,
    block_size: int,
    kv_itemsize: int = 2,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    num_kv_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    kv_heads_inner: bool = False,
    longest_tiles_first: bool = False,
    prefetch_pages: bool = False,
    prescale_q: bool = False,
    k_transposed: bool = False,
    zero_padding_in_kernel: bool = False,
    fp8_dots_in_fp16: bool | None = None,
) -> dict:
    """Static tuning for one call shape; any argument given explicitly wins.

    * ``block_q`` (tokens per tile): decode-like batches (``T <= 2 S``) use 16-row tiles (``16 // group`` tokens),
      prefill-heavy batches 64-row tiles.
    * ``block_k`` (keys per inner step): 64; 128 for a 1-byte (FP8) pool (``kv_itemsize``) with decode-like
      16-row tiles (the same bytes in flight per step as a 2-byte pool's 64; prefill tiles keep 64, untimed).
    * ``fp8_dots_in_fp16`` (1-byte pools with 16-bit queries only; default on): the FP8 K / V tiles are upcast to
      float16 (one hardware conversion per two elements on sm_89+, where bfloat16 takes three) and both dots run
      in float16 (q clipped to float16's range first; fp32 accumulation either way). Off: the tiles are upcast to
      q's dtype.
    * ``num_kv_splits``: enough programs to fill the GPU (``ceil(264 / (num_tiles * Hkv))``), at most one split per
      ``block_k`` keys of the longest possible context and at most 64.
    * ``num_warps`` 4; ``num_stages`` 2 for 16-row (decode) tiles, 3 for larger (prefill) tiles.
    * The boolean prefill options (module docstring) are passed through unchanged (default off).
    """
    group = num_q_heads // num_kv_heads
    block_q, rows = query_tile(num_tokens, num_seqs, group, block_q)
    if block_k is None:
        block_k = 128 if kv_itemsize == 1 and rows <= 16 else 64
    if fp8_dots_in_fp16 is None:
        fp8_dots_in_fp16 = kv_itemsize == 1
    num_tiles = max(1, min(num_tokens, num_tokens // block_q + num_seqs))
    if zero_padding_in_kernel:
        # Real tiles sum(ceil(q_len / block_q)) plus ceil(padding / block_q) never exceed this (nor T).
        num_tiles = max(1, min(num_tokens, -(-num_tokens // block_q) + num_seqs))
    max_kv_blocks = max(1, -(-(max_blocks * block_size) // block_k))
    if num_kv_splits is None:
        programs = num_tiles * num_kv_heads
        num_kv_splits = max(1, min(_MAX_KV_SPLITS, max_kv_blocks, -(-_TARGET_PROGRAMS // programs)))
    if num_warps is None:
        num_warps = 4
    if num_stages is None:
        num_stages = 2 if rows <= 16 else 3
    zero_padding_in_kernel = bool(zero_padding_in_kernel) and int(num_kv_splits) == 1
    return dict(
        block_q=block_q,
        rows=rows,
        block_k=int(block_k),
        num_tiles=num_tiles,
        num_kv_splits=int(num_kv_splits),
        num_warps=int(num_warps),
        num_stages=int(num_stages),
        kv_heads_inner=bool(kv_heads_inner),
        longest_tiles_first=bool(longest_tiles_first),
        prefetch_pages=bool(prefetch_pages),
        prescale_q=bool(prescale_q),
        k_transposed=bool(k_transposed),
        zero_padding_in_kernel=zero_padding_in_kernel,
        fp8_dots_in_fp16=bool(fp8_dots_in_fp16),
    )


def _kernel(
    tile_seq_ref,  # int32[num_tiles]
    tile_start_ref,  # int32[num_tiles]
    cu_q_lens_ref,  # int32[S+1]
    kv_lens_ref,  # int32[S]
    block_tables_ref,  # int32[S, max_blocks]
    q_ref,  # [T * Hq, D]
    k_ref,  # [num_blocks * block_size, Hkv, D]
    v_ref,  # [num_blocks * block_size, Hkv, D]
    *refs,  # has_sinks: sinks f32[Hq] first; then split == 1: out [T * Hq, D]; else acc f32[NS, T*Hq, D],
    # m f32[NS, T*Hq], l f32[NS, T*Hq]
    has_sinks: bool,
    num_seqs: int,
    num_q_heads: int,
    group: int,
    block_q: int,
    rows: int,
    block_k: int,
    block_size: int,
    max_blocks: int,
    num_kv_splits: int,
    scale_log2: float,
    sliding_window: int | None,
    attention_chunk: int | None,
    soft_cap_log2: float | None,
    precision,
    kv_heads_inner: bool,
    prefetch_pages: bool,
    prescale_q: bool,
    k_transposed: bool,
    zero_padding_in_kernel: bool,
    fp8_dots_in_fp16: bool,
):
    if kv_heads_inner:
        kv_head, tile = pl.program_id(0), pl.program_id(1)
    else:
        tile, kv_head = pl.program_id(0), pl.program_id(1)
    split = pl.program_id(2)
    seq = tile_seq_ref[tile]
    sinks_ref, out_refs = (refs[0], refs[1:]) if has_sinks else (None, refs)

    if zero_padding_in_kernel:

        @pl.when(seq == num_seqs)
        def _():
            # A padding tile: zeros for this kv head's query heads of tokens [tile_start, tile_start + block_q).
            (out_ref,) = out_refs
            num_rows, head_dim = out_ref.shape
            row = jnp.arange(rows, dtype=jnp.int32)
            token = tile_start_ref[tile] + row // group
            row_valid = (row < block_q * group) & (token < num_rows // num_q_heads)
            store_row = jnp.where(row_valid, token * num_q_heads + kv_head * group + row % group, num_rows)
            dim = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
            mask = jnp.broadcast_to(row_valid[:, None], (rows, head_dim))
            _store(out_ref.at[store_row[:, None], dim], jnp.zeros((rows, head_dim), out_ref.dtype), mask=mask)

    @pl.when(seq < num_seqs)
    def _():
        q_start = cu_q_lens_ref[seq]
        q_end = cu_q_lens_ref[seq + 1]
        kv_len = kv_lens_ref[seq]
        tile_start = tile_start_ref[tile]
        num_tile_tokens = jnp.minimum(block_q, q_end - tile_start)
        # Context position of the tile's first query token; later tokens follow consecutively.
        pos_first = kv_len - (q_end - q_start) + (tile_start - q_start)
        pos_last = pos_first + num_tile_tokens - 1

        row = jnp.arange(rows, dtype=jnp.int32)
        row_token = row // group
        row_valid = (row < block_q * group) & (row_token < num_tile_tokens)
        q_row_index = (tile_start + row_token) * num_q_heads + kv_head * group + row % group
        head_dim = q_ref.shape[1]
        dim = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
        dim_col = jnp.arange(head_dim, dtype=jnp.int32)[:, None]  # for the transposed K gather
        # Only integer-array indexers (no slices) so that the same code runs in interpret mode, where the
        # discharge rules do not accept mixed array/slice indexing.
        q_load_row = jnp.where(row_valid, q_row_index, 0)[:, None]
        row_mask = jnp.broadcast_to(row_valid[:, None], (rows, head_dim))
        q = _load(q_ref.at[q_load_row, dim], mask=row_mask, other=0.0)  # [rows, D]
        if prescale_q:
            # Scores come out of the first dot already in log2 units: no per-step [rows, block_k] multiply.
            q = (q.astype(jnp.float32) * scale_log2).astype(q.dtype)
            score_scale = None
        else:
            score_scale = scale_log2
        # The dtype K / V tiles are upcast to and the dots run in (see ``default_tuning``).
        dot_dtype = jnp.float16 if fp8_dots_in_fp16 else q_ref.dtype
        if fp8_dots_in_fp16:
            q = jnp.clip(q.astype(jnp.float32), -_FP16_MAX, _FP16_MAX).astype(jnp.float16)
        # Masked-off rows store to an out-of-range row: dropped by the GPU mask and by interpret-mode scatter
        # (a clamped index could collide with a real row there).
        q_store_row = jnp.where(row_valid, q_row_index, q_ref.shape[0])
        # Padded rows act like the last real token so that they never see fewer keys than it (keeps them finite).
        row_pos = pos_first + jnp.minimum(row_token, num_tile_tokens - 1)

        # Key range of the whole tile, and the sub-range that every row sees in full (no mask needed there).
        key_hi = pos_last + 1
        full_hi = pos_first + 1
        # A row at p sees keys from lowest_key(p) on, nondecreasing in p: the tile's first row bounds the range,
        # its last row the keys every row sees.
        key_lo = _lowest_key(pos_first, sliding_window, attention_chunk)
        full_lo = _lowest_key(pos_last, sliding_window, attention_chunk)
        kb_lo = key_lo // block_k
        kb_hi = (key_hi + block_k - 1) // block_k
        unmasked_lo = jnp.maximum((full_lo + block_k - 1) // block_k, kb_lo)
        unmasked_hi = jnp.maximum(full_hi // block_k, unmasked_lo)

        # This program's share of the key blocks.
        blocks_per_split = (kb_hi - kb_lo + num_kv_splits - 1) // num_kv_splits
        split_lo = jnp.minimum(kb_lo + split * blocks_per_split, kb_hi)
        split_hi = jnp.minimum(split_lo + blocks_per_split, kb_hi)
        u_lo = jnp.clip(unmasked_lo, split_lo, split_hi)
        u_hi = jnp.clip(unmasked_hi, split_lo, split_hi)
        num_lead = u_lo - split_lo  # masked blocks before the unmasked run (sliding-window edge)
        num_trail = split_hi - u_hi  # masked blocks after it (causal diagonal / context end)

        key_offsets = jnp.arange(block_k, dtype=jnp.int32)

        def load_pages(kb):
            """int32[block_k]: pool block holding each key of key block ``kb`` (one entry per K/V row, so a
            block_k tile may span several pages). Slots past the table read entry 0 (never visible)."""
            page_slot = (kb * block_k + key_offsets) // block_size
            return _load(
                block_tables_ref.at[seq, jnp.minimum(page_slot, max_blocks - 1)],
                mask=page_slot < max_blocks,
                other=0,
            )

        def load_kv(kb, page, masked):
            key_pos = kb * block_k + key_offsets
            pool_row = page * block_size + key_pos % block_size
            if k_transposed:
                k = k_ref[pool_row[None, :], kv_head, dim_col]  # [D, block_k]
            else:
                k = k_ref[pool_row[:, None], kv_head, dim]  # [block_k, D]
            pool_row = pool_row[:, None]
            if masked:
                # Past the context end the slots hold stale data; zero V so 0 * garbage cannot make NaN.
                in_context = jnp.broadcast_to((key_pos < kv_len)[:, None], (block_k, head_dim))
                v = _load(v_ref.at[pool_row, kv_head, dim], mask=in_context, other=0.0)
            else:
                v = v_ref[pool_row, kv_head, dim]
            # An FP8 pool (--kv-cache-dtype fp8) is dequantized on load (its scales are folded into q / the output
            # by the model); a no-op for a pool of q's dtype.
            return key_pos, k.astype(dot_dtype), v.astype(dot_dtype)

        def step(kb, page, carry, masked):
            acc, m_prev, l_prev = carry
            key_pos, k, v = load_kv(kb, page, masked)
            s = _dot(q, k, trans_b=not k_transposed, precision=precision)  # [rows, block_k] f32
            if score_scale is not None:
                s = s * score_scale
            if soft_cap_log2 is not None:
                s = soft_cap_log2 * jnp.tanh(s / soft_cap_log2)
            if masked:
                visible = (key_pos[None, :] <= row_pos[:, None]) & (key_pos[None, :] < kv_len)
                if sliding_window is not None:
                    visible &= key_pos[None, :] > row_pos[:, None] - sliding_window
                if attention_chunk is not None:
                    visible &= key_pos[None, :] >= row_pos[:, None] // attention_chunk * attention_chunk
                s = jnp.where(visible, s, MASK_VALUE)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
            correction = jnp.exp2(m_prev - m_next)
            p = jnp.exp2(s - m_next[:, None])
            l_next = l_prev * correction + jnp.sum(p, axis=1)
            pv = _dot(p.astype(v.dtype), v, precision=precision)
            acc = acc * correction[:, None] + pv
            return acc, m_next, l_next

        carry = (jnp.zeros((rows, head_dim), jnp.float32), *_initial_max_and_sum(
            sinks_ref, kv_head * group + row % group, split, rows))
        # Unmasked run first, then the masked blocks: the sliding-window edge [split_lo, u_lo) followed by the
        # causal diagonal / context end [u_hi, split_hi), walked by one loop.
        def masked_block(i):
            return jnp.where(i < num_lead, split_lo + i, u_hi + (i - num_lead))

        num_masked = num_lead + num_trail
        if prefetch_pages:
            # Each step loads the next block's page numbers and carries them; the block after the last one is
            # clamped inside the table (a harmless, unused load).
            def unmasked_body(kb, c):
                page, attn = c
                return load_pages(kb + 1), step(kb, page, attn, False)

            _, carry = lax.fori_loop(u_lo, u_hi, unmasked_body, (load_pages(u_lo), carry))

            def masked_body(i, c):
                page, attn = c
                return load_pages(masked_block(i + 1)), step(masked_block(i), page, attn, True)

            _, (acc, m_i, l_i) = lax.fori_loop(0, num_masked, masked_body, (load_pages(masked_block(0)), carry))
        else:
            carry = lax.fori_loop(u_lo, u_hi, lambda kb, c: step(kb, load_pages(kb), c, False), carry)
            acc, m_i, l_i = lax.fori_loop(
                0, num_masked, lambda i, c: step(masked_block(i), load_pages(masked_block(i)), c, True), carry)

        store_row = q_store_row[:, None]
        if num_kv_splits == 1:
            (out_ref,) = out_refs
            out = acc / jnp.where(l_i > 0, l_i, 1.0)[:, None]
            _store(out_ref.at[store_row, dim], out.astype(out_ref.dtype), mask=row_mask)
        else:
            acc_ref, m_ref, l_ref = out_refs
            _store(acc_ref.at[split, store_row, dim], acc, mask=row_mask)
            _store(m_ref.at[split, q_store_row], m_i, mask=row_valid)
            _store(l_ref.at[split, q_store_row], l_i, mask=row_valid)


def _lowest_key(pos, sliding_window: int | None, attention_chunk: int | None):
    """The first key position a query at ``pos`` sees: 0, ``pos - window + 1`` with a sliding window, its chunk's
    start with chunked attention."""
    lowest = 0 if sliding_window is None else jnp.maximum(pos - sliding_window + 1, 0)
    if attention_chunk is not None:
        lowest = jnp.maximum(lowest, pos // attention_chunk * attention_chunk)
    return lowest


def _initial_max_and_sum(sinks_ref, head, split, rows: int) -> tuple[jax.Array, jax.Array]:
    """The online softmax's starting ``(max, sum)``, f32[rows] each: empty (``MASK_VALUE``, 0), or with attention
    sinks in kv split 0 the sink of each row's query head ``head`` int32[rows] (``log2(e) * sink``, 1)."""
    empty = jnp.full((rows,), MASK_VALUE, jnp.float32), jnp.zeros((rows,), jnp.float32)
    if sinks_ref is None:
        return empty
    sink = _load(sinks_ref.at[head]) * LOG2_E
    first = split == 0
    return jnp.where(first, sink, empty[0]), jnp.where(first, 1.0, empty[1])


def ragged_paged_attention_triton(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, *, sm_scale: float,
                                  sliding_window: int | None = None, logit_soft_cap: float | None = None,
                                  sinks: jax.Array | None = None, interpret: bool = False,
                                  max_q_len: int | None = None, attention_chunk_size: int | None = None,
                                  **tuning) -> jax.Array:
    """Pallas (Triton lowering) ragged paged attention. Shapes as in ``ragged_paged_attention``: q ``[T, Hq, D]``,
    pools ``[num_blocks, block_size, Hkv, D]``, ``kv_lens int32[S]``, ``block_tables int32[S, max_blocks]``,
    ``cu_q_lens int32[S+1]``.

    Requires ``head_dim`` to be a power of two >= 16 (Triton block shapes). Returns ``[T, Hq, D]`` in ``q.dtype``
    with zeros for padding tokens. ``tuning``: the keyword arguments of ``default_tuning`` (module docstring).
    ``logit_soft_cap``: None, or the cap of ``cap * tanh(s / cap)`` on the scaled scores (as the reference).
    ``sinks``: None, or ``[Hq]`` attention-sink logits (as the reference).
    ``attention_chunk_size``: None, or the chunk of chunked local attention (as the reference).
    ``max_q_len`` (static; None = every sequence): attend only the sequences with at most this many query tokens
    (decided on the device from ``cu_q_lens``); the rows of the others are left unwritten (the hybrid dispatch
    hands them to the Mosaic kernel, which writes them into this output).
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_pages.shape
    num_seqs, max_blocks = block_tables.shape
    if head_dim < 16 or head_dim != _next_pow2(head_dim):
        raise ValueError(f"head_dim must be a power of two >= 16 for the Pallas kernel, got {head_dim}")
    group = num_q_heads // num_kv_heads
    kv_itemsize = jnp.dtype(k_pages.dtype).itemsize
    fp8_dots_possible = kv_itemsize == 1 and jnp.dtype(q.dtype).itemsize == 2
    if tuning.get("fp8_dots_in_fp16") and not fp8_dots_possible:
        raise ValueError(f"fp8_dots_in_fp16 needs a 1-byte KV pool and 16-bit queries, got {k_pages.dtype} pools "
                         f"and {q.dtype} queries")
    tuning = default_tuning(num_tokens, num_seqs, num_q_heads, num_kv_heads, max_blocks, block_size, kv_itemsize,
                            **tuning)
    if not fp8_dots_possible:
        tuning["fp8_dots_in_fp16"] = False
    bk = tuning["block_k"]
    if bk < 16 or bk != _next_pow2(bk):
        raise ValueError(f"block_k must be a power of two >= 16, got {bk}")
    num_splits = tuning["num_kv_splits"]
    num_tiles = tuning["num_tiles"]

    kv_lens, block_tables, cu_q_lens = int32_metadata(kv_lens, block_tables, cu_q_lens)
    include = None if max_q_len is None else (cu_q_lens[1:] - cu_q_lens[:-1]) <= max_q_len
    tile_seq, tile_start = tile_map(cu_q_lens, num_tiles, tuning["block_q"], include=include)
    if tuning["longest_tiles_first"]:
        tile_seq, tile_start = sort_tiles_longest_first(
            tile_seq, tile_start, cu_q_lens, kv_lens, tuning["block_q"],
            None if sliding_window is None else int(sliding_window),
            None if attention_chunk_size is None else int(attention_chunk_size))

    q_rows = q.reshape(num_tokens * num_q_heads, head_dim)
    k_flat = k_pages.reshape(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_pages.reshape(num_blocks * block_size, num_kv_heads, head_dim)

    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
    kernel = functools.partial(
        _kernel,
        has_sinks=sinks is not None,
        num_seqs=num_seqs,
        num_q_heads=num_q_heads,
        group=group,
        block_q=tuning["block_q"],
        rows=tuning["rows"],
        block_k=bk,
        block_size=block_size,
        max_blocks=max_blocks,
        num_kv_splits=num_splits,
        scale_log2=float(sm_scale) * LOG2_E,
        sliding_window=None if sliding_window is None else int(sliding_window),
        attention_chunk=None if attention_chunk_size is None else int(attention_chunk_size),
        soft_cap_log2=None if logit_soft_cap is None else float(logit_soft_cap) * LOG2_E,
        precision=precision,
        kv_heads_inner=tuning["kv_heads_inner"],
        prefetch_pages=tuning["prefetch_pages"],
        prescale_q=tuning["prescale_q"],
        k_transposed=tuning["k_transposed"],
        zero_padding_in_kernel=tuning["zero_padding_in_kernel"],
        fp8_dots_in_fp16=tuning["fp8_dots_in_fp16"],
    )
    n_rows = num_tokens * num_q_heads
    if num_splits == 1:
        out_shape = [jax.ShapeDtypeStruct((n_rows, head_dim), q.dtype)]
    else:
        out_shape = [
            jax.ShapeDtypeStruct((num_splits, n_rows, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, n_rows), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, n_rows), jnp.float32),
        ]
    if tuning["kv_heads_inner"]:
        grid = (num_kv_heads, num_tiles, num_splits)
    else:
        grid = (num_tiles, num_kv_heads, num_splits)
    # Kernel name carries the options so profiles tell variants apart.
    flags = "".join(tag for key, tag in (("kv_heads_inner", "_hi"), ("longest_tiles_first", "_lf"),
                                         ("prefetch_pages", "_pp"), ("prescale_q", "_sq"), ("k_transposed", "_kt"),
                                         ("zero_padding_in_kernel", "_zp"), ("fp8_dots_in_fp16", "_f16"))
                    if tuning[key])
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=tuning["num_warps"], num_stages=tuning["num_stages"]),
        name=f"ragged_paged_attention_bq{tuning['block_q']}_bk{bk}_s{num_splits}{flags}"
             f"{'_sinks' if sinks is not None else ''}",
    )(tile_seq, tile_start, cu_q_lens, kv_lens, block_tables, q_rows, k_flat, v_flat,
      *(() if sinks is None else (sinks.astype(jnp.float32),)))

    if num_splits > 1:  # one kernel: the weighted sum over splits, normalised, padding rows zeroed
        return combine_kv_splits(*outs, cu_q_lens, num_q_heads, q.dtype, interpret=interpret).reshape(
            num_tokens, num_q_heads, head_dim)
    out = outs[0].reshape(num_tokens, num_q_heads, head_dim)
    if tuning["zero_padding_in_kernel"]:  # the padding tiles wrote the zeros
        return out
    return zero_padding_tokens(out, cu_q_lens)
