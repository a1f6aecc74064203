"""The Mosaic GPU (Hopper) prefill kernel, run by Pallas' Mosaic GPU interpreter on CPU, vs a float64 oracle.

The interpreter runs the kernel's three warpgroups as threads with real barrier semantics (it fails on a barrier
phase that a thread never observes), so the TMA / ready / free / schedule protocol is checked here too; the dots are
plain ``jnp.dot`` under the interpreter (its wgmma has no transposed operand), the GPU runs ``wgmma``
(``benchmarks/kernels.py --sections check_mosaic`` checks that path on the H200). Interpretation is slow: few,
small cases, each chosen to cover several edge cases at once.
"""

import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ragged_paged_attention import make_batch, numpy_oracle


from paged_jax.ops import ragged_paged_attention
from paged_jax.ops.ragged_paged_attention import mgpu_kernel
from paged_jax.ops.ragged_paged_attention.common import tile_map

# The package (paged_jax.ops re-exports its function under the same name).
rpa = importlib.import_module("paged_jax.ops.ragged_paged_attention")

pytestmark = pytest.mark.skipif(mgpu_kernel.plgpu is None, reason="no Mosaic GPU Pallas in this jax")

# name: (q_lens, kv_lens, hq, hkv, d, block_size, dtype, tuning). The persistent grid's cost in the interpreter is
# mostly per program (each runs its three warpgroups as threads), so every case names a small ``num_programs``.
CASES = {
    # 130-token prompt: two 128-token tiles, the second with 2 valid rows (its second warpgroup has none); a
    # 1-token chunk over a 700-token prefix (11 key steps, the last partly past the context); a 60-token prompt
    # (one tile, the second warpgroup empty); padding tokens and padded sequence slots; GQA 2, d 64, 16-token
    # pages (4 TMA page copies per 64-key step). One program takes all 8 work items: the K/V ring runs on across
    # items of different step counts.
    "ragged_gqa2_d64_bs16": ([130, 1, 60], [130, 700, 60], 4, 2, 64, 16, jnp.bfloat16,
                             dict(block_kv=64, num_programs=1)),
    # A 67-token chunk over a 253-token prefix (keys end mid-page), a 3-token prompt; GQA 1, d 128, fp16, 32-token
    # pages (4 per 128-key step); T not a multiple of 8 (the wrapper pads it for the TMA boxes). 4 work items on
    # 2 programs: several items per program, the output buffer reused after its stores.
    "chunked_gqa1_d128_fp16_bs32": ([67, 3], [320, 3], 2, 2, 128, 32, jnp.float16, dict(num_programs=2)),
    # GQA 4 (four query heads read one kv head's pages), a sequence starting mid 8-row group (token 9), 3 ring
    # slots with 64-key steps over a 250-token context; 8 items on 2 programs.
    "gqa4_three_stages": ([9, 70], [9, 250], 4, 1, 64, 16, jnp.bfloat16,
                          dict(block_kv=64, num_stages=3, num_programs=2)),
    # GQA 8, 1-token sequences beside a long one, tiles in map order (no sort): 32 items on 3 programs.
    "gqa8_one_token_rows": ([1, 1, 200, 1], [33, 1, 300, 64], 8, 1, 64, 16, jnp.bfloat16,
                            dict(block_kv=64, num_programs=3, longest_tiles_first=False)),
}


def _run(batch, sm_scale, **tuning):
    fn = jax.jit(lambda q, kp, vp, kl, bt, cu: ragged_paged_attention(
        q, kp, vp, kl, bt, cu, sm_scale=sm_scale, impl="mosaic", interpret=True, **tuning))
    return fn(batch["q"], batch["k_pages"], batch["v_pages"], batch["kv_lens"], batch["block_tables"],
              batch["cu_q_lens"])


# Interpretation of the Mosaic kernel is slow: the larger cases run with `make test-all` (marker `slow`); CI runs the
# chunked fp16 case, which goes through the same tiles, pages and ring (and the hybrid test below).
_SLOW_CASES = {"ragged_gqa2_d64_bs16", "gqa4_three_stages", "gqa8_one_token_rows"}


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name in _SLOW_CASES else name
                                  for name in sorted(CASES)])
def test_mosaic_kernel_matches_oracle(name):
    q_lens, kv_lens, hq, hkv, d, bs, dtype, tuning = CASES[name]
    batch = make_batch(sum(map(ord, name)), q_lens, kv_lens, hq=hq, hkv=hkv, d=d, block_size=bs, dtype=dtype,
                       pad_seqs=1, pad_tokens=5)
    sm_scale = 1.0 / math.sqrt(d)
    got = np.asarray(_run(batch, sm_scale, **tuning).astype(jnp.float32), np.float64)
    want = numpy_oracle(batch, sm_scale)
    n_real = int(batch["cu_q_lens"][-1])
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[:n_real], want[:n_real], atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(got[n_real:], 0.0)  # padding tokens: exact zeros


