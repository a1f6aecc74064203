"""Ragged paged attention: one entry point, a Pallas GPU kernel and a pure-jnp reference behind it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.ops.ragged_paged_attention.reference import ragged_paged_attention_reference

_IMPLS = ("auto", "reference", "pallas", "mosaic")
_TUNING_KEYS = (
    "block_q", "block_k", "num_kv_splits", "num_warps", "num_stages",
    "kv_heads_inner", "longest_tiles_first", "prefetch_pages", "prescale_q", "k_transposed",
    "zero_padding_in_kernel",
)
_MOSAIC_TUNING_KEYS = ("block_q", "block_kv", "num_stages", "longest_tiles_first")
# "auto" takes the Mosaic GPU kernel when the batch averages at least this many query tokens per sequence slot: its
# grid has a program per (head, tile slot) and every sequence slot may add one, so decode-heavy shapes (mostly empty
# programs, one ~200 KiB-shared-memory CTA per SM each: 256 empty slots cost ~120 us on the H200) stay with the
# Triton kernel...
MOSAIC_MIN_TOKENS_PER_SEQ = 128
# ...and when the batch has at least this many tokens: 128-token tiles x heads must fill the GPU's 132 SMs (a single
# 128-token prompt would give 32 programs; the Triton kernel's smaller tiles and kv splits spread it wider).
MOSAIC_MIN_TOKENS = 1024


def _is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def choose_impl(q_shape, k_pages_shape, dtype, num_seqs: int, sliding_window=None) -> str:
    """What ``impl="auto"`` runs for a static call shape: ``"mosaic"`` (Hopper, prefill-heavy: at least 128 tokens
    per sequence slot and 1024 tokens; supported shape), ``"pallas"`` (any other GPU case with a power-of-two
    head_dim >= 16) or ``"reference"`` (CPU, or any other head_dim)."""
    head_dim = q_shape[-1]
    if jax.default_backend() != "gpu" or head_dim < 16 or head_dim & (head_dim - 1):
        return "reference"
    from paged_jax.ops.ragged_paged_attention import mgpu_kernel

    if (_is_hopper() and q_shape[0] >= max(MOSAIC_MIN_TOKENS_PER_SEQ * num_seqs, MOSAIC_MIN_TOKENS)
            and mgpu_kernel.supported(q_shape, k_pages_shape, dtype, sliding_window) is None):
        return "mosaic"
    return "pallas"


def _validate(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, sliding_window, impl):
    if impl not in _IMPLS:
        raise ValueError(f"impl must be one of {_IMPLS}, got {impl!r}")
    if q.ndim != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {q.shape}")
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [num_blocks, block_size, Hkv, D], got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"v_pages shape {v_pages.shape} must equal k_pages shape {k_pages.shape}")
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


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    impl: str = "auto",
    interpret: bool = False,
    **tuning,
) -> jax.Array:
    """Attention of a flat ragged token batch against a paged KV cache.

    Args:
      q: ``[T, Hq, D]`` queries (RoPE applied). ``Hq = group * Hkv``; query head ``h`` uses kv head ``h // group``.
      k_pages, v_pages: ``[num_blocks, block_size, Hkv, D]`` pools, new K/V already written (see ``write_kv``).
      kv_lens: ``int32[S]`` context length of each sequence (new tokens included); 0 for padded sequences.
      block_tables: ``int32[S, max_blocks]`` pool block of each logical block; padded entries point at block 0.
      cu_q_lens: ``int32[S+1]`` cumulative query lengths; sequence ``i`` owns tokens ``cu_q_lens[i]:cu_q_lens[i+1]``
        at context positions ``kv_lens[i] - q_len_i .. kv_lens[i] - 1``. Tokens from ``cu_q_lens[S]`` on are padding.
      sm_scale: static Python float multiplying ``q . k``.
      sliding_window: if set, the query at position ``p`` sees keys ``p - sliding_window < j <= p`` (else ``j <= p``).
      impl: ``"pallas"`` (the Triton-lowered Pallas kernel; on CPU only with ``interpret=True``), ``"mosaic"`` (the
        Mosaic GPU prefill kernel for Hopper, ``mgpu_kernel``; on CPU only with ``interpret=True``), ``"reference"``
        (pure jnp) or ``"auto"`` (``choose_impl``: on a GPU, the Mosaic kernel for prefill-heavy shapes on Hopper and
        the Triton kernel otherwise; the reference on CPU).
      interpret: run the Pallas kernel in interpret mode (CPU tests).
      **tuning: kernel knobs ``block_q``, ``block_k``, ``num_kv_splits``, ``num_warps``, ``num_stages`` (see
        ``triton_kernel.default_tuning``) and the boolean prefill options ``kv_heads_inner``,
        ``longest_tiles_first``, ``prefetch_pages``, ``prescale_q``, ``k_transposed``, ``zero_padding_in_kernel``
        (default off; see the ``triton_kernel`` module docstring); for ``"mosaic"``: ``block_q``, ``block_kv``,
        ``num_stages``, ``longest_tiles_first`` (``mgpu_kernel.default_tuning``). Ignored by
        the reference; with ``"auto"`` the Triton knobs apply when it picks the Triton kernel and are dropped when it
        picks the Mosaic one.

    Returns:
      ``[T, Hq, D]`` in ``q.dtype``; padding tokens are zeros. Jittable: ``T``, ``S``, ``max_blocks`` are static,
      the index arrays are dynamic.
    """
    _validate(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, sliding_window, impl)
    allowed = _MOSAIC_TUNING_KEYS if impl == "mosaic" else _TUNING_KEYS
    unknown = set(tuning) - set(allowed)
    if unknown:
        raise ValueError(f"unknown tuning arguments {sorted(unknown)} for impl={impl!r}; expected some of {allowed}")
    if impl == "auto":
        impl = choose_impl(q.shape, k_pages.shape, q.dtype, block_tables.shape[0], sliding_window)
        if impl == "mosaic":  # the Triton knobs mean nothing to it
            tuning = {}
    if impl == "mosaic":
        from paged_jax.ops.ragged_paged_attention.mgpu_kernel import ragged_paged_attention_mgpu

        return ragged_paged_attention_mgpu(
            q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens,
            sm_scale=sm_scale, sliding_window=sliding_window, interpret=interpret, **tuning,
        )
    if impl == "reference":
        return ragged_paged_attention_reference(
            q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, sm_scale=sm_scale, sliding_window=sliding_window
        )
    from paged_jax.ops.ragged_paged_attention.triton_kernel import ragged_paged_attention_triton

    return ragged_paged_attention_triton(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens,
        sm_scale=sm_scale, sliding_window=sliding_window, interpret=interpret, **tuning,
    )


__all__ = ["choose_impl", "ragged_paged_attention", "ragged_paged_attention_reference"]
