"""paged_jax.top_k: the rounds of at most TOP_K_KERNEL_MAX_K against lax.top_k itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.top_k import TOP_K_KERNEL_MAX_K, vocab_top_k


@pytest.mark.parametrize("k", [1, TOP_K_KERNEL_MAX_K, TOP_K_KERNEL_MAX_K + 1, 20, 2 * TOP_K_KERNEL_MAX_K + 3])
def test_vocab_top_k_equals_lax_top_k(k):
    """Fresh random rows with many ties (bf16-rounded values, a row of seven values shared by hundreds of ids, so
    the rounds' boundaries fall inside tie groups), -inf entries (a grammar's mask), a row with fewer finite
    entries than k and a row of only -inf: ids and values equal to lax.top_k's, order of ties included."""
    rng = np.random.default_rng(k)
    rows, vocab = 9, 4000
    logits = rng.standard_normal((rows, vocab)).astype(np.float32) * 4
    logits = np.array(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))
    logits[rng.random((rows, vocab)) < 0.2] = -np.inf
    logits[1] = rng.integers(-3, 4, size=vocab)
    logits[2] = -np.inf
    logits[2, rng.choice(vocab, size=max(k // 2, 1), replace=False)] = rng.standard_normal(max(k // 2, 1))
    logits[3] = -np.inf
    logits[4, ::7] = 2.5  # a tie group across ids far apart
    want_values, want_ids = jax.jit(jax.lax.top_k, static_argnums=1)(jnp.asarray(logits), k)
    got_values, got_ids = jax.jit(vocab_top_k, static_argnums=1)(jnp.asarray(logits), k)
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(got_values), np.asarray(want_values))
    assert got_ids.dtype == want_ids.dtype and got_values.shape == (rows, k)


def test_vocab_top_k_refuses_more_than_a_row():
    """Rounds past the row would return ids twice; lax.top_k refuses too."""
    with pytest.raises(ValueError, match="k=40"):
        vocab_top_k(jnp.zeros((2, 30)), 40)
