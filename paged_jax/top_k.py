"""The k largest entries of each row of logits, in rounds that XLA's GPU TopK kernel takes.

XLA rewrites ``lax.top_k`` into its TopK kernel for k <= ``TOP_K_KERNEL_MAX_K`` only; for a larger k (the OpenAI API's
20 top logprobs, beam search's 2 x beam width) it sorts every row of the vocabulary instead, several times slower
(benchmarks/RESULTS.md, "One-off measurements": the sampler on 256 rows). ``vocab_top_k`` takes the top
``TOP_K_KERNEL_MAX_K`` at a time and drops them before the next round: the same ids and values as ``lax.top_k``
(tests/test_top_k.py, on the CPU; XLA's GPU kernel also puts equal values by lower index first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The largest k of XLA's GPU TopK kernel.
TOP_K_KERNEL_MAX_K = 16


def vocab_top_k(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``jax.lax.top_k(logits, k)``: f32[S, V] -> (values f32[S, k], ids i32[S, k]), each row in descending order,
    equal values by lower id first; for k > ``TOP_K_KERNEL_MAX_K`` in rounds of at most that many.

    A round's picks are set to -inf so that the next round ranks them below every entry not picked yet; for that the
    rounds see -inf logits (e.g. tokens a grammar forbids) as the lowest finite float32, which only orders them
    differently against a logit of exactly that value (by id instead of after it). The values returned are the
    logits themselves."""
    if k > logits.shape[-1]:
        raise ValueError(f"top-k: k={k} is more than the {logits.shape[-1]} entries of a row")
    if k <= TOP_K_KERNEL_MAX_K:
        return jax.lax.top_k(logits, k)
    lowest = jnp.finfo(logits.dtype).min
    remaining = jnp.where(logits == -jnp.inf, lowest, logits)
    rows = jnp.arange(logits.shape[0])[:, None]
    rounds = []
    for start in range(0, k, TOP_K_KERNEL_MAX_K):
        width = min(TOP_K_KERNEL_MAX_K, k - start)
        _, ids = jax.lax.top_k(remaining, width)
        rounds.append(ids)
        if start + width < k:
            remaining = remaining.at[rows, ids].set(-jnp.inf)
    ids = jnp.concatenate(rounds, axis=1)
    return jnp.take_along_axis(logits, ids, axis=1), ids
