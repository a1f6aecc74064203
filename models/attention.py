"""Cache-free attention for the flat token batch: the reference ``AttentionFn`` used by tests and simple paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.attention_fn import AttentionFn


def dense_causal_attention(segment_ids: jax.Array, sm_scale: float, sliding_window: int | None = None,
                           positions: jax.Array | None = None) -> AttentionFn:
    """Causal attention within each segment of a flat batch of T tokens, O(T^2) memory.

    Args:
      segment_ids: int32[T]; token i attends to token j iff ``segment_ids[i] == segment_ids[j]`` and j <= i
        (tokens of one segment must be contiguous and in order). Use a negative id for padding: padding tokens
        only see themselves, so their rows stay finite.
      sm_scale: softmax scale, usually ``head_dim ** -0.5``.
      sliding_window: if set, token i only sees tokens j with ``i - j < sliding_window`` (Mistral semantics).
      positions: optional int32[T]; when given, causality/window use these instead of flat indices (lets a segment
        be non-contiguous). Defaults to flat token indices.
    Returns:
      ``attention(layer_idx, q[T,Hq,D], k[T,Hkv,D], v[T,Hkv,D], kv_layer) -> (out[T,Hq,D], kv_layer)``; kv_layer is
      returned unchanged. Softmax in float32; GQA by repeating kv heads. It takes a layer's own options
      (``takes_layer_attention``): ``sm_scale=, sliding_window=, logit_soft_cap=`` keywords override the ones
      given here (``logit_soft_cap``: ``cap * tanh(s / cap)`` on the scaled scores; ``attention_chunk_size``: token
      i sees only tokens of its own chunk, ``order // chunk`` equal, Llama 4), and attention sinks
      (``takes_attention_sinks``): ``sinks`` [Hq], one logit per head joining each row's softmax denominator.
    """
    if sliding_window is not None and sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
    segment_ids = jnp.asarray(segment_ids, dtype=jnp.int32)
    order = jnp.arange(segment_ids.shape[0], dtype=jnp.int32) if positions is None else jnp.asarray(positions)
    same_segment = segment_ids[:, None] == segment_ids[None, :]
    causal = order[:, None] >= order[None, :]
    causal_mask = same_segment & causal  # [T(query), T(key)]
    distance = order[:, None] - order[None, :]
    # A token always sees itself, so every row has at least one unmasked entry (padding included).
    itself = jnp.eye(segment_ids.shape[0], dtype=bool)
    default_scale, default_window = sm_scale, sliding_window

    def attention(layer_idx: int, q: jax.Array, k: jax.Array, v: jax.Array, kv_layer, *, sm_scale: float = None,
                  sliding_window: int | None = default_window, logit_soft_cap: float | None = None,
                  sinks: jax.Array | None = None, attention_chunk_size: int | None = None):
        sm_scale = default_scale if sm_scale is None else sm_scale
        mask = causal_mask if sliding_window is None else causal_mask & (distance < sliding_window)
        if attention_chunk_size is not None:
            mask = mask & (order[:, None] // attention_chunk_size == order[None, :] // attention_chunk_size)
        mask = mask | itself
        num_tokens, num_heads, _ = q.shape
        num_kv_heads = k.shape[1]
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"q heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")
        if num_tokens != segment_ids.shape[0]:
            raise ValueError(f"q has {num_tokens} tokens but segment_ids has {segment_ids.shape[0]}")
        group = num_heads // num_kv_heads
        k_rep = jnp.repeat(k, group, axis=1)  # [T, Hq, D]
        v_rep = jnp.repeat(v, group, axis=1)
        scores = jnp.einsum("qhd,khd->hqk", q, k_rep, preferred_element_type=jnp.float32) * sm_scale
        if logit_soft_cap is not None:
            scores = logit_soft_cap * jnp.tanh(scores / logit_soft_cap)
        scores = jnp.where(mask[None, :, :], scores, -jnp.inf)
        if sinks is None:
            probs = jax.nn.softmax(scores, axis=-1)
        else:  # the sink is one more logit per row, its probability dropped
            sink = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], (*scores.shape[:2], 1))
            probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
        out = jnp.einsum("hqk,khd->qhd", probs.astype(v.dtype), v_rep, preferred_element_type=jnp.float32)
        return out.astype(q.dtype), kv_layer

    attention.takes_layer_attention = True
    attention.takes_attention_sinks = True
    return attention
