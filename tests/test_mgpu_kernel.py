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

# name: (q_lens, kv_lens, hq, hkv, d, block_size, dtype, tuning)
CASES = {
    # 130-token prompt: two 128-token tiles, the second with 2 valid rows (its second warpgroup has none); a
    # 1-token chunk over a 700-token prefix (11 key steps, the last partly past the context); a 60-token prompt
    # (one tile, the second warpgroup empty); padding tokens and padded sequence slots; GQA 2, d 64, 16-token
    # pages (4 TMA page copies per 64-key step).
    "ragged_gqa2_d64_bs16": ([130, 1, 60], [130, 700, 60], 4, 2, 64, 16, jnp.bfloat16, dict(block_kv=64)),
    # A 67-token chunk over a 253-token prefix (keys end mid-page), a 3-token prompt; GQA 1, d 128, fp16, 32-token
    # pages (4 per 128-key step); T not a multiple of 8 (the wrapper pads it for the TMA boxes).
    "chunked_gqa1_d128_fp16_bs32": ([67, 3], [320, 3], 2, 2, 128, 32, jnp.float16, {}),
    # GQA 4 (four query heads read one kv head's pages), a sequence starting mid 8-row group (token 9), 3 ring
    # slots with 64-key steps over a 250-token context.
    "gqa4_three_stages": ([9, 70], [9, 250], 4, 1, 64, 16, jnp.bfloat16, dict(block_kv=64, num_stages=3)),
}


def _run(batch, sm_scale, **tuning):
    fn = jax.jit(lambda q, kp, vp, kl, bt, cu: ragged_paged_attention(
        q, kp, vp, kl, bt, cu, sm_scale=sm_scale, impl="mosaic", interpret=True, **tuning))
    return fn(batch["q"], batch["k_pages"], batch["v_pages"], batch["kv_lens"], batch["block_tables"],
              batch["cu_q_lens"])


# Interpretation of the Mosaic kernel is slow: the two largest cases run with `make test-all` (marker `slow`); CI runs
# the chunked fp16 case, which goes through the same tiles, pages and ring.
_SLOW_CASES = {"ragged_gqa2_d64_bs16", "gqa4_three_stages"}


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
    assert "block_size" in mgpu_kernel.supported((256, 8, 128), (10, 12, 2, 128), jnp.bfloat16, None)
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
    # Hopper: the Mosaic kernel for prefill-heavy shapes (>= 128 tokens per sequence slot), Triton otherwise.
    assert rpa.choose_impl(q_shape, pool_shape, jnp.bfloat16, num_seqs=4) == "mosaic"
    assert rpa.choose_impl(q_shape, pool_shape, jnp.bfloat16, num_seqs=32) == "mosaic"
    assert rpa.choose_impl(q_shape, pool_shape, jnp.bfloat16, num_seqs=33) == "triton"  # decode-heavy bucket
    assert rpa.choose_impl((2048, 32, 128), pool_shape, jnp.bfloat16, num_seqs=256) == "triton"
    assert rpa.choose_impl((1024, 32, 128), pool_shape, jnp.bfloat16, num_seqs=8) == "mosaic"
    assert rpa.choose_impl((512, 32, 128), pool_shape, jnp.bfloat16, num_seqs=1) == "triton"  # too few tiles
    assert rpa.choose_impl(q_shape, pool_shape, jnp.bfloat16, num_seqs=4, sliding_window=512) == "triton"
    assert rpa.choose_impl(q_shape, pool_shape, jnp.float32, num_seqs=4) == "triton"
    assert rpa.choose_impl((4096, 32, 256), (300, 16, 8, 256), jnp.bfloat16, num_seqs=4) == "triton"
    # Another GPU generation: the Triton kernel.
    monkeypatch.setattr(rpa, "_is_hopper", lambda: False)
    assert rpa.choose_impl(q_shape, pool_shape, jnp.bfloat16, num_seqs=4) == "triton"


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
