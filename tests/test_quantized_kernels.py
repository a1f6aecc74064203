"""Quantized kernels on CPU: the Pallas weight-only int4/int8 matmul (interpret mode) against its jnp reference on
fresh random ragged shapes, and the FP8 KV cache (write, the jnp reference and the Triton kernel reading e4m3 pages,
the per-layer k/v scales folded into the model)."""

import time

import jax.numpy as jnp
import numpy as np
import pytest

from models.quantization.linear import pack_int32, weight_only_matmul_reference
from paged_jax.ops import ragged_paged_attention, write_kv
from paged_jax.ops.quantized_matmul import default_tuning, weight_only_matmul_pallas
from tests.test_ragged_paged_attention import make_batch, numpy_oracle


def _random_weight_only(rng, k, n, bits, group_size, act_order, dtype):
    """Random canonical arrays (every integer value, zero points and scales random) and the matching g_idx."""
    q = rng.integers(0, 1 << bits, size=(k, n))
    groups = k // group_size
    scales = jnp.asarray(rng.uniform(0.001, 0.05, size=(groups, n)), dtype)
    zeros = jnp.asarray(rng.integers(0, 1 << bits, size=(groups, n)), dtype)
    g_idx = jnp.asarray(rng.permutation(np.arange(k) // group_size).astype(np.int32)) if act_order else None
    return pack_int32(jnp.asarray(q), bits), scales, zeros, g_idx


@pytest.mark.parametrize("bits,dtype,act_order", [(4, jnp.float32, True), (8, jnp.bfloat16, False)])
def test_pallas_weight_only_matmul_matches_reference(bits, dtype, act_order):
    """Fresh ragged shapes every run (seeded by the clock, printed): M not a multiple of the row tile, N not of the
    column tile, K ending in a partial tile; int4 with act-order groups smaller than a tile (the gather path),
    int8 per-channel in bf16 (one scale row per tile)."""
    seed = time.time_ns() % (1 << 31)
    rng = np.random.default_rng(seed)
    pack = 32 // bits
    m = int(rng.integers(1, 20))
    n = int(rng.choice([24, 40, 72]))
    k = 192 if bits == 4 else 128 * int(rng.integers(1, 3)) + 64
    group_size = 32 if act_order else k
    qweight, scales, zeros, g_idx = _random_weight_only(rng, k, n, bits, group_size, act_order, dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    want = weight_only_matmul_reference(x, qweight, scales, zeros, g_idx, bits=bits, group_size=group_size)
    got = weight_only_matmul_pallas(x, qweight, scales, zeros, g_idx, bits=bits, group_size=group_size,
                                    interpret=True, split_k=2)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32)))) + 1e-6
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale, np.asarray(want, np.float32) / scale,
                               atol=tol, err_msg=f"seed={seed} m={m} n={n} k={k} pack={pack}")


def test_default_tuning_fills_the_gpu_at_batch_one():
    t = default_tuning(1, 4096, 4096, 4)
    assert t["block_m"] == 16 and t["block_kp"] * 8 == 128
    assert (4096 // t["block_n"]) * t["split_k"] >= 128
    assert default_tuning(64, 4096, 4096, 8)["split_k"] >= 1


def test_fp8_kv_pool_write_saturates():
    pages = jnp.zeros((2, 4, 1, 16), jnp.float8_e4m3fn)
    big = jnp.full((1, 1, 16), 1000.0, jnp.float32)
    k_pages, _ = write_kv(pages, pages, big, -big, jnp.asarray([5], jnp.int32))
    assert float(k_pages[1, 1, 0, 0].astype(jnp.float32)) == 448.0  # not NaN
    assert not bool(jnp.isnan(k_pages.astype(jnp.float32)).any())


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_attention_reads_fp8_pages(impl):
    """Both the jnp reference and the Triton kernel (interpret) read an e4m3 pool, against a float64 oracle of the
    same (dequantized) pages; q in bf16 as on the GPU."""
    batch = make_batch(11, [1, 5, 1], [9, 21, 33], hq=4, hkv=2, d=32, block_size=8, dtype=jnp.float32)
    batch["k_pages"] = batch["k_pages"].astype(jnp.float8_e4m3fn)
    batch["v_pages"] = batch["v_pages"].astype(jnp.float8_e4m3fn)
    batch["q"] = batch["q"].astype(jnp.bfloat16)
    sm_scale = 32 ** -0.5
    want = numpy_oracle(batch, sm_scale)
    got = ragged_paged_attention(**batch, sm_scale=sm_scale, impl=impl, interpret=impl == "triton")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="mosaic"):
        ragged_paged_attention(**batch, sm_scale=sm_scale, impl="mosaic", interpret=True)


def test_kv_scales_fold_into_q_and_output():
    """A layer's (k_scale, v_scale) change what the cache stores, never the attention result (fp32 dense)."""
    from flax import nnx

    from models.attention import dense_causal_attention
    from models.config import ModelConfig
    from models.llama import LlamaForCausalLM
    from models.testing import tiny_config

    config = ModelConfig.from_hf_config(tiny_config("llama", num_hidden_layers=1))
    model = LlamaForCausalLM(config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    ids = jnp.asarray([3, 9, 27, 81, 243], jnp.int32)
    positions = jnp.arange(5, dtype=jnp.int32)
    stored = []

    def attention(layer_idx, q, k, v, kv_layer):
        stored.append(k)
        return dense_causal_attention(np.zeros((5,), np.int32), config.head_dim ** -0.5)(layer_idx, q, k, v,
                                                                                         kv_layer)

    want = model(ids, positions, None, attention)[0]
    for layer in model.model.layers:
        layer.self_attn.kv_scale = nnx.Param(jnp.asarray([4.0, 0.25], jnp.float32))
    got = model(ids, positions, None, attention)[0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(stored[1]) * 4.0, np.asarray(stored[0]), rtol=1e-6)  # cache: k / 4
