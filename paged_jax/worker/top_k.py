"""The k largest entries of each row of logits, and the sampler's top-k / top-p filters built on them.

``vocab_top_k``: ``lax.top_k`` over a vocabulary row in two small stages instead of one large one. On the GPU XLA
either sorts every row (k > 16) or runs its TopK kernel, whose time grows with k (benchmarks/RESULTS.md, "Sampler":
on 256 rows of Qwen3's vocabulary, k = 16 took 0.66 ms and a sort 2.6 ms). Here each row is cut into blocks,
the k blocks with the largest maxima are kept, and the top k of their entries is the row's: ``k x block`` entries
per row instead of V, and a reduction over the row.

Top-k then top-p (nucleus) filtering turns both into a per-row logit cutoff, two ways with the same result:
* ``top_k_top_p_by_sort``: one descending sort of every row (any top_k, any top_p). A sort of rows x vocabulary is
  the sampler's most expensive piece.
* ``top_k_top_p_from_candidates``: the cutoff searched among each row's ``TOP_K_CANDIDATES`` largest logits
  (``vocab_top_k``): exact for rows whose top_k is in ``1..TOP_K_CANDIDATES`` (whatever their top_p) or which use
  neither filter (``candidates_suffice``). The sampler's host side picks this form for a step only when every row
  qualifies (``SamplingMode.TOP_K``): e.g. Qwen3's generation config (top_k 20, top_p 0.95). A row with top-p alone
  can need any number of tokens, so it keeps the sort.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Candidates per row ``top_k_top_p_from_candidates`` finds the cutoff among: the largest top_k it serves, one that
# covers the top_k values in common use (20, 40, 50).
TOP_K_CANDIDATES = 64


def top_k_block_size(vocab_size: int, k: int) -> int:
    """Entries per block of ``vocab_top_k``: the power of two nearest ``sqrt(vocab_size / k)`` (it balances the
    blocks' maxima, ``vocab_size / block`` per row, against the kept entries, ``k x block``), at least 8; 0 = no
    blocks (a row of at most ``4 x k x block`` entries: ``lax.top_k`` directly)."""
    block = max(8, 2 ** round(math.log2(math.sqrt(vocab_size / max(k, 1)))))
    return block if vocab_size > 4 * k * block else 0


def vocab_top_k(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(logits, k)``: f32[S, V] -> (values f32[S, k], ids i32[S, k]), each row in descending order,
    equal values by lower id first.

    Exact for logits without NaN, ties included (+0.0 and -0.0 count as equal, as ``jnp.max`` sees them): an entry
    of the row's top k (by value, then lower id) lies in one of the k blocks with the largest maxima (by value, then
    lower block), since otherwise the k maxima of those blocks would all come before it. The kept blocks are
    gathered in id order, so ``lax.top_k``'s lower position first is lower id first. A row that does not fill its
    last block is padded with -inf entries, after every real one in that order."""
    num_rows, vocab_size = logits.shape
    if k > vocab_size:
        raise ValueError(f"top-k: k={k} is more than the {vocab_size} entries of a row")
    block = top_k_block_size(vocab_size, k)
    if not block:
        return jax.lax.top_k(logits, k)
    num_blocks = -(-vocab_size // block)
    padded = jnp.pad(logits, ((0, 0), (0, num_blocks * block - vocab_size)), constant_values=-jnp.inf)
    blocks = padded.reshape(num_rows, num_blocks, block)
    _, kept = jax.lax.top_k(jnp.max(blocks, axis=-1), k)  # [S, k] block ids
    kept = jnp.sort(kept, axis=-1)
    entries = jnp.take_along_axis(blocks, kept[:, :, None], axis=1).reshape(num_rows, k * block)
    values, positions = jax.lax.top_k(entries, k)
    ids = kept[jnp.arange(num_rows)[:, None], positions // block] * block + positions % block
    return values, ids.astype(jnp.int32)


def _filters_off(top_k, top_p, vocab_size: int | None):
    """Neither filter changes the row: top_k <= 0 (or, given ``vocab_size``, >= it) and top_p >= 1."""
    top_k_off = top_k <= 0
    if vocab_size is not None:
        top_k_off = top_k_off | (top_k >= vocab_size)
    return top_k_off & (top_p >= 1.0)


def candidates_suffice(top_k, top_p, vocab_size: int | None = None):
    """Whether ``top_k_top_p_from_candidates`` serves a row with these parameters exactly: Python numbers (the host
    side, per row) -> bool, or arrays i32[S], f32[S] -> bool[S] (``generate``, traced). top_k <= 0 = off, top_p >= 1
    = off; a top_k of at least ``vocab_size`` keeps every token, as off."""
    return _filters_off(top_k, top_p, vocab_size) | ((top_k > 0) & (top_k <= TOP_K_CANDIDATES))


def _kept_prefix(sorted_desc: jax.Array, k: jax.Array, top_p: jax.Array) -> jax.Array:
    """How many leading entries of each descending row top-k then top-p keep (>= 1): sorted_desc f32[S, W], k i32[S]
    (1..W), top_p f32[S] -> i32[S]. Top-p's probabilities are the softmax over the row's top k."""
    in_top_k = jnp.arange(sorted_desc.shape[1], dtype=jnp.int32)[None, :] < k[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, sorted_desc, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs  # exclusive prefix sum
    # top_p >= 1 must keep everything: rounding can push the mass before the last tokens slightly above 1.
    keep = in_top_k & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
    return jnp.maximum(jnp.sum(keep, axis=-1), 1)


def _above(logits: jax.Array, cutoff: jax.Array) -> jax.Array:
    return jnp.where(logits >= cutoff, logits, -jnp.inf)


def top_k_top_p_by_sort(scaled_logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Top-k then top-p (nucleus) filtering with one descending sort per row. f32[S, V] -> f32[S, V].

    top_k i32[S] (<= 0 = off), top_p f32[S] (>= 1 = off). Top-p keeps the smallest prefix of the descending
    order (after top-k) whose probability mass is >= top_p; the most likely token always survives. Both are
    turned into a per-row logit cutoff, so no scatter back from sorted order is needed; tokens tied with the
    cutoff value are all kept.
    """
    vocab_size = scaled_logits.shape[1]
    # Sorting the negation ascending gives a descending order with -inf last.
    sorted_desc = -jnp.sort(-scaled_logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab_size), vocab_size)
    num_kept = _kept_prefix(sorted_desc, k, top_p)
    return _above(scaled_logits, jnp.take_along_axis(sorted_desc, (num_kept - 1)[:, None], axis=-1))


def top_k_top_p_from_candidates(scaled_logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """``top_k_top_p_by_sort``'s result for rows where ``candidates_suffice``, without the sort. f32[S, V] ->
    f32[S, V]; top_k i32[S], top_p f32[S] as there. Other rows: undefined (the caller's host side sends none).

    The top ``TOP_K_CANDIDATES`` logits of a row are the first entries of its descending sort, so a top_k of at most
    that many is decided among them, and top-p after it too (its probabilities are normalized over the top k). A
    row with neither filter keeps every token. The probabilities' sums run over fewer terms than the sort's, so a
    top_p within float32 rounding of a prefix's mass can end one token apart."""
    vocab_size = scaled_logits.shape[1]
    if vocab_size <= TOP_K_CANDIDATES:
        return top_k_top_p_by_sort(scaled_logits, top_k, top_p)
    candidates, _ = vocab_top_k(scaled_logits, TOP_K_CANDIDATES)  # f32[S, C], descending
    k = jnp.where((top_k > 0) & (top_k <= TOP_K_CANDIDATES), top_k, TOP_K_CANDIDATES)
    num_kept = _kept_prefix(candidates, k, top_p)
    cutoff = jnp.take_along_axis(candidates, (num_kept - 1)[:, None], axis=-1)
    return _above(scaled_logits, jnp.where(_filters_off(top_k, top_p, vocab_size)[:, None], -jnp.inf, cutoff))
