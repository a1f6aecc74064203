"""Slot-mapped write of new K/V into the paged KV pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def pool_saturation_max(pool_dtype) -> float | None:
    """The magnitude new K/V values are clipped to before the cast into a pool of ``pool_dtype``: an FP8 pool's
    largest finite value (a plain cast would give NaN past it), None for wider pools (cast as is)."""
    return float(jnp.finfo(pool_dtype).max) if jnp.dtype(pool_dtype).itemsize == 1 else None


def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter the new keys/values of a flat token batch into the paged pool.

    Args:
      k_pages, v_pages: ``[num_blocks, block_size, num_kv_heads, head_dim]`` pools (same shape and dtype), or a latent
        cache (``is_latent_pool``: ``v_pages`` of width 0, returned as is; ``v`` is then part of ``k`` and not written).
      k, v: ``[T, num_kv_heads, head_dim]`` new keys/values (cast to the pool dtype; an FP8 pool saturates at its
        largest finite value).
      slot_mapping: ``int32[T]``; token ``t`` goes to ``slot = block * block_size + offset``. Padding tokens use
        slots of the null block 0 (several may share one slot; which of them lands there is unspecified).
        Slots outside ``[0, num_blocks * block_size)`` are dropped (one token, T == 1: written to slot 0 of the null
        block instead, which no request reads).

    Returns:
      ``(k_pages, v_pages)`` with the same shapes/dtypes. Under ``jax.jit`` with the pools donated, XLA performs the
      scatter in place, so the step costs O(T) memory traffic, not O(pool).
    """
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [num_blocks, block_size, num_kv_heads, head_dim], got shape {k_pages.shape}")
    latent = is_latent_pool(k_pages, v_pages)
    if v_pages.shape != k_pages.shape and not latent:
        raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape} (or have width 0: "
                         "a latent cache)")
    if v_pages.dtype != k_pages.dtype:
        raise ValueError(f"v_pages dtype {v_pages.dtype} must equal k_pages dtype {k_pages.dtype}")
    num_blocks, block_size, num_kv_heads, head_dim = k_pages.shape
    if k.ndim != 3 or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(f"k must be [T, {num_kv_heads}, {head_dim}] to match the pool, got shape {k.shape}")
    if v.shape != k.shape and not latent:
        raise ValueError(f"v shape {v.shape} must equal k shape {k.shape}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be [T={k.shape[0]}], got shape {slot_mapping.shape}")
    if not jnp.issubdtype(slot_mapping.dtype, jnp.integer):
        raise ValueError(f"slot_mapping must be an integer array, got dtype {slot_mapping.dtype}")

    num_slots = num_blocks * block_size
    fp8_max = pool_saturation_max(k_pages.dtype)
    # The writes index the pool as it is, [block, offset] (no reshape to a flat [slots, ...] view): XLA then keeps
    # every write in place even when one pool takes several writes in a step with reads between them (the layers
    # of a KV-cache group's slot, ``paged_jax.worker.kv_group_pool``); through a reshaped view XLA may copy the
    # whole pool instead (the CPU compiler does for the one-token write).
    if k.shape[0] == 1:
        # One token (batch-1 decode): a dynamic_update_slice at a sanitised slot. XLA rewrites a one-index scatter
        # into a dynamic_update_slice too, but to keep the scatter's skip-out-of-range meaning it then selects
        # between the new row and a read of the old one, a separate kernel (the read of the buffer being updated
        # keeps the select out of the in-place update). Redirecting a bad slot to the null block instead leaves
        # only scalar index math, which fuses into the in-place update together with the row's own producers
        # (split-K reduce, RoPE): one kernel per pool.
        slot = slot_mapping[0].astype(jnp.int32)
        slot = jnp.where((slot >= 0) & (slot < num_slots), slot, 0)
        zero = jnp.zeros((), jnp.int32)
        start = (slot // block_size, slot % block_size, zero, zero)
    else:  # a slot past the pool has a block past it too: the scatter drops it
        blocks, offsets = slot_mapping // block_size, slot_mapping % block_size

    def scatter(pages, new):
        if fp8_max is not None:  # an FP8 pool (--kv-cache-dtype fp8): saturate instead of casting to NaN
            new = jnp.clip(new.astype(jnp.float32), -fp8_max, fp8_max)
        new = new.astype(pages.dtype)
        if new.shape[0] == 1:
            return jax.lax.dynamic_update_slice(pages, new[:, None], start, allow_negative_indices=False)
        # mode="drop": an out-of-range slot is ignored instead of clamped onto a real slot.
        return pages.at[blocks, offsets].set(new, mode="drop")

    return scatter(k_pages, k), (v_pages if latent else scatter(v_pages, v))


def is_latent_pool(k_pages: jax.Array, v_pages: jax.Array) -> bool:
    """Whether ``(k_pages, v_pages)`` is a latent cache (multi-head latent attention): a V pool of width 0 beside a
    K pool of the same blocks, whose rows hold the values in their first columns."""
    return v_pages.shape[-1] == 0 and v_pages.shape[:-1] == k_pages.shape[:-1] and k_pages.shape[-1] > 0