def test_supported_and_tuning_errors():
    assert mgpu_kernel.supported((256, 8, 128), (10, 16, 2, 128), jnp.bfloat16, None) is None
    assert "sliding window" in mgpu_kernel.supported((256, 8, 128), (10, 16, 2, 128), jnp.bfloat16, 64)
    assert "head_dim" in mgpu_kernel.supported((256, 8, 96), (10, 16, 2, 96), jnp.bfloat16, None)
    assert "dtype" in mgpu_kernel.supported((256, 8, 128), (10, 16, 2, 128), jnp.float32, None)
    assert "KV pool dtype" in mgpu_kernel.supported((256, 8, 128), (10, 16, 2, 128), jnp.bfloat16, None, jnp.float16)
    assert "block_size" in mgpu_kernel.supported((256, 8, 128), (10, 12, 2, 128), jnp.bfloat16, None)
    assert "soft-capping" in mgpu_kernel.supported((256, 8, 128), (10, 16, 2, 128), jnp.bfloat16, None,
                                                   logit_soft_cap=50.0)
    with pytest.raises(ValueError, match="block_q"):
        mgpu_kernel.default_tuning(128, 16, block_q=32)
    with pytest.raises(ValueError, match="block_kv"):
        mgpu_kernel.default_tuning(128, 16, block_kv=96)
    batch = make_batch(1, [8], [8], hq=2, hkv=1, d=64, block_size=16, dtype=jnp.float32)
    with pytest.raises(ValueError, match="does not handle"):  # fp32: the kernel is bf16/fp16 only
        _run(batch, 0.125)
    with pytest.raises(ValueError, match="unknown tuning"):  # a Triton knob given to the Mosaic kernel
        _run(dict(batch, q=batch["q"].astype(jnp.bfloat16)), 0.125, num_warps=4)


def test_auto_dispatch(monkeypatch):
    q_shape, pool_shape = (4096, 32, 128), (300, 16, 8, 128)
    # CPU: the reference, whatever the shape.
    assert rpa.choose_impl(q_shape, pool_shape, jnp.bfloat16, num_seqs=4) == "reference"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(rpa, "_is_hopper", lambda: True)
    # Hopper: the hybrid path for calls of >= MOSAIC_MIN_TOKENS tokens, whatever the sequence slots (the engine's
    # prefill buckets: 2048 or 4096 tokens x 256 slots), the Triton kernel below.
    assert rpa.MOSAIC_MIN_TOKENS == 1024
    assert rpa.choose_impl(q_shape, pool_shape, jnp.bfloat16, num_seqs=4) == "hybrid"
    assert rpa.choose_impl(q_shape, pool_shape, jnp.bfloat16, num_seqs=256) == "hybrid"
    assert rpa.choose_impl((2048, 32, 128), pool_shape, jnp.bfloat16, num_seqs=256) == "hybrid"
    assert rpa.choose_impl((1024, 32, 128), pool_shape, jnp.bfloat16, num_seqs=256) == "hybrid"
    assert rpa.choose_impl((512, 32, 128), pool_shape, jnp.bfloat16, num_seqs=1) == "triton"
    assert rpa.choose_impl((256, 32, 128), pool_shape, jnp.bfloat16, num_seqs=256) == "triton"  # decode bucket
    # What the Mosaic kernel does not support stays on the Triton kernel alone.
    assert rpa.choose_impl(q_shape, pool_shape, jnp.bfloat16, num_seqs=4, sliding_window=512) == "triton"
    assert rpa.choose_impl(q_shape, pool_shape, jnp.bfloat16, num_seqs=4, logit_soft_cap=50.0) == "triton"
    assert rpa.choose_impl(q_shape, pool_shape, jnp.float32, num_seqs=4) == "triton"
    assert rpa.choose_impl((4096, 32, 256), (300, 16, 8, 256), jnp.bfloat16, num_seqs=4) == "triton"
    # Another GPU generation: the Triton kernel.
    monkeypatch.setattr(rpa, "_is_hopper", lambda: False)
    assert rpa.choose_impl(q_shape, pool_shape, jnp.bfloat16, num_seqs=4) == "triton"


