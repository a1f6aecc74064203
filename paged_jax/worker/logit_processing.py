"""The sampler's per-row logit transforms on the device (``paged_jax.worker.sampler`` applies them in vLLM's order):
bans, the allowed-token bitmask, logit bias, penalties, temperature with min-p / top-k / top-p, and the per-row
Gumbel noise. Every function takes the batch's logits f32[S, V] with per-row parameters of leading dimension S;
``score_tokens`` (``paged_jax.research.scoring``) applies ``temperature_and_filters`` as the sampler does."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from paged_jax.worker.top_k import top_k_top_p_by_sort


def _row_scatter_indices(token_ids: jax.Array, vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """(row index i32[S, N], column i32[S, N]) for a per-row scatter; -1 padding maps to column V (dropped)."""
    num_rows, width = token_ids.shape
    row_index = jnp.broadcast_to(jnp.arange(num_rows, dtype=jnp.int32)[:, None], (num_rows, width))
    column = jnp.where((token_ids >= 0) & (token_ids < vocab_size), token_ids, vocab_size)
    return row_index, column


def ban_tokens(logits: jax.Array, banned_token_ids: jax.Array) -> jax.Array:
    """Set logits[i, banned_token_ids[i, j]] to -inf (entries < 0 are padding). f32[S, V] -> f32[S, V]."""
    if banned_token_ids.shape[1] == 0:
        return logits
    row_index, column = _row_scatter_indices(banned_token_ids, logits.shape[1])
    return logits.at[row_index, column].set(-jnp.inf, mode="drop")


def apply_allowed_token_mask(logits: jax.Array, allowed_token_mask: jax.Array) -> jax.Array:
    """-inf for every token whose bit is clear in ``allowed_token_mask`` i32[S, M] (bit v % 32 of word v // 32;
    M = 0: no-op). f32[S, V] -> f32[S, V]."""
    num_rows, vocab_size = logits.shape
    if allowed_token_mask.shape[1] == 0:
        return logits
    bits = jnp.right_shift(allowed_token_mask[:, :, None], jnp.arange(32, dtype=jnp.int32)) & 1
    allowed = bits.reshape(num_rows, -1)[:, :vocab_size] != 0
    return jnp.where(allowed, logits, -jnp.inf)


def apply_logit_bias(logits: jax.Array, logit_bias_ids: jax.Array, logit_bias: jax.Array) -> jax.Array:
    """logits[i, logit_bias_ids[i, j]] += logit_bias[i, j] (ids < 0 are padding; ids are distinct per row).
    f32[S, V], i32[S, K], f32[S, K] -> f32[S, V]."""
    if logit_bias_ids.shape[1] == 0:
        return logits
    row_index, column = _row_scatter_indices(logit_bias_ids, logits.shape[1])
    return logits.at[row_index, column].add(logit_bias, mode="drop")


def apply_penalties(
    logits: jax.Array,
    prev_token_ids: jax.Array,
    prompt_len: jax.Array,
    presence: jax.Array,
    frequency: jax.Array,
    repetition: jax.Array,
) -> jax.Array:
    """vLLM's penalties. f32[S, V] -> f32[S, V].

    repetition: for tokens seen in prompt or output, logit / rp if logit > 0 else logit * rp.
    frequency: logit -= frequency * (count of the token in the output).
    presence: logit -= presence * (token occurs in the output).
    Rows with neutral parameters (rp = 1, 0, 0) come out bit-identical.
    """
    num_rows, vocab_size = logits.shape
    width = prev_token_ids.shape[1]
    if width == 0:
        return logits
    position = jnp.arange(width, dtype=jnp.int32)[None, :]
    is_output = (position >= prompt_len[:, None]) & (prev_token_ids >= 0)
    row_index, column = _row_scatter_indices(prev_token_ids, vocab_size)
    output_counts = (
        jnp.zeros((num_rows, vocab_size), jnp.int32).at[row_index, column].add(is_output.astype(jnp.int32), mode="drop")
    )
    seen = jnp.zeros((num_rows, vocab_size), jnp.bool_).at[row_index, column].set(True, mode="drop")
    rep = jnp.where(seen, repetition[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - frequency[:, None] * output_counts.astype(logits.dtype)
    logits = logits - presence[:, None] * (output_counts > 0).astype(logits.dtype)
    return logits


def apply_min_p(scaled_logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Drop tokens with prob < min_p * max prob, i.e. logit < max logit + log(min_p). f32[S, V] -> f32[S, V]."""
    # log(0) = -inf, so min_p = 0 keeps everything; the top token always survives (0 >= log(min_p) for min_p <= 1).
    threshold = jnp.max(scaled_logits, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]
    return jnp.where(scaled_logits >= threshold, scaled_logits, -jnp.inf)


def temperature_and_filters(logits: jax.Array, temperature: jax.Array, min_p: jax.Array | None = None,
                            top_k: jax.Array | None = None, top_p: jax.Array | None = None,
                            filters=top_k_top_p_by_sort) -> jax.Array:
    """The sampler's transform from temperature on: logits / temperature -> min-p -> top-k -> top-p (filtered
    tokens -inf). f32[S, V] -> f32[S, V]; temperature f32[S] (> 0), min_p f32[S], top_k i32[S] (<= 0 = off), top_p
    f32[S] (>= 1 = off); min_p None: temperature only. ``filters``: ``top_k_top_p_by_sort`` or, for rows
    ``candidates_suffice`` serves, ``top_k_top_p_from_candidates``. ``score_tokens`` applies the same."""
    scaled = logits / temperature[:, None]
    if min_p is None:
        return scaled
    return filters(apply_min_p(scaled, min_p), top_k, top_p)


def gumbel_noise(seeds: jax.Array, steps: jax.Array, vocab_size: int) -> jax.Array:
    """Per-row Gumbel(0, 1) noise f32[S, V] from key = fold_in(key(seed), step) (``seeds`` u32[S]) or
    fold_in(seeds[i], step) (``seeds`` key[S], typed keys): independent of the batch."""
    if not jnp.issubdtype(seeds.dtype, jax.dtypes.prng_key):
        seeds = jax.vmap(jax.random.key)(seeds.astype(jnp.uint32))

    def row_noise(key, step):
        return jax.random.gumbel(jax.random.fold_in(key, step), (vocab_size,), jnp.float32)

    return jax.vmap(row_noise)(seeds, steps.astype(jnp.uint32))
