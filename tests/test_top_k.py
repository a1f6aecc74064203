"""paged_jax.worker.top_k: the blocked top-k against lax.top_k itself; the top-k / top-p cutoffs from
the candidates against the sort."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.worker.top_k import (TOP_K_CANDIDATES, candidates_suffice, top_k_block_size, top_k_top_p_by_sort,
                             top_k_top_p_from_candidates, vocab_top_k)


@pytest.mark.parametrize("vocab", [4000, 4001])
@pytest.mark.parametrize("k", [1, 5, 16, 20, TOP_K_CANDIDATES])
def test_vocab_top_k_equals_lax_top_k(k, vocab):
    """Fresh random rows with many ties (bf16-rounded values, a row of seven values shared by hundreds of ids, so
    that tie groups straddle the kept blocks), -inf entries (a grammar's mask), a row with fewer finite entries
    than k and a row of only -inf, in a vocabulary that fills its last block or not: ids and values equal to
    lax.top_k's, order of ties included."""
    assert top_k_block_size(vocab, k), "the blocked path must run"
    rng = np.random.default_rng(k + vocab)
    rows = 9
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
    """lax.top_k refuses too."""
    with pytest.raises(ValueError, match="k=40"):
        vocab_top_k(jnp.zeros((2, 30)), 40)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_top_p_from_candidates_equals_the_sort(seed):
    """Fresh random rows (peaked and flat, bf16-rounded so that ties straddle cutoffs, -inf entries as min-p or a
    grammar leave them, rows with fewer finite entries than their top_k, an all-equal row) with every kind of row
    ``candidates_suffice`` admits: the same filtered logits as the sort, bit for bit."""
    rng = np.random.default_rng(seed)
    rows, vocab = 48, 3000
    logits = rng.standard_normal((rows, vocab)) * rng.choice([0.3, 2.0, 6.0], size=(rows, 1))
    logits = np.array(jnp.asarray(logits.astype(np.float32), jnp.bfloat16).astype(jnp.float32))
    logits[rng.random((rows, vocab)) < 0.3] = -np.inf
    logits[5] = -np.inf
    logits[5, rng.choice(vocab, size=7, replace=False)] = rng.standard_normal(7)
    logits[6] = 1.25  # every token tied
    choices = [(0, 1.0), (vocab, 1.0), (vocab + 10, 1.0), (1, 0.5), (5, 1.0), (20, 0.95), (20, 1e-6),
               (TOP_K_CANDIDATES, 0.999), (TOP_K_CANDIDATES, 0.6), (37, 0.9), (3, 0.2)]
    picks = rng.integers(0, len(choices), size=rows)
    top_k = np.array([choices[i][0] for i in picks], np.int32)
    top_p = np.array([choices[i][1] for i in picks], np.float32)
    top_k[5], top_p[5] = 20, 0.9  # 7 finite entries, top_k 20
    top_k[6], top_p[6] = 20, 0.5
    assert all(candidates_suffice(int(k), float(p), vocab) for k, p in zip(top_k, top_p))
    args = (jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p))
    want = np.asarray(jax.jit(top_k_top_p_by_sort)(*args))
    got = np.asarray(jax.jit(top_k_top_p_from_candidates)(*args))
    np.testing.assert_array_equal(got, want)
    kept = np.isfinite(want).sum(-1)
    assert kept.min() >= 1 and (kept == vocab - (logits == -np.inf).sum(-1)).any() and (kept < 64).any()


def test_candidates_suffice():
    assert candidates_suffice(0, 1.0) and candidates_suffice(1, 0.1) and candidates_suffice(TOP_K_CANDIDATES, 0.9)
    assert not candidates_suffice(0, 0.9)  # top-p alone
    assert not candidates_suffice(TOP_K_CANDIDATES + 1, 1.0)
    assert candidates_suffice(500, 1.0, vocab_size=500) and not candidates_suffice(500, 0.9, vocab_size=500)