def test_auto_runs_hybrid_split_on_hopper(monkeypatch):
    """``impl="auto"`` on a (simulated) Hopper bucket runs the hybrid path, split at ``min_q_len`` = 16: the 16-token
    chunk on the Mosaic kernel, written in place into the Triton kernel's output, which holds the decode rows, the
    15-token prompt, a 0-token slot and the padding zeros; one query head, padded sequence slots. The Mosaic part's
    one work item on 2 persistent programs: one program gets no item. An FP8 pool (or a pool of another 16-bit
    dtype) in the same call shape goes to the Triton kernel alone (traced, not run)."""
    from paged_jax.ops.ragged_paged_attention import hybrid

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(rpa, "_is_hopper", lambda: True)
    monkeypatch.setattr(rpa, "MOSAIC_MIN_TOKENS", 16)
    monkeypatch.setattr(hybrid, "MOSAIC_MIN_Q_LEN", 16)
    monkeypatch.setattr(mgpu_kernel, "default_num_programs", lambda: 2)
    mosaic_calls = []

    def spy(*args, **kwargs):
        mosaic_calls.append(kwargs)
        return mgpu_kernel.ragged_paged_attention_mgpu(*args, **kwargs)

    monkeypatch.setattr(hybrid, "ragged_paged_attention_mgpu", spy)
    batch = make_batch(5, [1, 16, 15, 0, 1], [50, 100, 15, 7, 20], hq=1, hkv=1, d=64, block_size=16,
                       dtype=jnp.bfloat16, pad_seqs=3, pad_tokens=5)
    assert rpa.choose_impl(batch["q"].shape, batch["k_pages"].shape, jnp.bfloat16, 8) == "hybrid"
    assert rpa.choose_impl(batch["q"].shape, batch["k_pages"].shape, jnp.bfloat16, 8, kv_dtype=jnp.float16) == "triton"
    sm_scale = 0.125
    fn = jax.jit(lambda q, kp, vp, kl, bt, cu: ragged_paged_attention(
        q, kp, vp, kl, bt, cu, sm_scale=sm_scale, impl="auto", interpret=True))
    args = [batch[k] for k in ("q", "k_pages", "v_pages", "kv_lens", "block_tables", "cu_q_lens")]
    got = np.asarray(fn(*args).astype(jnp.float32), np.float64)
    want = numpy_oracle(batch, sm_scale)
    n_real = int(batch["cu_q_lens"][-1])
    np.testing.assert_allclose(got[:n_real], want[:n_real], atol=2e-2, rtol=2e-2)
    np.testing.assert_array_equal(got[n_real:], 0.0)
    assert [(c["min_q_len"], c["out"] is not None) for c in mosaic_calls] == [(16, True)]

    fp8 = [args[0], args[1].astype(jnp.float8_e4m3fn), args[2].astype(jnp.float8_e4m3fn), *args[3:]]
    jax.eval_shape(fn, *fp8)  # the dispatch happens while tracing: no Mosaic call for an FP8 pool
    assert len(mosaic_calls) == 1


def test_tile_map_aligned_and_covering():
    """Every tile's first row is a multiple of 8 (the TMA q box must not start mid-tile on the GPU) and the tiles of
    each sequence cover its tokens exactly once; tiles past the real ones are marked empty (sequence S)."""
    q_lens = np.array([130, 1, 0, 60, 300, 7], np.int32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    num_tokens, num_seqs, tile = int(cu[-1]) + 5, len(q_lens), 128
    num_tiles = (num_tokens + 7 * num_seqs) // tile + num_seqs
    tile_seq, tile_start = (np.asarray(x) for x in tile_map(cu, num_tiles, tile, align=8))
    cu = np.asarray(cu)
    covered = np.zeros(num_tokens, np.int32)
    for s, start in zip(tile_seq, tile_start):
        if s == num_seqs:
            continue
        assert start % 8 == 0
        lo, hi = max(start, cu[s]), min(start + tile, cu[s + 1])
        assert hi > lo  # no tile without a token of its sequence
        covered[lo:hi] += 1
    np.testing.assert_array_equal(covered[: cu[-1]], 1)
    assert (tile_seq == num_seqs).sum() >= 1  # the static bound leaves room
    # include (the hybrid split): only the selected sequences get tiles, the real ones still first.
    include = jnp.asarray(q_lens >= 60)
    tile_seq, _ = (np.asarray(x) for x in tile_map(jnp.asarray(cu), num_tiles, tile, align=8, include=include))
    real = tile_seq[tile_seq < num_seqs]
    assert sorted(set(real.tolist())) == [0, 3, 4] and len(real) == 2 + 1 + 3
    assert np.all(tile_seq[len(real):] == num_seqs)


@pytest.mark.slow
def test_malformed_sequence_spoils_only_its_own_rows():
    """A sequence with kv_len < q_len (outside the contract) must not derail the persistent program's later work
    items (negative key-step counts would move its K/V ring backwards): the valid sequence's rows equal the Triton
    kernel's, and the call finishes (one program takes every item, longest first)."""
    batch = make_batch(9, [300, 20], [300, 20], hq=2, hkv=1, d=64, block_size=16, dtype=jnp.bfloat16)
    kv_lens = batch["kv_lens"].at[0].set(10)  # the first sequence: 300 query tokens, a 10-token context
    args = (batch["q"], batch["k_pages"], batch["v_pages"], kv_lens, batch["block_tables"], batch["cu_q_lens"])
    got = ragged_paged_attention(*args, sm_scale=0.125, impl="mosaic", interpret=True, num_programs=1)
    want = ragged_paged_attention(*args, sm_scale=0.125, impl="triton", interpret=True)
    np.testing.assert_allclose(np.asarray(got[300:320], np.float32), np.asarray(want[300:320], np.float32),
                               atol=2e-2, rtol=2e-2)
