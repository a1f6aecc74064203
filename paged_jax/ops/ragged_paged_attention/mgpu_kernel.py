"""Ragged paged attention for prefill-heavy batches on Hopper: a Pallas Mosaic GPU kernel.

Same interface and result as ``triton_kernel.ragged_paged_attention_triton`` (and the jnp reference), different
machinery: TMA copies into swizzled shared memory, ``wgmma`` tensor-core dots and warp specialization, in the manner
of FlashAttention-3 (JAX's dense ``pallas.ops.gpu.attention_mgpu`` reaches a clearly larger share of the H200's
bf16 matmul rate on a 4k causal prefill than the Triton lowering's dense flash attention; benchmarks/RESULTS.md,
"Prefill in the engine's buckets"). This
kernel adds what the engine needs on top of that design: a paged KV pool read through the block table, and a
ragged token batch.

Work decomposition
------------------
* A *tile* is ``2 * block_q`` consecutive token rows starting on a multiple of 8, holding query tokens of ONE
  sequence (the first tile of a sequence may start up to 7 rows early: those rows are computed, never stored). The
  tile map is computed in jnp before the call (longest first by default); a *work item* is one (query head, real tile)
  pair, and their count (real tiles x ``Hq``) goes into the metadata buffer too.
* Persistent grid: ``num_programs`` programs (about one per SM; each holds ~200 KiB of shared memory, so one runs
  per SM) whatever the batch; program ``p`` takes items ``p, p + num_programs, ...``. Item ``w`` is query head
  ``w % Hq`` of tile ``w // Hq``: the ``Hq`` items of a tile run at the same time on neighbouring programs, so the
  ``group`` query heads of one kv head read the same K/V pages while they are in L2. The static tile bound (every
  sequence slot may add a tile) no longer sizes the launch: an engine bucket's hundreds of empty slots cost nothing
  but their entries in the jnp tile map.
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
  exactly the warpgroup's valid rows, never a row of another sequence (so the kernel can write into another
  kernel's output: ``out=``, the hybrid path). The buffer is refilled for the next item only after those stores
  have read it.
* Across items the K/V ring runs on (slot = the program's running step count mod ``num_stages``): the memory
  warpgroup fetches the next item's first pages while the compute warpgroups finish the current one; each barrier
  phase is waited exactly once by every thread that tracks it (the last free phases after the memory
  warpgroup's loop), as the CPU interpreter checks.

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
                   num_stages: int | None = None, longest_tiles_first: bool | None = None,
                   num_programs: int | None = None) -> dict:
    """Tile shape: ``block_q`` 64 rows per compute warpgroup (the wgmma M), ``block_kv`` 128 keys per step, 2 ring
    slots (shared memory: (2 q + 2 o) x 64 x D + 2 x 2 slots x 128 x D elements = 192 KiB at D = 128, bf16), so one
    program per SM; ``num_programs`` persistent programs (default ``default_num_programs()``: the SM count; a call
    launches at most its possible work items, Hq x tiles, whatever is asked); tiles longest first."""
    block_q = 64 if block_q is None else int(block_q)
    block_kv = 128 if block_kv is None else int(block_kv)
    num_stages = 2 if num_stages is None else int(num_stages)
    longest_tiles_first = True if longest_tiles_first is None else bool(longest_tiles_first)
    num_programs = default_num_programs() if num_programs is None else int(num_programs)
    if block_q != 64:
        raise ValueError(f"block_q must be 64 (one wgmma M per warpgroup), got {block_q}")
    if block_kv % 64 or block_kv % block_size:
        raise ValueError(f"block_kv ({block_kv}) must be a multiple of 64 and of block_size ({block_size})")
    if num_stages < 2:
        raise ValueError(f"num_stages must be >= 2, got {num_stages}")
    if num_programs < 1:
        raise ValueError(f"num_programs must be >= 1, got {num_programs}")
    return dict(block_q=block_q, block_kv=block_kv, num_stages=num_stages, longest_tiles_first=longest_tiles_first,
                num_programs=num_programs)


def supported(q_shape, k_pages_shape, dtype, sliding_window, kv_dtype=None, logit_soft_cap=None,
              has_sinks: bool = False, attention_chunk_size: int | None = None) -> str | None:
    """None when the kernel handles this call, else the reason it does not. ``kv_dtype``: the pools' element type
    (None: q's); its TMA / wgmma pipeline reads pages of q's dtype only. No sliding window, no attention chunks, no
    logit soft-capping, no attention sinks."""
    _, _, head_dim = q_shape
    _, block_size, _, _ = k_pages_shape
    if plgpu is None:
        return "jax.experimental.pallas.mosaic_gpu is not importable"
    if head_dim not in (64, 128):
        return f"head_dim {head_dim} (needs 64 or 128)"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"dtype {jnp.dtype(dtype)} (needs bfloat16 or float16)"
    if kv_dtype is not None and jnp.dtype(kv_dtype) != jnp.dtype(dtype):
        return f"KV pool dtype {jnp.dtype(kv_dtype)} differs from q's {jnp.dtype(dtype)}"
    if sliding_window is not None:
        return "sliding window"
    if attention_chunk_size is not None:
        return "chunked local attention (attention_chunk_size)"
    if logit_soft_cap is not None:
        return "logit soft-capping"
    if has_sinks:
        return "attention sinks"
    if block_size % 8 or 128 % block_size:
        return f"block_size {block_size} (needs a multiple of 8 dividing 128)"
    return None


def _kernel(meta_ref, q_ref, k_ref, v_ref, out_ref, scoped, *, num_programs: int, num_tiles: int, num_seqs: int,
            group: int, block_q: int, block_kv: int, block_size: int, max_blocks: int, num_stages: int,
            scale_log2: float, interpret: bool):
    """One persistent program: the work items ``program, program + num_programs, ...`` below ``num_work``.

    ``meta_ref``: int32 ``[num_work (1) | tile_seq (num_tiles) | tile_start (num_tiles) | cu_q_lens (S+1) |
    kv_lens (S) | block_tables (S * max_blocks, row-major)]``, one freshly built buffer (see the wrapper). Work item
    ``w`` is query head ``w % Hq`` of tile ``w // Hq``: the ``Hq`` items of a tile (and so the ``group`` heads that
    read one kv head's pages) are neighbours in the order the programs take them."""
    (q_smem2, k_smem, v_smem, o_smem2), (k_ready, v_ready, q_ready), (k_free, v_free), schedule = scoped
    num_tokens, num_q_heads, head_dim = q_ref.shape
    dtype = q_ref.dtype
    pages_per_step = block_kv // block_size
    program = lax.axis_index("programs")
    wg = lax.axis_index("wg")
    start_off = 1 + num_tiles
    cu_off = 1 + 2 * num_tiles
    kv_off = cu_off + num_seqs + 1
    bt_off = kv_off + num_seqs
    num_work = meta_ref[0]
    num_items = lax.div(jnp.maximum(num_work - program + num_programs - 1, 0), jnp.int32(num_programs))

    def work_item(i):
        """The i-th item of this program: (query head, sequence, tile start, q_start, q_end, context offset,
        key steps of the tile). Every item is a real tile (``num_work`` counts only those)."""
        w = program + i * num_programs
        tile = lax.div(w, jnp.int32(num_q_heads))
        head = lax.rem(w, jnp.int32(num_q_heads))
        seq = meta_ref[1 + tile]
        q_start = meta_ref[cu_off + seq]
        q_end = meta_ref[cu_off + seq + 1]
        ctx_off = meta_ref[kv_off + seq] - q_end  # context position of token t is t + ctx_off
        tile_start = meta_ref[start_off + tile]
        tile_last = jnp.minimum(tile_start + COMPUTE_WGS * block_q, q_end) - 1
        # Key steps the tile's last token needs; never negative, so a malformed sequence (kv_len < q_len, outside
        # the contract) cannot move the ring's running step count backwards for the program's later items.
        tile_steps = jnp.maximum((tile_last + ctx_off) // block_kv + 1, 0)
        return head, seq, tile_start, q_start, q_end, ctx_off, tile_steps

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

    # The K/V ring runs on across a program's items: step s of an item whose predecessors took ``base`` steps
    # uses slot (base + s) % num_stages, so the memory warpgroup fetches the next item's first pages while the
    # compute warpgroups finish the current one. Every barrier phase is still waited once by each thread that
    # tracks it: ready phases by both compute warpgroups, free phases by the memory warpgroup (the last ones after
    # its loop).
    @pl.when(wg < COMPUTE_WGS)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        q_smem = q_smem2.at[wg]
        o_smem = o_smem2.at[wg]

        def item_body(i, base):
            head, _, tile_start, q_start, q_end, ctx_off, tile_steps = work_item(i)
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
            # Clipped to [0, tile_steps] (a no-op within the contract): a malformed sequence (kv_len < q_len) has
            # negative positions, and a step outside what the memory warpgroup loads would wait forever.
            kv_steps = jnp.clip(jnp.where(n_valid > 0, pos_hi // block_kv + 1, tile_steps), 0, tile_steps)
            full_steps = jnp.clip(jnp.where(n_valid > 0, (pos_lo + 1) // block_kv, 0), 0, kv_steps)  # all keys seen

            def slot_of(kv_step):
                return lax.rem(base + kv_step, num_stages)

            # The previous item's q reads are done (its dots were waited on): the buffer can be refilled.
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(row_start, block_q), head], q_smem, q_ready.at[wg])
            plgpu.barrier_wait(q_ready.at[wg])
            m_i = in_layout(jnp.full((block_q,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            l_i = in_layout(jnp.full((block_q,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
            acc = in_layout(jnp.full((block_q, head_dim), 0, jnp.float32), plgpu.Layout.WGMMA)

            @pl.when(kv_steps > 0)
            def _():
                plgpu.barrier_wait(k_ready.at[slot_of(0)])

            pl.when(wg == 1)(schedule_barrier)

            def step(kv_step, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = slot_of(kv_step)

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
                        plgpu.barrier_wait(k_ready.at[slot_of(nxt)])

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
                slot = slot_of(kv_step)
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
            out = (acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])).astype(dtype)
            # The previous item's stores must have read o_smem before it is overwritten (the writes to GMEM may
            # still be in flight; the kernel's last wait covers them).
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[...] = out
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
            return base + tile_steps

        lax.fori_loop(0, num_items, item_body, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == COMPUTE_WGS)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        def item_body(i, base):
            head, seq, *_, tile_steps = work_item(i)
            kv_head = lax.div(head, jnp.int32(group))

            def load(ref, smem, ready, kv_step, slot):
                for j in range(pages_per_step):
                    page_slot = jnp.minimum(kv_step * pages_per_step + j, max_blocks - 1)
                    page = meta_ref[bt_off + seq * max_blocks + page_slot]
                    plgpu.copy_gmem_to_smem(ref.at[page, :, kv_head],
                                            smem.at[slot, pl.ds(j * block_size, block_size)], ready.at[slot])

            @pl.loop(0, tile_steps)
            def _(kv_step):
                ring_step = base + kv_step
                slot = lax.rem(ring_step, num_stages)
                reused = ring_step >= num_stages  # the slot held an earlier step: wait until both released it

                @pl.when(reused)
                def _():
                    plgpu.barrier_wait(k_free.at[slot])

                load(k_ref, k_smem, k_ready, kv_step, slot)

                @pl.when(reused)
                def _():
                    plgpu.barrier_wait(v_free.at[slot])

                load(v_ref, v_smem, v_ready, kv_step, slot)

            return base + tile_steps

        ring_steps = lax.fori_loop(0, num_items, item_body, jnp.int32(0))
        # Observe the last slots' releases too (every phase of every barrier gets waited on once).
        for j in range(num_stages):
            ring_step = ring_steps - num_stages + j

            @pl.when(ring_step >= 0)
            def _(ring_step=ring_step):
                slot = lax.rem(ring_step, num_stages)
                plgpu.barrier_wait(k_free.at[slot])
                plgpu.barrier_wait(v_free.at[slot])


def ragged_paged_attention_mgpu(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, *, sm_scale: float,
                                sliding_window: int | None = None, logit_soft_cap: float | None = None,
                                attention_chunk_size: int | None = None, interpret: bool = False, min_q_len: int = 1,
                                out: jax.Array | None = None, **tuning) -> jax.Array:
    """Mosaic GPU ragged paged attention. Shapes as in ``ragged_paged_attention``: q ``[T, Hq, D]``, pools
    ``[num_blocks, block_size, Hkv, D]``, ``kv_lens int32[S]``, ``block_tables int32[S, max_blocks]``,
    ``cu_q_lens int32[S+1]``. Returns ``[T, Hq, D]`` in ``q.dtype`` with zeros for padding tokens.

    ``min_q_len`` (static): attend only the sequences with at least this many query tokens (decided on the device
    from ``cu_q_lens``); it also bounds the static tile count (at most ``T // min_q_len`` such sequences).
    ``out``: None, or a ``[T, Hq, D]`` array of ``q.dtype`` that the kernel writes its rows into in place (aliased
    through a ``jax.Ref``): every other row (the other sequences', the padding tokens') comes back as it was in
    ``out``; the zeroing of padding tokens is then the caller's (``hybrid`` passes the Triton kernel's output).
    ``tuning``: the keyword arguments of ``default_tuning``. Raises ValueError when ``supported`` rejects the call
    (callers normally check first).
    """
    why = supported(q.shape, k_pages.shape, q.dtype, sliding_window, k_pages.dtype, logit_soft_cap,
                    attention_chunk_size=attention_chunk_size)
    if why is not None:
        raise ValueError(f"the Mosaic GPU kernel does not handle this call: {why}")
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    num_seqs, max_blocks = block_tables.shape
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype):
        raise ValueError(f"out must be {q.shape} {q.dtype} like q, got {out.shape} {out.dtype}")
    if int(min_q_len) < 1:
        raise ValueError(f"min_q_len must be >= 1, got {min_q_len}")
    tuning = default_tuning(head_dim, block_size, **tuning)
    bq, bkv, stages = tuning["block_q"], tuning["block_kv"], tuning["num_stages"]
    tile_tokens = COMPUTE_WGS * bq
    # Each attended sequence's tiles start at its first token rounded down to 8: sum(ceil((q_len + 7) / tile))
    # tiles at most, i.e. below (T + 7 S') / tile + S' for S' attended sequences (S' <= T // min_q_len).
    attended = min(num_seqs, num_tokens // int(min_q_len))
    num_tiles = max(1, (num_tokens + 7 * attended) // tile_tokens + attended)
    # Persistent grid: never more programs than work items can exist.
    num_programs = max(1, min(tuning["num_programs"], num_tiles * num_q_heads))

    kv_lens, block_tables, cu_q_lens = int32_metadata(kv_lens, block_tables, cu_q_lens)
    include = None if min_q_len == 1 else (cu_q_lens[1:] - cu_q_lens[:-1]) >= min_q_len
    tile_seq, tile_start = tile_map(cu_q_lens, num_tiles, tile_tokens, align=8, include=include)
    if tuning["longest_tiles_first"]:
        tile_seq, tile_start = sort_tiles_longest_first(tile_seq, tile_start, cu_q_lens, kv_lens, tile_tokens, None)
    # Work items (query head, tile) of the real tiles only; both tile orders keep the real tiles first.
    num_work = (jnp.sum(tile_seq < num_seqs, dtype=jnp.int32) * num_q_heads)[None]

    # The kernel's scalars in ONE int32 buffer built here: Mosaic GPU wants 256-byte-aligned inputs, and the
    # engine's block tables / lengths are slices of its packed step buffer (XLA passes them as unaligned views).
    meta = jnp.concatenate([num_work, tile_seq, tile_start, cu_q_lens, kv_lens, block_tables.reshape(-1)])

    # TMA wants the token axis a multiple of 8 and at least one block_q box; the engine's buckets already are.
    padded_tokens = max(bq, -(-num_tokens // 8) * 8)

    def pad_tokens(x):
        return x if padded_tokens == num_tokens else jnp.pad(x, ((0, padded_tokens - num_tokens), (0, 0), (0, 0)))

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
            lambda *scoped: _kernel(*refs, scoped, num_programs=num_programs, num_tiles=num_tiles,
                                    num_seqs=num_seqs, group=num_q_heads // num_kv_heads, block_q=bq,
                                    block_kv=bkv, block_size=block_size, max_blocks=max_blocks, num_stages=stages,
                                    scale_log2=float(sm_scale) * LOG2_E, interpret=interpret),
            smem, ready, free, plgpu.Barrier(num_arrivals=COMPUTE_WGS),
            collective_axes="wg",
        )

    interpret_params = False
    if interpret:
        from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

        interpret_params = InterpretGPUParams()
    # pl.kernel rather than plgpu.kernel: the latter's custom_vmap wrapper does not take the aliased Ref below.
    kernel = pl.kernel(
        entry,
        out_type=() if out is not None else jax.ShapeDtypeStruct((padded_tokens, num_q_heads, head_dim), q.dtype),
        mesh=plgpu.Mesh(grid=(num_programs,), grid_names=("programs",), num_threads=COMPUTE_WGS + 1,
                        thread_name="wg"),
        # Lane semantics (per-thread register layouts, as written here): jax 0.11's default (Warpgroup) infers
        # shared-memory layouts and rejects the store ladder's dynamic row offsets.
        compiler_params=plgpu.CompilerParams(approx_math=True, lowering_semantics=plgpu.LoweringSemantics.Lane),
        interpret=interpret_params,
        name="ragged_paged_attention_mgpu",
    )
    args = (meta, pad_tokens(q), k_pages, v_pages)
    if out is None:
        return zero_padding_tokens(kernel(*args)[:num_tokens], cu_q_lens)
    out_ref = jax.new_ref(pad_tokens(out), memory_space=plgpu.GMEM)
    kernel(*args, out_ref)
    return out_ref[...][:num_tokens]


def default_num_programs() -> int:
    """The persistent grid's default size: one program per SM of the first device (its ``core_count`` on a GPU),
    else 132 (an H100 / H200)."""
    dev = jax.devices()[0]
    count = getattr(dev, "core_count", None) if dev.platform == "gpu" else None
    return int(count) if count else 132


__all__ = ["ragged_paged_attention_mgpu", "supported", "default_tuning", "default_num_programs"]
