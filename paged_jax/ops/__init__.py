"""Paged-attention ops: the slot-mapped KV write (alone or fused with the q/k transform) and ragged paged attention;
importing the package registers the models' other kernels (RMSNorm, quantized matmuls, the fused MoE grouped matmul).

KV pool layout (per layer): ``(k_pages, v_pages)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``; a
latent cache (multi-head latent attention) has a V pool of width 0, its values inside the K rows.
Block 0 is the reserved null block: padding tokens write there and padded block-table entries point there.
"""

from paged_jax.ops import quantized_matmul  # noqa: F401  (registers matmul_impl "pallas" / "auto" of the models)
from paged_jax.ops import quantized_gemv  # noqa: F401  (registers matmul_impl "pallas_blocked")
from paged_jax.ops import rms_norm  # noqa: F401  (registers rms_norm_impl "pallas" / "auto" of the models)
from paged_jax.ops import fused_moe  # noqa: F401  (registers moe_impl "pallas" / "auto" of the models)
from paged_jax.ops import batch_invariant  # noqa: F401  (registers rms_norm_impl "batch_invariant")
from paged_jax.ops.kv_write import is_latent_pool, write_kv
from paged_jax.ops.qk_prepare import qk_prepare
from paged_jax.ops.ragged_paged_attention import ragged_paged_attention


def write_and_attend(meta: dict, q, k, v, kv_layer, *, sm_scale: float, sliding_window: int | None = None,
                     logit_soft_cap: float | None = None, sinks=None, impl: str = "auto", qk_transform=None,
                     qk_prepare_impl: str = "auto", batch_invariant: bool = False,
                     attention_chunk_size: int | None = None):
    """One layer's paged attention on a ragged batch: write the new K/V through the slot mapping, then attend.

    Args:
      meta: ``slot_mapping`` int32[T], ``kv_lens`` int32[S], ``block_tables`` int32[S, max_blocks],
        ``cu_q_lens`` int32[S + 1] (the same for every layer of a step).
      q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_layer: ``(k_pages, v_pages)`` (a latent cache,
        ``kv_write.is_latent_pool``: ``v`` [T, Hkv, Dv] is ``k[..., :Dv]``, only K is stored and the output is
        [T, Hq, Dv]), or ``(k_pages, v_pages, group_meta)``
        whose ``slot_mapping`` / ``block_tables`` (the layer's KV-cache group's) replace ``meta``'s
        (``paged_jax.worker.kv_group_pool``).
      qk_transform: None (q/k already transformed), or the layer's ``models.qk_transform.QKTransform`` for the
        un-normed, un-rotated q/k: then ``qk_prepare`` (impl ``qk_prepare_impl``) transforms them and writes K/V,
        one kernel on a GPU. Build it as ``ReusableAttention(..., fuses_qk_transform=True)`` so the model passes it.
      sm_scale, sliding_window, logit_soft_cap, attention_chunk_size: the layer's attention (``ragged_paged_attention``); a model whose
        layers differ passes its own per layer (``models.attention_fn.LayerAttention``), over the bound ones.
      sinks: None, or the layer's attention-sink logits ``[Hq]`` (gpt-oss; ``ragged_paged_attention``).
      batch_invariant: ``ragged_paged_attention``'s (the engine's batch-invariant mode).
    Returns:
      (out [T, Hq, D], (k_pages, v_pages) updated).
    The signature is ``models.llama.ReusableAttention``'s: bind the static options with ``functools.partial``.
    """
    if len(kv_layer) == 3:
        meta = {**meta, **kv_layer[2]}
    # A latent cache (multi-head latent attention, models.mla): v is k's first columns, read back from the K pool.
    v_head_dim = v.shape[-1] if is_latent_pool(kv_layer[0], kv_layer[1]) else None
    if qk_transform is None:
        k_pages, v_pages = write_kv(kv_layer[0], kv_layer[1], k, v, meta["slot_mapping"])
    else:
        q, k_pages, v_pages = qk_prepare(q, k, v, kv_layer[0], kv_layer[1], meta["slot_mapping"], qk_transform,
                                         impl=qk_prepare_impl)
    out = ragged_paged_attention(q, k_pages, v_pages, meta["kv_lens"], meta["block_tables"], meta["cu_q_lens"],
                                 sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
                                 sinks=sinks, impl=impl, batch_invariant=batch_invariant, v_head_dim=v_head_dim,
                                 attention_chunk_size=attention_chunk_size)
    return out, (k_pages, v_pages)


__all__ = ["write_kv", "qk_prepare", "ragged_paged_attention", "write_and_attend"]
