"""Prefill-sized batches on Hopper: the long sequences on the Mosaic GPU kernel, the short ones on the Triton kernel.

An engine step in a prefill-sized bucket (e.g. 2048 tokens x 256 sequence slots) may hold decode rows next to its
prompt chunks (chunked prefill). The Mosaic kernel spends a whole ``2 * 64``-row tile per query head on every
sequence it attends, so a 1-token decode row would cost it up to 128x its useful work; the Triton kernel's small
tiles (and kv-head-shared rows) suit those rows, while the Mosaic kernel (TMA, wgmma, warp specialization) runs the
long query runs at a clearly higher share of the tensor-core rate (benchmarks/RESULTS.md, "Prefill").

So the batch is split by query length on the device, inside the jitted step (no host sync, no new shape):

1. ``ragged_paged_attention_triton(..., max_q_len=min_q_len - 1)``: tiles only for the sequences with fewer than
   ``min_q_len`` query tokens (the other sequences' tiles drop out of its tile map), zeros for the padding tokens.
2. ``ragged_paged_attention_mgpu(..., min_q_len=min_q_len, out=<1.>)``: its persistent programs take the tiles of
   the sequences with at least ``min_q_len`` tokens and write their rows into the Triton output in place (an
   aliased ``jax.Ref``), so no pass merges two outputs.

Either kernel finds nothing to do when the batch has no sequence of its kind: its programs exit at once (one
launch). The FP8 KV pool and sliding windows stay on the Triton kernel alone (``choose_impl`` does not take this
path for them).
"""

from __future__ import annotations

import jax

from paged_jax.ops.ragged_paged_attention.mgpu_kernel import ragged_paged_attention_mgpu
from paged_jax.ops.ragged_paged_attention.triton_kernel import ragged_paged_attention_triton

# A sequence with at least this many query tokens goes to the Mosaic kernel: one full 128-row tile per head (a
# shorter run would leave most of the tile's rows idle, where the Triton kernel's 16-token tiles waste none).
MOSAIC_MIN_Q_LEN = 128


def ragged_paged_attention_hybrid(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, *, sm_scale: float,
                                  interpret: bool = False, min_q_len: int | None = None,
                                  mosaic_tuning: dict | None = None, triton_tuning: dict | None = None) -> jax.Array:
    """Ragged paged attention with the sequences of ``>= min_q_len`` query tokens on the Mosaic GPU kernel and the
    others on the Triton kernel. Shapes and result as ``ragged_paged_attention``: q ``[T, Hq, D]``, pools
    ``[num_blocks, block_size, Hkv, D]``, ``kv_lens int32[S]``, ``block_tables int32[S, max_blocks]``,
    ``cu_q_lens int32[S+1]`` -> ``[T, Hq, D]`` in ``q.dtype``, zeros for padding tokens.

    ``min_q_len`` (static; None = ``MOSAIC_MIN_Q_LEN``), the split itself dynamic (from ``cu_q_lens``).
    ``mosaic_tuning`` / ``triton_tuning``: keyword arguments of the kernels' ``default_tuning``. No sliding
    window; the pools must be of q's dtype (the Mosaic kernel's ``supported``).
    """
    min_q_len = MOSAIC_MIN_Q_LEN if min_q_len is None else int(min_q_len)
    if min_q_len < 2:
        raise ValueError(f"min_q_len must be >= 2 (the Triton kernel takes the shorter sequences), got {min_q_len}")
    # Padding tokens' zeros written by the Triton kernel itself when its split heuristic picks one kv split (no pass
    # over the output); with several splits the combine kernel zeroes them.
    triton_tuning = dict(dict(zero_padding_in_kernel=True), **(triton_tuning or {}))
    out = ragged_paged_attention_triton(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, sm_scale=sm_scale,
                                        interpret=interpret, max_q_len=min_q_len - 1, **triton_tuning)
    return ragged_paged_attention_mgpu(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, sm_scale=sm_scale,
                                       interpret=interpret, min_q_len=min_q_len, out=out,
                                       **(mosaic_tuning or {}))


__all__ = ["MOSAIC_MIN_Q_LEN", "ragged_paged_attention_hybrid"]
