"""Ragged paged attention: one entry point; two Pallas GPU kernels (Triton and Mosaic GPU lowerings), the Triton
kernel of a latent cache (multi-head latent attention, ``mla_kernel``) and a pure-jnp reference behind it. ``common``
holds what they share; the implementation names are ``ATTENTION_IMPLS``."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp

from paged_jax.worker.attention_impl import ATTENTION_IMPLS, resolve_attention_impl
from paged_jax.ops.ragged_paged_attention import mla_kernel
from paged_jax.ops.ragged_paged_attention.common import validate_inputs
from paged_jax.ops.ragged_paged_attention.reference import ragged_paged_attention_reference

# "auto" takes the hybrid path (hybrid.py: the sequences of >= 128 query tokens on the Mosaic GPU kernel, the others
# on the Triton kernel, split on the device) on Hopper for call shapes of at least this many tokens: the engine's
# prefill-sized buckets. The value is not tuned: the one smaller bucket timed on the H200 (a 512-token chunk over a
# cached prefix in a 512-token bucket) ran faster on the hybrid, but mixed decode + chunk steps were timed only at
# 2048 tokens (``benchmarks/kernels.py --sections prefill_buckets``; RESULTS.md), and every bucket above the
# threshold adds a Mosaic kernel to compile at start-up.
MOSAIC_MIN_TOKENS = 1024


def _is_hopper() -> bool:
    dev = jax.devices()[0]
    return dev.platform == "gpu" and str(getattr(dev, "compute_capability", "")).startswith("9.")


def choose_impl(q_shape, k_pages_shape, dtype, num_seqs: int, sliding_window=None, kv_dtype=None,
                logit_soft_cap=None, has_sinks: bool = False, attention_chunk_size=None) -> str:
    """What ``impl="auto"`` runs for a static call shape: ``"hybrid"`` (Hopper, at least ``MOSAIC_MIN_TOKENS``
    tokens, a shape the Mosaic kernel supports: long sequences on it, short ones on the Triton kernel; ``hybrid``),
    ``"triton"`` (any other GPU case with a power-of-two head_dim >= 16) or ``"reference"`` (CPU, or any other
    head_dim). ``num_seqs`` (the sequence slots) does not matter: the split is by each sequence's query length, on
    the device. ``kv_dtype``: the pools' element type (None: q's); a pool of another dtype (FP8), a sliding window,
    attention chunks, logit soft-capping or attention sinks keep the Triton kernel (the Mosaic kernel's
    ``supported``)."""
    del num_seqs
    head_dim = q_shape[-1]
    if jax.default_backend() != "gpu" or head_dim < 16 or head_dim & (head_dim - 1):
        return "reference"
    from paged_jax.ops.ragged_paged_attention import mgpu_kernel

    if (_is_hopper() and q_shape[0] >= MOSAIC_MIN_TOKENS
            and mgpu_kernel.supported(q_shape, k_pages_shape, dtype, sliding_window, kv_dtype, logit_soft_cap,
                                      has_sinks, attention_chunk_size) is None):
        return "hybrid"
    return "triton"


# Tokens per ``lax.map`` iteration of the reference in batch-invariant mode: one vmapped shape for every step.
REFERENCE_INVARIANT_CHUNK = 8


def batch_invariant_tuning(num_q_heads: int, num_kv_heads: int) -> dict:
    """The Triton kernel's knobs in batch-invariant mode, the same for every call of a model: one KV split (a split
    count follows the batch, and the splits' boundaries a tile's extent), ``block_k`` 64 from position 0, and query
    tiles of 16 rows whatever the step (``block_q = 16 // group`` tokens; at least one token); ``prescale_q``, so
    that the masked and unmasked bodies compute a score by the same instructions (a fused multiply-add of the
    scale in one and not the other would round differently)."""
    group = num_q_heads // num_kv_heads
    return dict(num_kv_splits=1, block_k=64, prescale_q=True, block_q=max(1, 16 // group))


def _batch_invariant_choice(impl: str, tuning: dict, q_shape, num_kv_heads: int) -> tuple[str, dict]:
    """(impl, tuning) of a ``batch_invariant`` call: "auto" is the Triton kernel on a GPU (never the hybrid, whose
    kernel for a sequence follows its query count) with ``batch_invariant_tuning``, the reference in fixed token
    chunks elsewhere; "mosaic" and explicit tuning are a ValueError."""
    if impl == "mosaic":
        raise ValueError("impl='mosaic' is not batch invariant; use 'triton', 'reference' or 'auto'")
    if tuning:
        raise ValueError(f"batch_invariant fixes the kernel's tuning; got {sorted(tuning)}")
    if impl == "auto":
        head_dim = q_shape[-1]
        gpu = jax.default_backend() == "gpu" and head_dim >= 16 and not head_dim & (head_dim - 1)
        impl = "triton" if gpu else "reference"
    return impl, ({} if impl == "reference" else batch_invariant_tuning(q_shape[1], num_kv_heads))


def _tuning_keys(impl: str) -> tuple[str, ...]:
    """The tuning knobs of a kernel: the keyword-only arguments of its ``default_tuning``."""
    if impl == "mosaic":
        from paged_jax.ops.ragged_paged_attention.mgpu_kernel import default_tuning
    else:
        from paged_jax.ops.ragged_paged_attention.triton_kernel import default_tuning
    return tuple(name for name, param in inspect.signature(default_tuning).parameters.items()
                 if param.kind is inspect.Parameter.KEYWORD_ONLY)


def _check_mosaic_inputs(impl: str, k_pages: jax.Array, sinks: jax.Array | None,
                         attention_chunk_size: int | None = None) -> None:
    """ValueError for what ``impl="mosaic"`` cannot run: an FP8 KV pool, attention sinks, attention chunks."""
    if impl != "mosaic":
        return
    if attention_chunk_size is not None:
        raise ValueError("impl='mosaic' does not take chunked local attention (attention_chunk_size, Llama 4); use "
                         "'triton' or 'auto'")
    if jnp.dtype(k_pages.dtype).itemsize == 1:
        raise ValueError(f"impl='mosaic' does not read an FP8 KV pool ({k_pages.dtype}); use 'triton' or 'auto'")
    if sinks is not None:
        raise ValueError("impl='mosaic' does not take attention sinks (the model has them); use 'triton' or 'auto'")


def _check_tuning(impl: str, tuning: dict) -> None:
    """ValueError naming the tuning arguments that ``impl``'s kernel does not take."""
    if tuning:
        allowed = _tuning_keys(impl)
        unknown = set(tuning) - set(allowed)
        if unknown:
            raise ValueError(f"unknown tuning arguments {sorted(unknown)} for impl={impl!r}; expected some of "
                             f"{allowed}")


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
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    attention_chunk_size: int | None = None,
    impl: str = "auto",
    interpret: bool = False,
    batch_invariant: bool = False,
    v_head_dim: int | None = None,
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
      logit_soft_cap: if set (a positive static float), the scaled scores ``s`` become ``cap * tanh(s / cap)``
        before the mask and softmax (Gemma 2). The Mosaic kernel does not implement it: ``"auto"`` keeps such calls
        on the Triton kernel, ``"mosaic"`` raises a ValueError.
      attention_chunk_size: if set (a positive static int ``C``; Llama 4), the query at ``p`` sees only its own
        chunk's keys ``p // C * C <= j <= p``. Not on the Mosaic kernel (``"auto"`` keeps it off, ``"mosaic"`` raises).
      sinks: None, or ``[Hq]`` attention-sink logits (gpt-oss): head ``h``'s softmax denominator gets ``exp(sinks[h])``
        more. Not on the Mosaic kernel: ``"auto"`` keeps such calls on the Triton kernel, ``"mosaic"`` raises.
      impl: one of ``ATTENTION_IMPLS``: ``"triton"`` (the Triton-lowered Pallas kernel, ``triton_kernel``; on CPU
        only with ``interpret=True``), ``"mosaic"`` (the Mosaic GPU prefill kernel for Hopper, ``mgpu_kernel``; on
        CPU only with ``interpret=True``), ``"reference"`` (pure jnp) or ``"auto"`` (``choose_impl``: on a GPU,
        for calls of at least ``MOSAIC_MIN_TOKENS`` tokens on Hopper the hybrid path (``hybrid``: sequences of
        >= 128 query tokens on the Mosaic kernel, the others on the Triton kernel), else the Triton kernel; the
        reference on CPU).
        The old name ``"pallas"`` still means ``"triton"`` (FutureWarning).
      interpret: run the Pallas kernel in interpret mode (CPU tests).
      batch_invariant: each token's output the same bits whatever the batch and its query count
        (``_batch_invariant_choice``).
      v_head_dim: None, or for a latent cache (MLA: ``v_pages`` of width 0) the values' width, the K rows' first
        ``v_head_dim`` columns: ``"triton"`` is then the MLA kernel (``_latent``, ``mla_kernel``).
      **tuning: kernel knobs, the keyword-only arguments of the kernel's ``default_tuning``
        (``triton_kernel.default_tuning``: tile sizes, kv splits, warps, stages and the boolean prefill options of
        the ``triton_kernel`` module docstring; ``mgpu_kernel.default_tuning`` for ``"mosaic"``). Ignored by the
        reference; with ``"auto"`` they are the Triton kernel's (alone, or the short sequences' part of the
        hybrid path).

    Returns:
      ``[T, Hq, D]`` in ``q.dtype``; padding tokens are zeros. Jittable: ``T``, ``S``, ``max_blocks`` are static,
      the index arrays are dynamic.
    """
    impl = resolve_attention_impl(impl)
    validate_inputs(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, sliding_window, logit_soft_cap, sinks,
                    v_head_dim, attention_chunk_size)
    masks = dict(sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
                 attention_chunk_size=None if attention_chunk_size is None else int(attention_chunk_size))
    if v_head_dim is not None:
        return _latent(impl, q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, masks=masks, sinks=sinks,
                       batch_invariant=batch_invariant, v_head_dim=v_head_dim, interpret=interpret, tuning=tuning)
    _check_tuning(impl, tuning)
    if batch_invariant:
        impl, tuning = _batch_invariant_choice(impl, tuning, q.shape, k_pages.shape[2])
    _check_mosaic_inputs(impl, k_pages, sinks, attention_chunk_size)
    if impl == "auto":
        impl = choose_impl(q.shape, k_pages.shape, q.dtype, block_tables.shape[0], sliding_window, k_pages.dtype,
                           logit_soft_cap, sinks is not None, attention_chunk_size)
        if impl == "hybrid":  # the Triton knobs go to its Triton part (the short sequences)
            from paged_jax.ops.ragged_paged_attention.hybrid import ragged_paged_attention_hybrid

            return ragged_paged_attention_hybrid(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens,
                                                 sm_scale=sm_scale, interpret=interpret, triton_tuning=tuning)
    return _run(impl, (q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens), masks, sinks, interpret=interpret,
                batch_invariant=batch_invariant, tuning=tuning)


def _run(impl: str, operands: tuple, masks: dict, sinks, *, interpret: bool, batch_invariant: bool,
         tuning: dict) -> jax.Array:
    """``ragged_paged_attention`` on the implementation ``impl`` ("mosaic", "reference" or "triton") once checked:
    ``operands`` its ``(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens)``, ``masks`` its mask keywords."""
    if impl == "mosaic":
        from paged_jax.ops.ragged_paged_attention.mgpu_kernel import ragged_paged_attention_mgpu

        return ragged_paged_attention_mgpu(*operands, **masks, interpret=interpret, **tuning)
    if impl == "reference":
        return ragged_paged_attention_reference(*operands, **masks, sinks=sinks,
                                                token_chunk=REFERENCE_INVARIANT_CHUNK if batch_invariant else None)
    from paged_jax.ops.ragged_paged_attention.triton_kernel import ragged_paged_attention_triton

    return ragged_paged_attention_triton(*operands, **masks, sinks=sinks, interpret=interpret, **tuning)



def choose_latent_impl(q_shape, k_pages_shape, v_head_dim: int, masks: dict, has_sinks: bool) -> str:
    """What ``impl="auto"`` runs for a latent cache's static call shape: ``"triton"`` (the MLA kernel,
    ``mla_kernel``) on a GPU for a shape it supports without the masks it lacks (sliding window, soft-cap,
    attention chunks, sinks: DeepSeek has none), else ``"reference"``."""
    extras = has_sinks or any(masks[name] is not None
                              for name in ("sliding_window", "logit_soft_cap", "attention_chunk_size"))
    if jax.default_backend() != "gpu" or extras:
        return "reference"
    return "triton" if mla_kernel.supported(q_shape, k_pages_shape, v_head_dim) is None else "reference"


def _latent(impl: str, q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, *, masks: dict, sinks,
            batch_invariant: bool, v_head_dim: int, interpret: bool, tuning: dict) -> jax.Array:
    """A latent cache's attention (``ragged_paged_attention`` with ``v_head_dim``): ``"triton"`` is the MLA kernel
    (``mla_kernel``, which takes no sliding window, soft-cap, attention chunks or sinks), ``"reference"`` the jnp
    oracle, ``"auto"`` ``choose_latent_impl``; ValueError for ``"mosaic"``, for masks or sinks on the kernel and
    for tuning it does not take."""
    if impl == "mosaic":
        raise ValueError("impl='mosaic' does not read a latent KV cache (multi-head latent attention): use "
                         "'triton', 'reference' or 'auto'")
    allowed = [name for name, param in inspect.signature(mla_kernel.default_tuning).parameters.items()
               if param.kind is inspect.Parameter.KEYWORD_ONLY]
    if set(tuning) - set(allowed):
        raise ValueError(f"unknown tuning arguments {sorted(set(tuning) - set(allowed))} for the MLA kernel; "
                         f"expected some of {allowed}")
    if impl == "auto":
        impl = "reference" if batch_invariant else choose_latent_impl(q.shape, k_pages.shape, v_head_dim, masks,
                                                                      sinks is not None)
    if impl == "reference":
        return ragged_paged_attention_reference(
            q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, **masks, sinks=sinks, v_head_dim=v_head_dim,
            token_chunk=REFERENCE_INVARIANT_CHUNK if batch_invariant else None)
    unsupported = [name for name in ("sliding_window", "logit_soft_cap", "attention_chunk_size")
                   if masks[name] is not None] + (["sinks"] if sinks is not None else [])
    if unsupported or batch_invariant:
        raise ValueError(f"the MLA kernel (impl='triton' on a latent KV cache) does not take "
                         f"{unsupported or ['batch_invariant']}; use 'reference'")
    return mla_kernel.mla_paged_attention(q, k_pages, kv_lens, block_tables, cu_q_lens, sm_scale=masks["sm_scale"],
                                          v_head_dim=v_head_dim, interpret=interpret, **tuning)


__all__ = ["ATTENTION_IMPLS", "MOSAIC_MIN_TOKENS", "choose_impl", "choose_latent_impl", "ragged_paged_attention",
           "ragged_paged_attention_reference"]
