"""Ragged paged attention for prefill-heavy batches on Hopper: a Pallas Mosaic GPU kernel.

Same interface and result as ``triton_kernel.ragged_paged_attention_triton`` (and the jnp reference), different
machinery: TMA copies into swizzled shared memory, ``wgmma`` tensor-core dots and warp specialization, in the manner
of FlashAttention-3 (JAX's dense ``pallas.ops.gpu.attention_mgpu`` reaches a clearly larger share of the H200's
bf16 matmul rate on a 4k causal prefill than the Triton lowering's dense flash attention; benchmarks/RESULTS.md,
"Prefill peers"). This
kernel adds what the engine needs on top of that design: a paged KV pool read through the block table, and a
ragged token batch.

Work decomposition
------------------
* A *tile* is ``2 * block_q`` consecutive token rows starting on a multiple of 8, holding query tokens of ONE
  sequence (the first tile of a sequence may start up to 7 rows early: those rows are computed, never stored). The
  tile map is computed in jnp before the call; tiles past the real count exit at once. Grid ``(Hq, num_tiles)``:
  one program per (query head, tile); the ``Hq`` programs of a tile are launched next to each other, so the
  ``group`` query heads of one kv head read the same K/V pages while they are in L2.
* Three warpgroups per program. Two *compute* warpgroups take ``block_q`` tokens each (rows of one head), hold the
  online-softmax state in registers and run ``q @ K^T`` and ``P @ V`` on the tensor cores (``wgmma``); a schedule
  barrier makes them alternate between softmax and matmul. One *memory* warpgroup streams K and V through a ring of
  ``num_stages`` shared-memory slots: for each ``block_kv``-key step it reads the step's page numbers from the block
  table (GMEM scalars: no scalar prefetch on GPU) and issues one TMA copy per page (``[block_size, D]`` boxes of the
  ``[num_blocks, block_size, Hkv, D]`` pool), all arriving on the slot's barrier.
* Causal: steps whose keys every row of a warpgroup sees run without a mask; the steps on the diagonal run masked;
  a warpgroup that needs fewer steps than its partner still releases the remaining slots (so the memory warpgroup
  never waits forever).
* Q is loaded with one TMA box of ``block_q`` rows per warpgroup, starting on a multiple of 8 rows (a box starting
  mid-tile lands rows in the wrong place in the swizzled buffer on the H200) and never leaving ``q`` (the start is
  clamped to ``T - block_q``, ``T`` padded to a multiple of 8; rows of other tokens are computed and dropped). The
  output is written through a plain shared-memory buffer with a ladder of TMA stores of 64, 32, ..., 1 rows:
  exactly the warpgroup's valid rows, never a row of another sequence.

Limits (``supported`` says whether a call qualifies; ``ragged_paged_attention`` falls back to the Triton kernel):
head_dim 64 or 128, bf16/fp16, no sliding window, ``block_size`` a multiple of 8 dividing ``block_kv``, an sm_90
(Hopper) GPU or ``interpret=True`` (Pallas' Mosaic GPU interpreter on CPU, used by the tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from paged_jax.ops.ragged_paged_attention.common import (LOG2_E, int32_metadata, sort_tiles_longest_first, tile_map,
                                                         zero_padding_tokens)

try:  # Mosaic GPU Pallas (every jax this project supports has it; guarded so that an odd build still imports)
    from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
    plgpu = None

COMPUTE_WGS = 2
_NEW_TRANSPOSE = tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 11)


def _transposed(ref):
    """The transposed view of a 2-D shared-memory ref (``ref.transpose`` from jax 0.11; ``transpose_ref`` before)."""
    return ref.transpose((1, 0)) if _NEW_TRANSPOSE else plgpu.transpose_ref(ref, (1, 0))


def default_tuning(head_dim: int, block_size: int, *, block_q: int | None = None, block_kv: int | None = None,
                   num_stages: int | None = None, longest_tiles_first: bool | None = None) -> dict:
    """Tile shape: ``block_q`` 64 rows per compute warpgroup (the wgmma M), ``block_kv`` 128 keys per step, 2 ring
    slots (shared memory: (2 q + 2 o) x 64 x D + 2 x 2 slots x 128 x D elements = 192 KiB at D = 128, bf16)."""
    block_q = 64 if block_q is None else int(block_q)
    block_kv = 128 if block_kv is None else int(block_kv)
    num_stages = 2 if num_stages is None else int(num_stages)
    longest_tiles_first = True if longest_tiles_first is None else bool(longest_tiles_first)
    if block_q != 64:
        raise ValueError(f"block_q must be 64 (one wgmma M per warpgroup), got {block_q}")
    if block_kv % 64 or block_kv % block_size:
        raise ValueError(f"block_kv ({block_kv}) must be a multiple of 64 and of block_size ({block_size})")
    if num_stages < 2:
        raise ValueError(f"num_stages must be >= 2, got {num_stages}")
    return dict(block_q=block_q, block_kv=block_kv, num_stages=num_stages, longest_tiles_first=longest_tiles_first)


def supported(q_shape, k_pages_shape, dtype, sliding_window) -> str | None:
    """None when the kernel handles this call, else the reason it does not."""
    _, _, head_dim = q_shape
    _, block_size, _, _ = k_pages_shape
    if plgpu is None:
        return "jax.experimental.pallas.mosaic_gpu is not importable"
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} (needs 64 or 128)"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype)} (needs bfloat16 or float16)"
    if sliding_window is not None:
        return "sliding window"
    if block_size % 8 or 128 % block_size:
        return f"block_size {block_size} (needs a multiple of 8 dividing 128)"
    return None


def _kernel(meta_ref, q_ref, k_ref, v_ref, out_ref, scoped, *, num_tiles: int, num_seqs: int, group: int,
            block_q: int, block_kv: int, block_size: int, max_blocks: int, num_stages: int, scale_log2: float,
            interpret: bool):
    """``meta_ref``: int32 ``[tile_seq (num_tiles) | tile_start (num_tiles) | cu_q_lens (S+1) | kv_lens (S) |
    block_tables (S * max_blocks, row-major)]``, one freshly built buffer (see the wrapper)."""
    (q_smem2, k_smem, v_smem, o_smem2), (k_ready, v_ready, q_ready), (k_free, v_free), schedule = scoped
    num_tokens = q_ref.shape[0]
    head_dim = q_ref.shape[2]
    dtype = q_ref.dtype
    pages_per_step = block_kv // block_size
    head = lax.axis_index("heads")
    tile = lax.axis_index("tiles")
    wg = lax.axis_index("wg")
    cu_off = 2 * num_tiles
    kv_off = cu_off + num_seqs + 1
    bt_off = kv_off + num_seqs
    seq = meta_ref[tile]

    # Register layouts are a GPU notion; the CPU interpreter has no rule for them (nor for run_state, below).
    def in_layout(x, layout):
        return x if interpret else plgpu.layout_cast(x, layout)

    def iota(shape, dim):
        if interpret:
            return lax.broadcasted_iota(jnp.int32, shape, dim)
        return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=plgpu.Layout.WGMMA)

    def schedule_barrier():
        plgpu.barrier_arrive(schedule)
        plgpu.barrier_wait(schedule)

    @pl.when(seq < num_seqs)
    def _():
        q_start = meta_ref[cu_off + seq]
        q_end = meta_ref[cu_off + seq + 1]
        kv_len = meta_ref[kv_off + seq]
        tile_start = meta_ref[num_tiles + tile]
        ctx_off = kv_len - q_end  # context position of token t is t + ctx_off
        tile_last = jnp.minimum(tile_start + COMPUTE_WGS * block_q, q_end) - 1
        tile_steps = (tile_last + ctx_off) // block_kv + 1  # key steps the tile's last token needs

        @pl.when(wg < COMPUTE_WGS)
        def _compute():
            plgpu.set_max_registers(232, action="increase")
            q_smem = q_smem2.at[wg]
            o_smem = o_smem2.at[wg]
            tok_lo = tile_start + wg * block_q  # a multiple of 8 (tile map)
            valid_lo = jnp.maximum(tok_lo, q_start)
            valid_hi = jnp.minimum(tok_lo + block_q, q_end)
            n_valid = jnp.clip(valid_hi - valid_lo, 0, block_q)
            # The q box stays inside the arrays and starts on a multiple of 8 rows (T is one too): the TMA copy
            # into the tiled, swizzled q buffer mis-places rows when the box starts mid-tile (seen on the H200).
            row_start = jnp.minimum(tok_lo, num_tokens - block_q)
            offset = valid_lo - row_start  # first valid row of the box
            pos_lo = valid_lo + ctx_off
            pos_hi = valid_hi - 1 + ctx_off
            # A warpgroup without valid rows (a short tile) runs the tile's steps on rows that are never stored.
            kv_steps = jnp.where(n_valid > 0, pos_hi // block_kv + 1, tile_steps)
            full_steps = jnp.where(n_valid > 0, (pos_lo + 1) // block_kv, 0)  # every valid row sees all keys

            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row_start, block_q), head], q_smem, q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])
            m_i = in_layout(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = in_layout(jnp.full((block_q,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = in_layout(jnp.full((block_q, head_dim), 0, jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(kv_steps > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[0])

            pl.when(wg == 1)(schedule_barrier)

            def step(kv_step, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = lax.rem(kv_step, num_stages)

                def qk_scope(acc_ref):
                    plgpu.wgmma(acc_ref, q_smem, _transposed(k_smem.at[slot]))
                    schedule_barrier()
                    return acc_ref[...]

                if interpret:  # the interpreter's wgmma takes no transposed operand: a plain dot
                    s = jnp.dot(q_smem[...], k_smem[slot].T, preferred_element_type=jnp.float32)
                    schedule_barrier()
                else:
                    s = pl.run_scoped(qk_scope, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                s = s * scale_log2  # scores in log2 units: exp2 below
                if masked:
                    rows = iota((block_q, block_kv), 0)
                    cols = iota((block_q, block_kv), 1)
                    # Row r is token row_start + r; rows outside the valid range are computed and never stored.
                    s = jnp.where(rows + (row_start + ctx_off) >= cols + kv_step * block_kv, s, -jnp.inf)
                m_next = jnp.maximum(m_i, s.max(axis=1))
                alpha = jnp.exp2(m_i - m_next)
                p = jnp.exp2(s - lax.broadcast_in_dim(m_next, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                l_i = l_i * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                acc, l_i, m_next, p16 = lax.optimization_barrier((acc, l_i, m_next, p16))
                plgpu.barrier_arrive(schedule)  # softmax done
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_wait(schedule)  # the partner's matmul is issued: tensor cores are ours

                def wait_next_k():
                    nxt = kv_step + 1

                    @pl.when(nxt < kv_steps)
                    def _():
                        plgpu.barrier_wait(k_ready.at[lax.rem(nxt, num_stages)])

                if not interpret:  # wgmma accumulates onto the rescaled acc (GPU)
                    def pv(acc_ref):
                        plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
                        wait_next_k()

                    acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                else:  # the CPU interpreter has no run_state: a plain dot, added in registers
                    acc = acc + jnp.dot(p16, v_smem[slot], preferred_element_type=jnp.float32)
                    wait_next_k()
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_next, l_i

            carry = lax.fori_loop(0, full_steps, functools.partial(step, masked=False), (acc, m_i, l_i))
            acc, m_i, l_i = lax.fori_loop(full_steps, kv_steps, functools.partial(step, masked=True), carry)

            @pl.loop(kv_steps, tile_steps)
            def _release(kv_step):  # steps only the partner needs: free the slots, keep the schedule in step
                slot = lax.rem(kv_step, num_stages)
                # Waiting for data this warpgroup does not use keeps every barrier phase observed by both compute
                # warpgroups (the phase parity each thread tracks stays right; the CPU interpreter checks it).
                plgpu.barrier_wait(k_ready.at[slot])
                plgpu.barrier_wait(v_ready.at[slot])
                plgpu.barrier_arrive(k_free.at[slot])
                plgpu.barrier_arrive(v_free.at[slot])
                schedule_barrier()
                schedule_barrier()

            pl.when(wg == 0)(schedule_barrier)

            l_safe = jnp.where(l_i > 0, l_i, 1.0)
            o_smem[...] = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
            plgpu.commit_smem()
            # Exactly rows [offset, offset + n_valid) go out: a ladder of 64, 32, ..., 1-row TMA stores.
            start = offset
            size = block_q
            while size >= 1:
                @pl.when((n_valid & size) != 0)
                def _(start=start, size=size):
                    plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, size)],
                                            out_ref.at[pl.ds(row_start + start, size), head])

                start = start + (n_valid & size)
                size //= 2
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")
            kv_head = lax.div(head, jnp.int32(group))

            def load(ref, smem, ready, kv_step, slot):
                for i in range(pages_per_step):
                    page_slot = jnp.minimum(kv_step * pages_per_step + i, max_blocks - 1)
                    page = meta_ref[bt_off + seq * max_blocks + page_slot]
                    plgpu.copy_gmem_to_smem(ref.at[page, :, kv_head], smem.at[slot, pl.ds(i * block_size, block_size)],
                                            ready.at[slot])

            for i in range(num_stages):
                @pl.when(i < tile_steps)
                def _(i=i):
                    load(k_ref, k_smem, k_ready, i, i)
                    load(v_ref, v_smem, v_ready, i, i)

            @pl.loop(num_stages, jnp.maximum(tile_steps, num_stages))
            def _(kv_step):
                slot = lax.rem(kv_step, num_stages)
                plgpu.barrier_wait(k_free.at[slot])
                load(k_ref, k_smem, k_ready, kv_step, slot)
                plgpu.barrier_wait(v_free.at[slot])
                load(v_ref, v_smem, v_ready, kv_step, slot)

            # Observe the last slots' releases too (every phase of every barrier gets waited on once).
            for j in range(num_stages):
                kv_step = tile_steps - num_stages + j

                @pl.when(kv_step >= 0)
                def _(kv_step=kv_step):
                    slot = lax.rem(kv_step, num_stages)
                    plgpu.barrier_wait(k_free.at[slot])
                    plgpu.barrier_wait(v_free.at[slot])


def ragged_paged_attention_mgpu(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, *, sm_scale: float,
                                sliding_window: int | None = None, interpret: bool = False, **tuning) -> jax.Array:
    """Mosaic GPU ragged paged attention. Shapes as in ``ragged_paged_attention``: q ``[T, Hq, D]``, pools
    ``[num_blocks, block_size, Hkv, D]``, ``kv_lens int32[S]``, ``block_tables int32[S, max_blocks]``,
    ``cu_q_lens int32[S+1]``. Returns ``[T, Hq, D]`` in ``q.dtype`` with zeros for padding tokens.

    ``tuning``: the keyword arguments of ``default_tuning``. Raises ValueError when ``supported`` rejects the call
    (callers normally check first).
    """
    why = supported(q.shape, k_pages.shape, q.dtype, sliding_window)
    if why is not None:
        raise ValueError(f"the Mosaic GPU kernel does not handle this call: {why}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    num_seqs, max_blocks = block_tables.shape
    tuning = default_tuning(head_dim, block_size, **tuning)
    bq, bkv, stages = tuning["block_q"], tuning["block_kv"], tuning["num_stages"]
    tile_tokens = COMPUTE_WGS * bq
    # Each sequence's tiles start at its first token rounded down to 8: sum(ceil((q_len + 7) / tile)) tiles at
    # most, i.e. below (T + 7 S) / tile + S.
    num_tiles = max(1, (num_tokens + 7 * num_seqs) // tile_tokens + num_seqs)

    kv_lens, block_tables, cu_q_lens = int32_metadata(kv_lens, block_tables, cu_q_lens)
    tile_seq, tile_start = tile_map(cu_q_lens, num_tiles, tile_tokens, align=8)
    if tuning["longest_tiles_first"]:
        tile_seq, tile_start = sort_tiles_longest_first(tile_seq, tile_start, cu_q_lens, kv_lens, tile_tokens, None)

    # The kernel's scalars in ONE int32 buffer built here: Mosaic GPU wants 256-byte-aligned inputs, and the
    # engine's block tables / lengths are slices of its packed step buffer (XLA passes them as unaligned views).
    meta = jnp.concatenate([tile_seq, tile_start, cu_q_lens, kv_lens, block_tables.reshape(-1)])

    # TMA wants the token axis a multiple of 8 and at least one block_q box; the engine's buckets already are.
    padded_tokens = max(bq, -(-num_tokens // 8) * 8)
    q_in = q if padded_tokens == num_tokens else jnp.pad(q, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))

    def entry(*refs):
        tiling = plgpu.TilingTransform((8, 64))
        swizzle = plgpu.SwizzleTransform(128)
        smem = (
            plgpu.SMEM((COMPUTE_WGS, bq, head_dim), q.dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((stages, bkv, head_dim), q.dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((stages, bkv, head_dim), q.dtype, transforms=(tiling, swizzle)),
            plgpu.SMEM((COMPUTE_WGS, bq, head_dim), q.dtype),  # plain rows: the store ladder slices any row
        )
        pages = bkv // block_size
        ready = (
            plgpu.Barrier(num_arrivals=pages, num_barriers=stages),  # one arrival per page copy
            plgpu.Barrier(num_arrivals=pages, num_barriers=stages),
            plgpu.Barrier(num_barriers=COMPUTE_WGS),
        )
        free = (plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=stages),) * 2
        pl.run_scoped(
            lambda *scoped: _kernel(*refs, scoped, num_tiles=num_tiles, num_seqs=num_seqs,
                                    group=num_q_heads // num_kv_heads, block_q=bq,
                                    block_kv=bkv, block_size=block_size, max_blocks=max_blocks, num_stages=stages,
                                    scale_log2=float(sm_scale) * LOG2_E, interpret=interpret),
            smem, ready, free, plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            collective_axes="wg",
        )

    kwargs = {}
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        kwargs["interpret"] = InterpretGPUParams()
    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q_in.shape, q.dtype),
        grid=(num_q_heads, num_tiles),
        grid_names=("heads", "tiles"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        # Lane semantics (per-thread register layouts, as written here): jax 0.11's default (Warpgroup) infers
        # shared-memory layouts and rejects the store ladder's dynamic row offsets.
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        **kwargs,
    )(meta, q_in, k_pages, v_pages)
    return zero_padding_tokens(out[:num_tokens], cu_q_lens)


__all__ = ["ragged_paged_attention_mgpu", "supported", "default_tuning"]
