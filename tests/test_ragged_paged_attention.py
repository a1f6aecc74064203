"""Ragged paged attention: Pallas kernel (interpret mode) vs the jnp reference vs a dense per-sequence numpy oracle.

Every case draws a fresh random ragged batch with shuffled, non-contiguous block tables, garbage (large, non-zero)
values in pool slots no sequence owns, padded sequence slots (q_len 0, kv_len 0) and padding tokens after
``cu_q_lens[S]`` (whose outputs must be exactly zero).
"""

import functools
import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from paged_jax.ops import ragged_paged_attention
from paged_jax.ops.ragged_paged_attention.triton_kernel import default_tuning


def make_batch(seed, q_lens, kv_lens, *, hq, hkv, d, block_size, dtype, pad_seqs=2, pad_tokens=3,
               spare_blocks=5):
    """Random batch. kv_lens include the new tokens (q_len <= kv_len)."""
    rng = np.random.default_rng(seed)
    q_lens = np.asarray(list(q_lens) + [0] * pad_seqs, np.int32)
    kv_lens = np.asarray(list(kv_lens) + [0] * pad_seqs, np.int32)
    assert np.all(q_lens <= kv_lens)
    blocks_needed = -(-kv_lens // block_size)
    max_blocks = int(blocks_needed.max()) + 1  # one spare column: padded entries must be ignored
    num_blocks = 1 + int(blocks_needed.sum()) + spare_blocks
    free = rng.permutation(np.arange(1, num_blocks)).tolist()
    block_tables = np.zeros((len(q_lens), max_blocks), np.int32)  # padded entries -> null block 0
    for s, n in enumerate(blocks_needed):
        block_tables[s, :n] = [free.pop() for _ in range(n)]
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(cu_q_lens[-1]) + pad_tokens
    pool_shape = (num_blocks, block_size, hkv, d)
    # Garbage everywhere first (large values make any leak through the masks obvious), then real context.
    k_pages = 30.0 * rng.standard_normal(pool_shape)
    v_pages = 30.0 * rng.standard_normal(pool_shape)
    for s in range(len(q_lens)):
        for pos in range(kv_lens[s]):
            blk, off = block_tables[s, pos // block_size], pos % block_size
            k_pages[blk, off] = rng.standard_normal((hkv, d))
            v_pages[blk, off] = rng.standard_normal((hkv, d))
    q = rng.standard_normal((num_tokens, hq, d))
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    return dict(
        q=cast(q), k_pages=cast(k_pages), v_pages=cast(v_pages), kv_lens=jnp.asarray(kv_lens),
        block_tables=jnp.asarray(block_tables), cu_q_lens=jnp.asarray(cu_q_lens),
    )


def numpy_oracle(batch, sm_scale, sliding_window=None, logit_soft_cap=None, sinks=None, attention_chunk_size=None):
    """Dense float64 attention, one sequence at a time: gather its context, causal(+window) softmax per token
    (scores soft-capped first when ``logit_soft_cap`` is set; head h's ``sinks[h]`` one more logit without a
    value; with ``attention_chunk_size`` only the keys of the token's own chunk)."""
    q = np.asarray(batch["q"].astype(jnp.float32), np.float64)
    k_pages = np.asarray(batch["k_pages"].astype(jnp.float32), np.float64)
    v_pages = np.asarray(batch["v_pages"].astype(jnp.float32), np.float64)
    kv_lens, tables, cu = (np.asarray(batch[n]) for n in ("kv_lens", "block_tables", "cu_q_lens"))
    _, block_size, hkv, d = k_pages.shape
    hq = q.shape[1]
    group = hq // hkv
    out = np.zeros_like(q)
    for s in range(len(kv_lens)):
        q_len = cu[s + 1] - cu[s]
        if q_len == 0:
            continue
        ctx = kv_lens[s]
        pos_idx = np.arange(ctx)
        k = k_pages[tables[s, pos_idx // block_size], pos_idx % block_size]  # [ctx, hkv, d]
        v = v_pages[tables[s, pos_idx // block_size], pos_idx % block_size]
        for i in range(q_len):
            t = cu[s] + i
            pos = ctx - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - sliding_window + 1)
            if attention_chunk_size is not None:
                lo = pos // attention_chunk_size * attention_chunk_size
            for h in range(hq):
                kh = k[lo : pos + 1, h // group]
                vh = v[lo : pos + 1, h // group]
                scores = kh @ q[t, h] * sm_scale
                if logit_soft_cap is not None:
                    scores = logit_soft_cap * np.tanh(scores / logit_soft_cap)
                sink = -np.inf if sinks is None else float(sinks[h])
                top = max(scores.max(), sink)
                w = np.exp(scores - top)
                out[t, h] = (w / (w.sum() + np.exp(sink - top))) @ vh
    return out


@functools.cache
def _jitted(impl, sm_scale, sliding_window, logit_soft_cap, attention_chunk_size, tuning: tuple):
    """One jitted function per static configuration: a test that runs a configuration another test ran on batches
    of the same shapes (the reference, mostly) reuses its executable instead of tracing and compiling it again (CI
    time: the kernels run interpreted)."""
    return jax.jit(
        lambda q, kp, vp, kl, bt, cu, sinks: ragged_paged_attention(
            q, kp, vp, kl, bt, cu, sm_scale=sm_scale, sliding_window=sliding_window, logit_soft_cap=logit_soft_cap,
            sinks=sinks, attention_chunk_size=attention_chunk_size, impl=impl, interpret=(impl == "triton"),
            **dict(tuning),
        )
    )


def run(batch, impl, sm_scale, sliding_window=None, logit_soft_cap=None, sinks=None, attention_chunk_size=None,
        **tuning):
    fn = _jitted(impl, sm_scale, sliding_window, logit_soft_cap, attention_chunk_size, tuple(sorted(tuning.items())))
    return fn(batch["q"], batch["k_pages"], batch["v_pages"], batch["kv_lens"], batch["block_tables"],
              batch["cu_q_lens"], sinks)


# name: (q_lens, kv_lens, hq, hkv, d, block_size, dtype, sliding_window, kernel tuning)
CASES = {
    "decode_only_gqa4_d64": ([1, 1, 1, 1], [5, 16, 33, 70], 8, 2, 64, 16, jnp.float32, None, dict(block_k=16)),
    "decode_splits_gqa4": ([1, 1], [90, 7], 8, 2, 64, 16, jnp.float32, None, dict(block_k=16, num_kv_splits=3)),
    "prefill_only_gqa1_d64": ([20, 7], [20, 7], 4, 4, 64, 16, jnp.float32, None, dict(block_k=16)),
    "mixed_gqa8_d64": ([1, 12, 1, 6], [40, 12, 17, 50], 16, 2, 64, 16, jnp.float32, None, dict(block_k=16)),
    "chunked_prefill_over_prefix_d128": ([10, 1], [58, 3], 8, 2, 128, 16, jnp.float32, None,
                                         dict(block_k=16, block_q=4)),
    "block_boundaries": ([1, 16, 3], [16, 32, 48], 8, 2, 64, 16, jnp.float32, None, dict(block_k=16)),
    "one_token_sequences": ([1, 1, 1], [1, 1, 2], 8, 2, 64, 16, jnp.float32, None, dict(block_k=16)),
    "block_size_32_bk16_splits": ([5, 1], [45, 64], 4, 1, 64, 32, jnp.float32, None,
                                  dict(block_k=16, num_kv_splits=2)),
    "sliding_window_8": ([9, 1, 1], [40, 30, 5], 8, 2, 64, 16, jnp.float32, 8, dict(block_k=16)),
    "sliding_window_20_splits": ([1, 6], [70, 33], 8, 2, 64, 16, jnp.float32, 20,
                                 dict(block_k=16, num_kv_splits=2)),
    "bf16_mixed_gqa4_d128": ([1, 9, 1], [33, 9, 64], 8, 2, 128, 16, jnp.bfloat16, None, dict(block_k=16)),
    "bf16_default_tuning": ([1, 7], [20, 40], 8, 2, 64, 16, jnp.bfloat16, None, {}),
    "window_lead_and_trail_splits": ([3, 1, 12], [50, 70, 12], 8, 2, 64, 16, jnp.float32, 20,
                                     dict(block_k=16, num_kv_splits=2)),
    "gqa3_block_size_8": ([1, 9], [77, 9], 9, 3, 64, 8, jnp.float32, None, dict(block_k=16)),
    # 70-token chunk over a 30-token prefix + a decode: 32-key blocks span two pages; one kv split so that one
    # program walks several unmasked and several masked blocks (2 masked for the first tile, 2 unmasked for the last).
    "chunk_bk32_two_pages_per_block": ([70, 1], [100, 40], 8, 2, 64, 16, jnp.bfloat16, None,
                                       dict(block_q=16, block_k=32, num_kv_splits=1)),
}
FP32_TOL = 1e-5
BF16_TOL = 2e-2


def _assert_close(got, want, dtype, n_real):
    got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
    want = np.asarray(jnp.asarray(want).astype(jnp.float32), np.float64)
    tol = FP32_TOL if dtype == jnp.float32 else BF16_TOL
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[:n_real], want[:n_real], atol=tol, rtol=tol)
    np.testing.assert_array_equal(got[n_real:], 0.0)  # padding tokens come out as exact zeros


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_numpy_oracle(name):
    q_lens, kv_lens, hq, hkv, d, bs, dtype, window, _ = CASES[name]
    batch = make_batch(zlib.crc32(name.encode()), q_lens, kv_lens, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    got = run(batch, "reference", scale, window)
    assert got.shape == batch["q"].shape and got.dtype == dtype
    _assert_close(got, numpy_oracle(batch, scale, window), dtype, int(batch["cu_q_lens"][-1]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(name):
    q_lens, kv_lens, hq, hkv, d, bs, dtype, window, tuning = CASES[name]
    batch = make_batch(1 + zlib.crc32(name.encode()), q_lens, kv_lens, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    got = run(batch, "triton", scale, window, **tuning)
    want = run(batch, "reference", scale, window)
    assert got.shape == batch["q"].shape and got.dtype == dtype
    _assert_close(got, want, dtype, int(batch["cu_q_lens"][-1]))


PREFILL_OPTIONS = ("kv_heads_inner", "longest_tiles_first", "prefetch_pages", "prescale_q", "k_transposed",
                   "zero_padding_in_kernel")
# Each option alone: several pages per key block and several unmasked and masked blocks per tile (bf16), masked
# lead + trail blocks with kv splits and a sliding window (fp32, tight tolerance).
OPTION_CASES = ("chunk_bk32_two_pages_per_block", "window_lead_and_trail_splits")
# All options together on the remaining shape families (interpret mode is slow: a subset, not every case).
ALL_OPTIONS_CASES = ("chunked_prefill_over_prefix_d128", "mixed_gqa8_d64", "decode_splits_gqa4", "sliding_window_8",
                     "gqa3_block_size_8", "bf16_default_tuning", "chunk_bk32_two_pages_per_block")


def _kernel_vs_reference(name, seed_offset, **extra_tuning):
    q_lens, kv_lens, hq, hkv, d, bs, dtype, window, tuning = CASES[name]
    batch = make_batch(seed_offset + zlib.crc32(name.encode()), q_lens, kv_lens, hq=hq, hkv=hkv, d=d, block_size=bs,
                       dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    got = run(batch, "triton", scale, window, **tuning, **extra_tuning)
    want = run(batch, "reference", scale, window)
    assert got.shape == batch["q"].shape and got.dtype == dtype
    _assert_close(got, want, dtype, int(batch["cu_q_lens"][-1]))


@pytest.mark.parametrize("option", PREFILL_OPTIONS)
@pytest.mark.parametrize("name", OPTION_CASES)
def test_kernel_prefill_option_matches_reference(name, option):
    _kernel_vs_reference(name, 7, **{option: True})


@pytest.mark.parametrize("name", ALL_OPTIONS_CASES)
def test_kernel_all_prefill_options_match_reference(name):
    _kernel_vs_reference(name, 11, **{option: True for option in PREFILL_OPTIONS})


# Logit soft-capping (Gemma 2): cases of CASES with a cap small enough that tanh bends most scores (q . k / sqrt(d)
# is about N(0, 1) here), alone, with a window, kv splits, bf16, and under the kernel's prefill options.
SOFT_CAP = 0.7
SOFT_CAP_CASES = ("mixed_gqa8_d64", "window_lead_and_trail_splits", "decode_splits_gqa4", "bf16_mixed_gqa4_d128",
                  "one_token_sequences", "chunk_bk32_two_pages_per_block")


@pytest.mark.parametrize("name", SOFT_CAP_CASES)
def test_soft_cap_reference_and_kernel(name):
    q_lens, kv_lens, hq, hkv, d, bs, dtype, window, tuning = CASES[name]
    batch = make_batch(3 + zlib.crc32(name.encode()), q_lens, kv_lens, hq=hq, hkv=hkv, d=d, block_size=bs,
                       dtype=dtype)
    scale, n_real = 1.0 / math.sqrt(d), int(batch["cu_q_lens"][-1])
    want = run(batch, "reference", scale, window, SOFT_CAP)
    _assert_close(want, numpy_oracle(batch, scale, window, SOFT_CAP), dtype, n_real)
    _assert_close(run(batch, "triton", scale, window, SOFT_CAP, **tuning), want, dtype, n_real)
    # The cap changes the result, so the comparisons above exercise it.
    uncapped = np.asarray(run(batch, "reference", scale, window).astype(jnp.float32))
    assert np.abs(uncapped[:n_real] - np.asarray(want.astype(jnp.float32))[:n_real]).max() > 0.05


def test_soft_cap_kernel_with_prefill_options():
    options = dict(prescale_q=True, k_transposed=True, longest_tiles_first=True)
    q_lens, kv_lens, hq, hkv, d, bs, dtype, window, tuning = CASES["window_lead_and_trail_splits"]
    batch = make_batch(17, q_lens, kv_lens, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype)
    scale = 1.0 / math.sqrt(d)
    _assert_close(run(batch, "triton", scale, window, SOFT_CAP, **tuning, **options),
                  run(batch, "reference", scale, window, SOFT_CAP), dtype, int(batch["cu_q_lens"][-1]))


# Attention sinks (gpt-oss): one logit per query head in the softmax's denominator, large enough to take a visible
# share (scores are about N(0, 1)), with windows, kv splits (the sink joins split 0 only), bf16 and prefill options.
SINK_CASES = ("mixed_gqa8_d64", "window_lead_and_trail_splits", "decode_splits_gqa4", "bf16_mixed_gqa4_d128",
              "one_token_sequences", "sliding_window_8", "block_size_32_bk16_splits")


@pytest.mark.parametrize("name", SINK_CASES)
def test_sinks_reference_and_kernel(name):
    q_lens, kv_lens, hq, hkv, d, bs, dtype, window, tuning = CASES[name]
    seed = 5 + zlib.crc32(name.encode())
    batch = make_batch(seed, q_lens, kv_lens, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype)
    sinks = jnp.asarray(np.random.default_rng(seed).normal(1.0, 1.5, hq), dtype)
    scale, n_real = 1.0 / math.sqrt(d), int(batch["cu_q_lens"][-1])
    want = run(batch, "reference", scale, window, sinks=sinks)
    _assert_close(want, numpy_oracle(batch, scale, window, sinks=np.asarray(sinks.astype(jnp.float32))), dtype,
                  n_real)
    _assert_close(run(batch, "triton", scale, window, sinks=sinks, **tuning), want, dtype, n_real)
    without = np.asarray(run(batch, "reference", scale, window).astype(jnp.float32))
    assert np.abs(without[:n_real] - np.asarray(want.astype(jnp.float32))[:n_real]).max() > 0.05


def test_sinks_kernel_with_prefill_options_and_soft_cap():
    options = dict(prescale_q=True, k_transposed=True, longest_tiles_first=True, prefetch_pages=True)
    q_lens, kv_lens, hq, hkv, d, bs, dtype, window, tuning = CASES["window_lead_and_trail_splits"]
    batch = make_batch(23, q_lens, kv_lens, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype)
    sinks = jnp.asarray(np.random.default_rng(23).normal(0.0, 2.0, hq), jnp.float32)
    scale = 1.0 / math.sqrt(d)
    _assert_close(run(batch, "triton", scale, window, SOFT_CAP, sinks, **tuning, **options),
                  run(batch, "reference", scale, window, SOFT_CAP, sinks), dtype, int(batch["cu_q_lens"][-1]))


def test_sinks_keep_auto_off_the_mosaic_kernel_and_mosaic_refuses_them():
    from paged_jax.ops.ragged_paged_attention import choose_impl
    from paged_jax.ops.ragged_paged_attention.mgpu_kernel import supported

    assert supported((2048, 8, 64), (64, 16, 2, 64), jnp.bfloat16, None, has_sinks=True) == "attention sinks"
    assert choose_impl((2048, 8, 64), (64, 16, 2, 64), jnp.bfloat16, 8, has_sinks=True) != "hybrid"
    batch = make_batch(1, [3], [5], hq=4, hkv=2, d=64, block_size=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="impl='mosaic' does not take attention sinks"):
        run(batch, "mosaic", 0.125, sinks=jnp.zeros((4,), jnp.float32))
    with pytest.raises(ValueError, match=r"sinks must be a float \[Hq=4\]"):
        run(batch, "reference", 0.125, sinks=jnp.zeros((3,), jnp.float32))


# Chunked local attention (Llama 4): chunks smaller and larger than a block and than the kernel's key blocks, queries
# whose tile spans a chunk edge (chunked prefill), decodes just after an edge, kv splits, bf16, prefill options.
CHUNK_CASES = {"mixed_gqa8_d64": 8, "chunked_prefill_over_prefix_d128": 24, "window_lead_and_trail_splits": 16,
               "decode_splits_gqa4": 32, "bf16_mixed_gqa4_d128": 20, "block_boundaries": 16,
               "gqa3_block_size_8": 13, "chunk_bk32_two_pages_per_block": 48}


def _drop_blocks_before_chunk(batch, chunk: int):
    """The batch with each sequence's table entries of blocks wholly before its first query's chunk pointed at the
    null block 0 (garbage there), as the KV-cache manager frees them for a chunked group."""
    tables = np.asarray(batch["block_tables"]).copy()
    kv_lens, cu = np.asarray(batch["kv_lens"]), np.asarray(batch["cu_q_lens"])
    block_size = batch["k_pages"].shape[1]
    for s in range(len(kv_lens)):
        first_pos = kv_lens[s] - (cu[s + 1] - cu[s])
        tables[s, :first_pos // chunk * chunk // block_size] = 0
    return {**batch, "block_tables": jnp.asarray(tables)}


@pytest.mark.parametrize("name", sorted(CHUNK_CASES))
def test_attention_chunks_reference_and_kernel(name):
    q_lens, kv_lens, hq, hkv, d, bs, dtype, window, tuning = CASES[name]
    chunk = CHUNK_CASES[name]
    batch = make_batch(zlib.crc32(name.encode()) + 3, q_lens, kv_lens, hq=hq, hkv=hkv, d=d, block_size=bs,
                       dtype=dtype)
    scale, n_real = 1.0 / math.sqrt(d), int(batch["cu_q_lens"][-1])
    want = run(batch, "reference", scale, attention_chunk_size=chunk)
    _assert_close(want, numpy_oracle(batch, scale, attention_chunk_size=chunk), dtype, n_real)
    _assert_close(run(batch, "triton", scale, attention_chunk_size=chunk, **tuning), want, dtype, n_real)
    freed = _drop_blocks_before_chunk(batch, chunk)
    _assert_close(run(freed, "reference", scale, attention_chunk_size=chunk), want, dtype, n_real)
    _assert_close(run(freed, "triton", scale, attention_chunk_size=chunk, **tuning), want, dtype, n_real)
    if name == "window_lead_and_trail_splits":  # with every prefill option of the kernel
        options = dict(kv_heads_inner=True, longest_tiles_first=True, prefetch_pages=True, k_transposed=True)
        _assert_close(run(freed, "triton", scale, attention_chunk_size=chunk, **tuning, **options), want, dtype,
                      n_real)
    unchunked = np.asarray(run(batch, "reference", scale).astype(jnp.float32))
    assert np.abs(np.asarray(want.astype(jnp.float32)) - unchunked).max() > 0.05  # the chunks matter here


def test_attention_chunks_keep_auto_off_the_mosaic_kernel_and_mosaic_refuses_them():
    from paged_jax.ops.ragged_paged_attention import choose_impl
    from paged_jax.ops.ragged_paged_attention.mgpu_kernel import supported

    assert "attention_chunk_size" in supported((2048, 8, 64), (64, 16, 2, 64), jnp.bfloat16, None,
                                               attention_chunk_size=64)
    assert choose_impl((2048, 8, 64), (64, 16, 2, 64), jnp.bfloat16, 8, attention_chunk_size=64) != "hybrid"
    batch = make_batch(2, [3], [5], hq=4, hkv=2, d=64, block_size=16, dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="impl='mosaic' does not take chunked local attention"):
        run(batch, "mosaic", 0.125, attention_chunk_size=8)


def test_longest_tiles_first_orders_by_key_count():
    from paged_jax.ops.ragged_paged_attention.common import sort_tiles_longest_first, tile_map

    # Sequences: 10-token prefill, 1 decode at context 50, 7-token chunk over a 30-token prefix, one empty slot.
    q_lens, kv_lens, block_q = np.array([10, 1, 7, 0]), np.array([10, 51, 37, 0]), 4
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    num_tiles = 8  # 3 + 1 + 2 real tiles, 2 empty
    tile_seq, tile_start = tile_map(cu, num_tiles, block_q)
    seq, start = sort_tiles_longest_first(tile_seq, tile_start, cu, jnp.asarray(kv_lens, jnp.int32), block_q, None)
    seq, start = np.asarray(seq), np.asarray(start)
    # Same set of tiles, empty ones (sequence index S=4) last.
    assert sorted(zip(seq.tolist(), start.tolist())) == sorted(zip(np.asarray(tile_seq).tolist(),
                                                                   np.asarray(tile_start).tolist()))
    assert seq[-2:].tolist() == [4, 4]
    # Keys read per real tile (pos_last + 1): decode 51, chunk tiles 37 and 34, prefill tiles 10, 8, 4.
    assert list(zip(seq[:6].tolist(), start[:6].tolist())) == [(1, 10), (2, 15), (2, 11), (0, 8), (0, 4), (0, 0)]
    # With a sliding window of 5 the cap (window + block_q - 1 = 8) makes the long tiles tie; ties keep map order.
    seq_w, _ = sort_tiles_longest_first(tile_seq, tile_start, cu, jnp.asarray(kv_lens, jnp.int32), block_q, 5)
    assert np.asarray(seq_w)[:6].tolist() == [0, 0, 1, 2, 2, 0]


def test_kernel_one_compilation_serves_new_values():
    """Same static shapes, different ragged layouts and tables: one jitted kernel, both correct."""
    scale = 0.125
    fn = jax.jit(lambda q, kp, vp, kl, bt, cu: ragged_paged_attention(
        q, kp, vp, kl, bt, cu, sm_scale=scale, impl="triton", interpret=True, block_k=16))
    # Both batches: 3 sequence slots, 12 tokens, max_blocks 5, 13 pool blocks.
    layouts = [([1, 8, 1], [30, 8, 60]), ([6, 3, 1], [6, 40, 59])]
    for seed, (q_lens, kv_lens) in enumerate(layouts):
        batch = make_batch(100 + seed, q_lens, kv_lens, hq=8, hkv=2, d=64, block_size=16, dtype=jnp.float32,
                           pad_seqs=0, pad_tokens=12 - sum(q_lens), spare_blocks=13 - 1 - sum(-(-k // 16)
                                                                                             for k in kv_lens))
        assert batch["q"].shape[0] == 12 and batch["k_pages"].shape[0] == 13
        assert batch["block_tables"].shape == (3, 5)
        got = fn(batch["q"], batch["k_pages"], batch["v_pages"], batch["kv_lens"], batch["block_tables"],
                 batch["cu_q_lens"])
        _assert_close(got, numpy_oracle(batch, scale), jnp.float32, sum(q_lens))
    assert fn._cache_size() == 1


def test_auto_uses_reference_on_cpu():
    batch = make_batch(3, [2, 1], [5, 9], hq=4, hkv=2, d=64, block_size=16, dtype=jnp.float32)
    auto = run(batch, "auto", 0.1)
    ref = run(batch, "reference", 0.1)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(ref))


def test_default_tuning_shapes():
    decode = default_tuning(256, 256, 32, 8, 128, 16)
    assert decode["rows"] == 16 and decode["block_q"] == 4 and decode["num_kv_splits"] == 1
    single = default_tuning(1, 1, 32, 8, 2048, 16)
    assert single["num_tiles"] == 1 and single["num_kv_splits"] > 1  # flash-decoding fills the GPU
    prefill = default_tuning(4096, 1, 32, 8, 256, 16)
    assert prefill["rows"] >= 64 and prefill["num_kv_splits"] == 1
    gqa3 = default_tuning(8, 8, 9, 3, 4, 16)
    assert gqa3["rows"] == 16 and gqa3["block_q"] * 3 <= 16


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(q=jnp.zeros((4, 5, 64))), "multiple of"),
        (dict(kv_lens=jnp.zeros((3,), jnp.int32)), "kv_lens must be"),
        (dict(cu_q_lens=jnp.zeros((2,), jnp.int32)), "cu_q_lens must be"),
        (dict(block_tables=jnp.zeros((2, 3), jnp.float32)), "block_tables must be an integer"),
        (dict(v_pages=jnp.zeros((5, 16, 4, 64))), "v_pages shape"),
        (dict(impl="cuda"), "impl must be"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(logit_soft_cap=0.0), "logit_soft_cap"),
        (dict(attention_chunk_size=0), "attention_chunk_size"),
        (dict(block_m=16), "unknown tuning"),
    ],
)
def test_bad_input_raises(change, message):
    args = dict(q=jnp.zeros((4, 8, 64)), k_pages=jnp.zeros((5, 16, 2, 64)), v_pages=jnp.zeros((5, 16, 2, 64)),
                kv_lens=jnp.zeros((2,), jnp.int32), block_tables=jnp.zeros((2, 3), jnp.int32),
                cu_q_lens=jnp.zeros((3,), jnp.int32))
    kwargs = dict(sm_scale=0.1)
    for k, v in change.items():
        (args if k in args else kwargs)[k] = v
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(*args.values(), **kwargs)


def test_deprecated_pallas_name_runs_the_triton_kernel():
    from paged_jax.config import EngineArgs

    batch = make_batch(4, [3, 1], [7, 20], hq=4, hkv=2, d=64, block_size=16, dtype=jnp.float32)
    want = ragged_paged_attention(*batch.values(), sm_scale=0.1, impl="triton", interpret=True, block_k=16)
    with pytest.warns(FutureWarning, match="'triton'"):
        got = ragged_paged_attention(*batch.values(), sm_scale=0.1, impl="pallas", interpret=True, block_k=16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.warns(FutureWarning, match="attention_impl='pallas'"):
        assert EngineArgs(attention_impl="pallas").attention_impl == "triton"
    with pytest.raises(ValueError, match="attention_impl must be one of auto, reference, triton, mosaic"):
        EngineArgs(attention_impl="flash")


@pytest.mark.parametrize("num_splits, num_tokens, num_real, hq, d", [(33, 1, 1, 4, 16), (3, 5, 3, 2, 32)])
def test_combine_kernel_matches_jnp_combine(num_splits, num_tokens, num_real, hq, d):
    """The one-kernel split combine (interpret mode) = the jnp form: empty splits (m = MASK_VALUE, l = 0, acc = 0),
    a non-power-of-two split count, rows of padding tokens holding NaN garbage (must come out as exact zeros)."""
    from paged_jax.ops.ragged_paged_attention.combine import combine_kv_splits, combine_kv_splits_reference
    from paged_jax.ops.ragged_paged_attention.common import MASK_VALUE
    rng = np.random.default_rng(num_splits)
    rows = num_tokens * hq
    acc = rng.standard_normal((num_splits, rows, d)).astype(np.float32)
    m = (3.0 * rng.standard_normal((num_splits, rows))).astype(np.float32)
    l = rng.uniform(0.5, 4.0, (num_splits, rows)).astype(np.float32)
    empty = rng.random((num_splits, rows)) < 0.3
    empty[:, 0] = True  # a row whose splits are all empty: zero output, no NaN
    m[empty], l[empty], acc[empty] = MASK_VALUE, 0.0, 0.0
    acc[:, num_real * hq:], m[:, num_real * hq:], l[:, num_real * hq:] = np.nan, np.nan, np.nan
    cu_q_lens = jnp.asarray([0, num_real], jnp.int32)
    args = (jnp.asarray(acc), jnp.asarray(m), jnp.asarray(l), cu_q_lens, hq, jnp.float32)
    got = np.asarray(combine_kv_splits(*args, interpret=True))
    want = np.asarray(combine_kv_splits_reference(*args))
    assert got.shape == (rows, d)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(got[0], 0.0)
    np.testing.assert_array_equal(got[num_real * hq:], 0.0)


def test_mosaic_refuses_an_fp8_pool():
    batch = make_batch(2, [3], [5], hq=4, hkv=2, d=64, block_size=16, dtype=jnp.bfloat16)
    batch = {**batch, "k_pages": batch["k_pages"].astype(jnp.float8_e4m3fn),
             "v_pages": batch["v_pages"].astype(jnp.float8_e4m3fn)}
    with pytest.raises(ValueError, match="impl='mosaic' does not read an FP8 KV pool"):
        run(batch, "mosaic", 0.125)
