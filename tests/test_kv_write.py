"""write_kv: every new K/V lands exactly at its slot, nothing else in the pool changes, also under jit donation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.ops import write_kv

NUM_BLOCKS, BLOCK_SIZE, HKV, D = 12, 4, 2, 8


def _random_pool(rng, dtype=np.float32):
    shape = (NUM_BLOCKS, BLOCK_SIZE, HKV, D)
    return rng.standard_normal(shape).astype(dtype), rng.standard_normal(shape).astype(dtype)


def _slots_for_batch(rng, kv_lens_before, q_lens, num_padding):
    """Slot mapping the engine would build: shuffled non-null blocks per sequence, padding in block 0."""
    free = list(rng.permutation(np.arange(1, NUM_BLOCKS)))
    slots = []
    for start, q_len in zip(kv_lens_before, q_lens):
        total = start + q_len
        blocks = [free.pop() for _ in range(-(-total // BLOCK_SIZE))]
        for pos in range(start, total):
            slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    real = len(slots)
    slots += list(rng.integers(0, BLOCK_SIZE, size=num_padding))  # padding tokens: slots of the null block
    return np.asarray(slots, np.int32), real


def _expected(pool, new, slots, num_real):
    flat = pool.reshape(NUM_BLOCKS * BLOCK_SIZE, HKV, D).copy()
    flat[slots[:num_real]] = new[:num_real]
    return flat.reshape(pool.shape)


def _check_pool(got, pool, new, slots, num_real):
    got = np.asarray(got)
    expected = _expected(pool, new, slots, num_real)
    # Everything outside the null block must match exactly (written slots and untouched ones).
    np.testing.assert_array_equal(got[1:], expected[1:])
    # Null-block slots either keep their value or hold one of the padding tokens written there.
    flat_got = got.reshape(-1, HKV, D)[:BLOCK_SIZE]
    flat_old = pool.reshape(-1, HKV, D)[:BLOCK_SIZE]
    for slot in range(BLOCK_SIZE):
        candidates = [flat_old[slot]] + [new[t] for t in range(num_real, len(slots)) if slots[t] == slot]
        assert any(np.array_equal(flat_got[slot], c) for c in candidates), f"null-block slot {slot} corrupted"


def test_write_kv_lands_exactly_and_touches_nothing_else():
    rng = np.random.default_rng(0)
    k_pool, v_pool = _random_pool(rng)
    slots, num_real = _slots_for_batch(rng, kv_lens_before=[0, 5, 3], q_lens=[6, 1, 4], num_padding=3)
    k_new = rng.standard_normal((len(slots), HKV, D)).astype(np.float32)
    v_new = rng.standard_normal((len(slots), HKV, D)).astype(np.float32)
    k_out, v_out = write_kv(jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(k_new), jnp.asarray(v_new),
                            jnp.asarray(slots))
    _check_pool(k_out, k_pool, k_new, slots, num_real)
    _check_pool(v_out, v_pool, v_new, slots, num_real)


def test_write_kv_jit_with_donated_pools():
    rng = np.random.default_rng(1)
    k_pool, v_pool = _random_pool(rng)
    step = jax.jit(write_kv, donate_argnums=(0, 1))
    # Device-owned copies: an array created straight from numpy on CPU may alias host memory and not be donatable.
    k_dev, v_dev = jnp.asarray(k_pool) + 0, jnp.asarray(v_pool) + 0
    expected_k, expected_v = k_pool, v_pool
    # Two successive steps through the same compiled function (decode after prefill), pools carried over.
    for kv_before, q_lens in (([0, 0], [5, 2]), ([5, 2], [1, 1])):
        slots, num_real = _slots_for_batch(np.random.default_rng(7), kv_before, q_lens, num_padding=1)
        slots = np.concatenate([slots, np.zeros(8 - len(slots), np.int32)])  # fixed T=8: more padding
        k_new = rng.standard_normal((8, HKV, D)).astype(np.float32)
        v_new = rng.standard_normal((8, HKV, D)).astype(np.float32)
        old_k = k_dev
        k_dev, v_dev = step(k_dev, v_dev, jnp.asarray(k_new), jnp.asarray(v_new), jnp.asarray(slots))
        assert old_k.is_deleted(), "the donated pool should have been consumed"
        _check_pool(k_dev, expected_k, k_new, slots, num_real)
        _check_pool(v_dev, expected_v, v_new, slots, num_real)
        # Copies, not views: a live numpy view of a CPU buffer would block its donation in the next step.
        expected_k, expected_v = np.array(k_dev, copy=True), np.array(v_dev, copy=True)


def test_write_kv_casts_to_pool_dtype_and_drops_out_of_range_slots():
    rng = np.random.default_rng(2)
    k_pool, v_pool = _random_pool(rng)
    k_pool = jnp.asarray(k_pool, jnp.bfloat16)
    v_pool = jnp.asarray(v_pool, jnp.bfloat16)
    k_new = rng.standard_normal((2, HKV, D)).astype(np.float32)
    slots = np.array([NUM_BLOCKS * BLOCK_SIZE + 3, 9], np.int32)  # first one is out of range: dropped
    k_out, v_out = write_kv(k_pool, v_pool, jnp.asarray(k_new), jnp.asarray(k_new), jnp.asarray(slots))
    assert k_out.dtype == jnp.bfloat16 and v_out.dtype == jnp.bfloat16
    expected = np.asarray(k_pool.astype(jnp.float32)).reshape(-1, HKV, D).copy()
    expected[9] = np.asarray(jnp.asarray(k_new[1]).astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(k_out.astype(jnp.float32)).reshape(-1, HKV, D), expected)


@pytest.mark.parametrize("slot", [0, 9, NUM_BLOCKS * BLOCK_SIZE - 1, NUM_BLOCKS * BLOCK_SIZE, 10_000, -1, -5])
def test_write_kv_single_token_lands_or_goes_to_the_null_block(slot):
    """T == 1 (batch-1 decode) takes the dynamic_update_slice path: an in-range slot lands exactly; an out-of-range
    one (too large or negative) lands in null-block slot 0, never in a real block (a plain dynamic_update_slice
    would clamp it onto the last slot)."""
    rng = np.random.default_rng(3)
    k_pool, v_pool = _random_pool(rng)
    k_new = rng.standard_normal((1, HKV, D)).astype(np.float32)
    v_new = rng.standard_normal((1, HKV, D)).astype(np.float32)
    step = jax.jit(write_kv, donate_argnums=(0, 1))
    k_out, v_out = step(jnp.asarray(k_pool) + 0, jnp.asarray(v_pool) + 0, jnp.asarray(k_new), jnp.asarray(v_new),
                        jnp.asarray([slot], np.int32))
    target = slot if 0 <= slot < NUM_BLOCKS * BLOCK_SIZE else 0
    for got, pool, new in ((k_out, k_pool, k_new), (v_out, v_pool, v_new)):
        expected = pool.reshape(-1, HKV, D).copy()
        expected[target] = new[0]
        np.testing.assert_array_equal(np.asarray(got).reshape(-1, HKV, D), expected)


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(k=np.zeros((3, HKV + 1, D), np.float32)), "k must be"),
        (dict(slot_mapping=np.zeros((4,), np.int32)), "slot_mapping must be"),
        (dict(slot_mapping=np.zeros((3,), np.float32)), "slot_mapping must be an integer"),
        (dict(v_pages=np.zeros((NUM_BLOCKS, BLOCK_SIZE, HKV, D + 1), np.float32)), "v_pages shape"),
    ],
)
def test_write_kv_rejects_bad_input(bad, field):
    args = dict(
        k_pages=np.zeros((NUM_BLOCKS, BLOCK_SIZE, HKV, D), np.float32),
        v_pages=np.zeros((NUM_BLOCKS, BLOCK_SIZE, HKV, D), np.float32),
        k=np.zeros((3, HKV, D), np.float32),
        v=np.zeros((3, HKV, D), np.float32),
        slot_mapping=np.zeros((3,), np.int32),
    )
    args.update(bad)
    with pytest.raises(ValueError, match=field):
        write_kv(*(jnp.asarray(args[n]) for n in ("k_pages", "v_pages", "k", "v", "slot_mapping")))


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, jnp.float8_e4m3fn])
def test_copy_blocks_one_kernel_equals_per_pool_scatters(dtype):
    """copy_blocks: the one-launch Pallas kernel (interpret mode, pools aliased in place) = the per-pool XLA
    scatters: every layer's K and V block dst[i] becomes block src[i]; padding slots (dst = num_blocks) and
    everything else untouched."""
    from paged_jax.ops.block_copy import copy_blocks
    rng = np.random.default_rng(4)
    pools = [tuple(jnp.asarray(p, dtype) for p in _random_pool(rng)) for _ in range(3)]
    src = np.array([2, 7, 0, 0], np.int32)
    dst = np.array([9, 4, NUM_BLOCKS, NUM_BLOCKS], np.int32)  # two copies, two padding slots
    step = jax.jit(functools.partial(copy_blocks, impl="pallas", interpret=True), donate_argnums=(0,))
    got = step([(k + 0, v + 0) for k, v in pools], jnp.asarray(src), jnp.asarray(dst))
    want = copy_blocks(pools, jnp.asarray(src), jnp.asarray(dst), impl="xla")
    for (gk, gv), (wk, wv), (k, v) in zip(got, want, pools):
        for g, w, old in ((gk, wk, k), (gv, wv, v)):
            assert g.dtype == old.dtype and g.shape == old.shape
            np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)))
            expected = np.asarray(old.astype(jnp.float32)).copy()
            expected[[9, 4]] = expected[[2, 7]]
            np.testing.assert_array_equal(np.asarray(g.astype(jnp.float32)), expected)
