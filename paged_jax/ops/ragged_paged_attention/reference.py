"""Pure-jnp ragged paged attention: the oracle for the Pallas kernel and the CPU fallback of the engine.

Formulation (token-major): each query token gathers the pages of its own sequence through the block table,
``[max_blocks * block_size, num_kv_heads, head_dim]``, and attends to them with a causal / sliding-window /
attention-chunk / length mask and an fp32 softmax (scores optionally soft-capped, ``cap * tanh(s / cap)``, before the mask; with
attention sinks, each head's sink logit joins the softmax's denominator).
Tokens are processed in chunks of ``C`` by ``lax.map(..., batch_size=C)``.

Cost: compute and gathered bytes are ``O(T * max_blocks * block_size * num_kv_heads * head_dim)`` (every token looks
at its sequence's whole padded context, which is also what a dense per-token decode would read); peak extra memory
is ``O(C * max_blocks * block_size * num_kv_heads * head_dim)`` fp32, with ``C`` chosen so the gathered K and V of one
chunk stay under ``max_chunk_bytes`` (64 MiB by default). Unlike a sequence-major ``[S, T, context]`` formulation, the
memory does not grow with ``S * T``, so the engine's CPU buckets (e.g. T=256, S=64, context 2048) stay small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def sequence_index_and_position(cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int):
    """Per-token sequence index, context position and validity.

    Args:
      cu_q_lens: ``int32[S+1]`` cumulative query lengths.
      kv_lens: ``int32[S]`` context lengths (new tokens included).
      num_tokens: static ``T``.

    Returns:
      ``(seq_idx int32[T], position int32[T], valid bool[T])``: ``seq_idx`` is clamped to ``[0, S-1]`` for padding
      tokens (``valid`` False), ``position`` is the token's position in its sequence's context.
    """
    num_seqs = kv_lens.shape[0]
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    # Number of sequences that end at or before token t = index of the sequence owning t (empty ones are skipped).
    # compare_all: a fused comparison instead of the default binary search's XLA while loop.
    seq_idx = jnp.searchsorted(cu_q_lens[1:], tokens, side="right", method="compare_all").astype(jnp.int32)
    valid = tokens < cu_q_lens[num_seqs]
    seq_idx = jnp.minimum(seq_idx, num_seqs - 1)
    q_start = cu_q_lens[seq_idx]
    q_len = cu_q_lens[seq_idx + 1] - q_start
    position = kv_lens[seq_idx] - q_len + (tokens - q_start)
    return seq_idx, position, valid


def ragged_paged_attention_reference(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, *, sm_scale: float,
                                     sliding_window: int | None = None, logit_soft_cap: float | None = None,
                                     sinks: jax.Array | None = None, max_chunk_bytes: int = 64 << 20,
                                     token_chunk: int | None = None, v_head_dim: int | None = None,
                                     attention_chunk_size: int | None = None) -> jax.Array:
    """Ragged paged attention in pure jnp (fp32 scores, softmax and accumulation).

    Args:
      q: ``[T, Hq, D]`` queries.
      k_pages, v_pages: ``[num_blocks, block_size, Hkv, D]``.
      kv_lens: ``int32[S]``; block_tables: ``int32[S, max_blocks]``; cu_q_lens: ``int32[S+1]``.
      sm_scale: softmax scale applied to ``q . k``.
      sliding_window: if set, a query at position ``p`` sees keys ``p - sliding_window < j <= p``.
      attention_chunk_size: if set, a query at position ``p`` sees only keys of its own chunk,
        ``p // attention_chunk_size * attention_chunk_size <= j <= p`` (Llama 4's chunked local attention).
      logit_soft_cap: if set, the scaled scores ``s`` become ``logit_soft_cap * tanh(s / logit_soft_cap)`` (Gemma 2).
      sinks: None, or ``[Hq]`` logits (any float dtype, used in float32): head ``h``'s softmax denominator gets
        ``exp(sinks[h])`` more (gpt-oss's attention sinks; the sink has no value).
      max_chunk_bytes: bound on the fp32 K+V gathered per chunk of tokens (sets the ``lax.map`` batch size).
      token_chunk: if set, the ``lax.map`` batch size instead, the tokens padded to a multiple of it, and each
        token's keys in blocks of ``INVARIANT_KEY_BLOCK`` by an online softmax (``_key_blocks_attention``): every
        chunk is then the same vmapped computation whatever ``T`` and the table's width (batch-invariant mode).
      v_head_dim: None, or for a latent cache (``v_pages`` of width 0, multi-head latent attention) the values'
        width: each key row's first ``v_head_dim`` columns are its value (not with ``token_chunk``).

    Returns:
      ``[T, Hq, D]`` (``[T, Hq, v_head_dim]`` for a latent cache) in ``q.dtype``;
      padding tokens (index >= ``cu_q_lens[S]``) are zeros.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_pages.shape
    out_dim = head_dim if v_head_dim is None else v_head_dim
    max_blocks = block_tables.shape[1]
    group = num_q_heads // num_kv_heads
    context = max_blocks * block_size

    seq_idx, position, valid = sequence_index_and_position(cu_q_lens, kv_lens, num_tokens)
    key_pos = jnp.arange(context, dtype=jnp.int32)
    sink_logits = None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, group, 1)

    def attend_one_token(args):
        q_t, s, pos, is_valid = args  # [Hq, D], scalars
        pages = block_tables[s]  # [max_blocks]
        k = k_pages[pages].reshape(context, num_kv_heads, head_dim).astype(jnp.float32)
        if v_head_dim is None:
            v = v_pages[pages].reshape(context, num_kv_heads, head_dim).astype(jnp.float32)
        else:  # a latent cache: the values are the first v_head_dim columns of the K rows
            v = k[..., :v_head_dim]
        q_g = q_t.astype(jnp.float32).reshape(num_kv_heads, group, head_dim)
        scores = _masked_scores(q_g, k, key_pos, pos, kv_lens[s], sm_scale, logit_soft_cap, sliding_window,
                                attention_chunk_size)
        # Padding tokens have no visible key: keep the softmax finite, then zero them below.
        row_max = jnp.max(scores, axis=-1, keepdims=True)
        row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
        if sink_logits is not None:
            row_max = jnp.maximum(row_max, sink_logits)
        weights = jnp.exp(scores - row_max)
        denom = jnp.sum(weights, axis=-1, keepdims=True)
        if sink_logits is not None:
            denom = denom + jnp.exp(sink_logits - row_max)
        out = jnp.einsum("hgl,lhd->hgd", weights, v, precision=lax.Precision.HIGHEST)
        return finish(out, denom, is_valid)

    def finish(out, denom, is_valid):
        out = out / jnp.where(denom > 0, denom, 1.0)
        out = jnp.where(is_valid, out, 0.0)
        return out.reshape(num_q_heads, out_dim).astype(q.dtype)

    if token_chunk is not None:
        if v_head_dim is not None:
            raise ValueError("batch-invariant attention (token_chunk) does not read a latent (MLA) cache")
        pad = -num_tokens % token_chunk
        padded = [jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in (q, seq_idx, position, valid)]
        blocked = _key_blocks_attention(k_pages, v_pages, kv_lens, block_tables, sm_scale, sliding_window,
                                        logit_soft_cap, sink_logits, finish, attention_chunk_size)
        return lax.map(blocked, tuple(padded), batch_size=token_chunk)[:num_tokens]
    bytes_per_token = 2 * context * num_kv_heads * head_dim * 4
    chunk = int(max(1, min(num_tokens, max_chunk_bytes // max(bytes_per_token, 1))))
    return lax.map(attend_one_token, (q, seq_idx, position, valid), batch_size=chunk)


def _masked_scores(q_g, k, key_pos, pos, kv_len, sm_scale, logit_soft_cap, sliding_window, attention_chunk_size):
    """One token's fp32 scores ``[Hkv, group, L]`` of ``q_g`` ``[Hkv, group, D]`` against keys ``k`` ``[L, Hkv, D]``
    at context positions ``key_pos`` ``int32[L]``, soft-capped, -inf where the token at ``pos`` cannot see the key
    (causal, ``kv_len``, the sliding window, its attention chunk)."""
    scores = jnp.einsum("hgd,lhd->hgl", q_g, k, precision=lax.Precision.HIGHEST) * sm_scale
    if logit_soft_cap is not None:
        scores = logit_soft_cap * jnp.tanh(scores / logit_soft_cap)
    visible = (key_pos <= pos) & (key_pos < kv_len)
    if sliding_window is not None:
        visible &= key_pos > pos - sliding_window
    if attention_chunk_size is not None:
        visible &= key_pos >= pos // attention_chunk_size * attention_chunk_size
    return jnp.where(visible[None, None, :], scores, -jnp.inf)


# Keys per block of the batch-invariant reference's online softmax.
INVARIANT_KEY_BLOCK = 64


def _key_blocks_attention(k_pages, v_pages, kv_lens, block_tables, sm_scale, sliding_window, logit_soft_cap,
                          sink_logits, finish, attention_chunk_size=None):
    """One token's attention (``(q_t [Hq, D], seq, position, valid) -> [Hq, D]``) over its sequence's keys in blocks
    of ``INVARIANT_KEY_BLOCK`` from position 0, by an online softmax in float32: a block of keys it cannot see
    leaves the running max, sum and output exactly as they were, so the bits do not depend on how many blocks the
    table's width adds (a reduction over the whole padded context would be compiled by its length)."""
    _, block_size, num_kv_heads, head_dim = k_pages.shape
    context = block_tables.shape[1] * block_size
    num_key_blocks = -(-context // INVARIANT_KEY_BLOCK)
    pad = num_key_blocks * INVARIANT_KEY_BLOCK - context

    def attend(args):
        q_t, s, pos, is_valid = args
        q_g = q_t.astype(jnp.float32).reshape(num_kv_heads, -1, head_dim)

        def key_blocks(pages):
            x = pages[block_tables[s]].reshape(context, num_kv_heads, head_dim).astype(jnp.float32)
            return jnp.pad(x, ((0, pad), (0, 0), (0, 0))).reshape(num_key_blocks, INVARIANT_KEY_BLOCK, num_kv_heads,
                                                                 head_dim)

        def step(carry, block):
            m, denom, out = carry
            k, v, key_pos = block
            scores = _masked_scores(q_g, k, key_pos, pos, kv_lens[s], sm_scale, logit_soft_cap, sliding_window,
                                    attention_chunk_size)
            m_new = jnp.maximum(m, jnp.max(scores, axis=-1, keepdims=True))
            m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
            alpha, weights = jnp.exp(m - m_safe), jnp.exp(scores - m_safe)
            out = out * alpha + jnp.einsum("hgl,lhd->hgd", weights, v, precision=lax.Precision.HIGHEST)
            return (m_new, denom * alpha + jnp.sum(weights, axis=-1, keepdims=True), out), None

        positions = jnp.arange(num_key_blocks * INVARIANT_KEY_BLOCK, dtype=jnp.int32).reshape(num_key_blocks, -1)
        start = (jnp.full(q_g.shape[:2] + (1,), -jnp.inf, jnp.float32), jnp.zeros(q_g.shape[:2] + (1,), jnp.float32),
                 jnp.zeros(q_g.shape, jnp.float32))
        (m, denom, out), _ = lax.scan(step, start, (key_blocks(k_pages), key_blocks(v_pages), positions))
        if sink_logits is not None:
            denom = denom + jnp.exp(sink_logits - jnp.where(jnp.isfinite(m), m, 0.0))
        return finish(out, denom, is_valid)

    return attend
