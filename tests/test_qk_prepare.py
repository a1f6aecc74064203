"""qk_prepare: the one-kernel q/k norm + RoPE + FP8 KV scaling + KV write (Pallas, interpret mode) against its jnp
reference (apply_qk_transform + write_kv), and the model's fused path against its unfused one."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import ModelConfig
from models.llama import ReusableAttention, fuse_projections
from models.loader import load_model
from models.qk_transform import QKTransform, rope_cos_sin, rope_inv_freq
from models.testing import tiny_config
from paged_jax.ops import qk_prepare, write_and_attend
from paged_jax.ops.qk_prepare import qk_prepare_reference, resolve_qk_prepare_impl
from paged_jax.ops.ragged_paged_attention import ragged_paged_attention

NUM_BLOCKS, BLOCK_SIZE, HQ, HKV = 12, 4, 8, 2
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE


def _inputs(seed, num_tokens, head_dim, dtype, pool_dtype, qk_norm, kv_scale, bad_slot=False, llama4=False,
            gemma=False):
    """Fresh random q/k/v, pools and transform; real tokens on shuffled slots of blocks 1.., then (T > 2) one
    padding token in the null block and one out-of-range slot (``bad_slot``: the only token, out of range).
    ``llama4``: interleaved RoPE, q/k norms of weight 1 (its L2 norm) and a per-token q scale (its temperature);
    ``gemma``: q/k norms scaling by ``1 + weight`` (Gemma 3)."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(num_tokens, HQ, head_dim)) * 2, dtype)
    k = jnp.asarray(rng.normal(size=(num_tokens, HKV, head_dim)) * 2, dtype)
    v = jnp.asarray(rng.normal(size=(num_tokens, HKV, head_dim)) * 3, dtype)
    pool_shape = (NUM_BLOCKS, BLOCK_SIZE, HKV, head_dim)
    k_pages = jnp.asarray(rng.normal(size=pool_shape), jnp.float32).astype(pool_dtype)
    v_pages = jnp.asarray(rng.normal(size=pool_shape), jnp.float32).astype(pool_dtype)
    slots = rng.permutation(np.arange(BLOCK_SIZE, NUM_SLOTS))[:num_tokens].astype(np.int32)
    if num_tokens > 2:
        slots[-2] = 1  # a padding token: slot 1 of the null block
        slots[-1] = NUM_SLOTS + 5  # out of range: dropped
    if bad_slot:
        slots[:] = -7
    positions = rng.integers(0, 4000, size=num_tokens).astype(np.int32)
    cos, sin = rope_cos_sin(jnp.asarray(positions), rope_inv_freq(head_dim, 500000.0, None))
    transform = QKTransform(
        cos, sin,
        q_norm_weight=jnp.asarray(rng.normal(size=head_dim), dtype) if qk_norm else None,
        k_norm_weight=jnp.asarray(rng.normal(size=head_dim), dtype) if qk_norm else None,
        kv_scale=jnp.asarray([0.35, 2.5], jnp.float32) if kv_scale else None,
        norm_eps=1e-6 if qk_norm else None, dtype=dtype if qk_norm else None, norm_unit_offset=gemma)
    if llama4:
        ones = jnp.ones((head_dim,), dtype)
        transform = QKTransform(cos, sin, q_norm_weight=ones, k_norm_weight=ones, norm_eps=1e-5, dtype=dtype,
                                kv_scale=transform.kv_scale, rope_interleaved=True,
                                q_scale=jnp.asarray(1 + rng.random((num_tokens, 1, 1)), jnp.float32))
    return (q, k, v, k_pages, v_pages, jnp.asarray(slots), transform), slots


# (T, head_dim, compute dtype, pool dtype, qk norm (Qwen3-like), FP8 KV scales, the one token's slot out of range)
CASES = {
    "T1_llama_d64_bf16_bad_slot": (1, 64, jnp.bfloat16, jnp.bfloat16, False, False, True),
    "T1_qwen3_d128_fp8": (1, 128, jnp.bfloat16, jnp.float8_e4m3fn, True, True, False),
    "T5_qwen3_d128_bf16": (5, 128, jnp.bfloat16, jnp.bfloat16, True, False, False),
    "T5_llama_d128_f32": (5, 128, jnp.float32, jnp.float32, False, False, False),
    "T33_llama_d64_fp8": (33, 64, jnp.bfloat16, jnp.float8_e4m3fn, False, False, False),
    "T5_llama_d64_fp8_scaled": (5, 64, jnp.bfloat16, jnp.float8_e4m3fn, False, True, False),
    "T33_qwen3_d64_f32": (33, 64, jnp.float32, jnp.float32, True, False, False),
    "T33_qwen3_d128_bf16": (33, 128, jnp.bfloat16, jnp.bfloat16, True, False, False),
}
# Llama 4's RoPE layers: interleaved pairs, a weightless norm, the temperature on q (the model's NoPE layers have no
# RoPE: the reference runs them).
LLAMA4_CASES = {"T5_llama4_d64_f32": (5, 64, jnp.float32, jnp.float32, True, False, False),
                "T33_llama4_d128_bf16_fp8": (33, 128, jnp.bfloat16, jnp.float8_e4m3fn, True, True, False)}
CASES.update(LLAMA4_CASES)
# Gemma 3: q/k norms by 1 + weight (float32 math, then the compute dtype).
GEMMA_CASES = {"T1_gemma3_d128_bf16": (1, 128, jnp.bfloat16, jnp.bfloat16, True, False, False),
               "T33_gemma3_d64_f32": (33, 64, jnp.float32, jnp.float32, True, False, False)}
CASES.update(GEMMA_CASES)


def _f32(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32))


def _assert_within_one_ulp(got, want):
    """Each element within one ulp of its dtype (plus a float32-rounding floor for RoPE's cancellations), and for
    the narrow dtypes at most 1% of the elements not equal."""
    got32, want32 = _f32(got), _f32(want)
    eps = float(jnp.finfo(got.dtype).eps)
    np.testing.assert_allclose(got32, want32, rtol=eps * 1.001, atol=1e-6 * float(np.max(np.abs(want32))))
    if got.dtype != jnp.float32:
        assert np.mean(got32 != want32) <= 0.01


@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_matches_reference(name):
    num_tokens, head_dim, dtype, pool_dtype, qk_norm, kv_scale, bad_slot = CASES[name]
    args, slots = _inputs(sorted(CASES).index(name), num_tokens, head_dim, dtype, pool_dtype, qk_norm, kv_scale,
                          bad_slot, llama4=name in LLAMA4_CASES, gemma=name in GEMMA_CASES)
    want = jax.jit(qk_prepare_reference)(*args)
    got = jax.jit(functools.partial(qk_prepare, impl="pallas", interpret=True))(*args)
    for out, ref in zip(got, want):
        assert out.shape == ref.shape and out.dtype == ref.dtype
    # Kernel and reference agree to one rounding of the dtype, not bit for bit: how XLA compiles the reference
    # changes its last float32 bit (it contracts RoPE's x1 * cos - x2 * sin into an FMA or not depending on
    # fusion, its CPU mean over [T, H, D] sums in a shape-dependent order, and with excess precision allowed it may
    # skip rounding RoPE's output before the multiply by k_scale), which can move a rounded element by one ulp.
    for out, ref in zip(got, want):
        _assert_within_one_ulp(out, ref)
    if not kv_scale:  # V goes through no arithmetic: bit-equal
        np.testing.assert_array_equal(np.asarray(got[2]).view(np.uint8), np.asarray(want[2]).view(np.uint8))
    # Only the real tokens' slots and the padding token's null-block slot changed; an out-of-range slot is dropped
    # (T > 1) or written to slot 0 of the null block (T == 1, write_kv's dynamic_update_slice path).
    written = {int(s) if 0 <= s < NUM_SLOTS else 0 for s in slots if num_tokens == 1 or 0 <= s < NUM_SLOTS}
    untouched = np.array([s not in written for s in range(NUM_SLOTS)])
    for pool_got, pool_in in zip(got[1:], args[3:5]):
        flat_got = np.asarray(pool_got).reshape(NUM_SLOTS, -1).view(np.uint8)
        flat_in = np.asarray(pool_in).reshape(NUM_SLOTS, -1).view(np.uint8)
        np.testing.assert_array_equal(flat_got[untouched], flat_in[untouched])
        assert all(not np.array_equal(flat_got[s], flat_in[s]) for s in written)


def test_impl_resolution_and_errors():
    args, _ = _inputs(3, 5, 64, jnp.float32, jnp.float32, False, False)
    q, k_pages, transform = args[0], args[3], args[6]
    assert resolve_qk_prepare_impl("auto", q, k_pages, transform) == "xla"  # CPU
    with pytest.raises(ValueError, match="qk_prepare_impl"):
        qk_prepare(*args, impl="triton")
    with pytest.raises(ValueError, match="transform.cos"):
        qk_prepare(*args[:6], QKTransform(transform.cos[:3], transform.sin[:3]), impl="pallas", interpret=True)
    with pytest.raises(ValueError, match="both"):
        QKTransform(transform.cos, transform.sin, q_norm_weight=jnp.ones((64,)), norm_eps=1e-6)
    # A sharded runner's attention applies the q/k transform in XLA: an explicit impl is refused, not ignored.
    from types import SimpleNamespace

    from paged_jax.worker.model_runner import ModelRunner

    with pytest.raises(ValueError, match="qk_prepare_impl='pallas'"):
        ModelRunner(None, None, num_blocks=4, block_size=16, max_model_len=64, max_num_seqs=2,
                    max_num_batched_tokens=16, sharding_plan=SimpleNamespace(replicated=None),
                    qk_prepare_impl="pallas")
    # What "auto" routes to XLA, an explicit "pallas" refuses by name (never a silent dtype change).
    norms = dict(q_norm_weight=jnp.ones((64,)), k_norm_weight=jnp.ones((64,)), norm_eps=1e-6)
    with pytest.raises(ValueError, match="transform.dtype"):
        qk_prepare(*args[:6], QKTransform(transform.cos, transform.sin, dtype=jnp.bfloat16, **norms), impl="pallas",
                   interpret=True)
    # Partial rotary (Phi-4) runs in the reference only: "pallas" refuses it.
    partial = QKTransform(transform.cos[..., :16], transform.sin[..., :16])
    with pytest.raises(ValueError, match="partial rotary"):
        qk_prepare(*args[:6], partial, impl="pallas", interpret=True)
    nope = QKTransform(None, None, q_scale=jnp.full((5, 1, 1), 2.0, jnp.float32))
    with pytest.raises(ValueError, match="no RoPE"):
        qk_prepare(*args[:6], nope, impl="pallas", interpret=True)
    q_out, k_pages_out, _ = qk_prepare(*args[:6], nope, impl="auto")  # a NoPE layer: only the q scale
    np.testing.assert_array_equal(np.asarray(q_out), 2 * np.asarray(q))
    q_out, _, _ = qk_prepare(*args[:6], partial, impl="auto")  # the reference: the last 32 dims pass through
    np.testing.assert_array_equal(np.asarray(q_out[..., 32:]), np.asarray(q[..., 32:]))
    assert not np.allclose(np.asarray(q_out[..., :32]), np.asarray(q[..., :32]))


def _fused_paged_attention(meta, q, k, v, kv_layer, qk_transform=None, *, sm_scale):
    """write_and_attend with the Pallas qk_prepare in interpret mode (CPU) and the reference attention."""
    q, k_pages, v_pages = qk_prepare(q, k, v, kv_layer[0], kv_layer[1], meta["slot_mapping"], qk_transform,
                                     impl="pallas", interpret=True)
    out = ragged_paged_attention(q, k_pages, v_pages, meta["kv_lens"], meta["block_tables"], meta["cu_q_lens"],
                                 sm_scale=sm_scale, impl="reference")
    return out, (k_pages, v_pages)


def test_model_fused_path_matches_unfused():
    """A Qwen3-like model (q/k norm) with FP8 KV scales and an FP8 pool, fused projections: handing the raw q/k
    and the transform to a fusing attention (the kernel) gives the unfused path's hidden states and pools."""
    config = ModelConfig.from_hf_config(tiny_config("qwen3", head_dim=32, num_attention_heads=4,
                                                    num_key_value_heads=2))
    model, _ = load_model(None, config=config, load_format="dummy", dtype="float32")
    fuse_projections(model)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.kv_scale = nnx.Param(jnp.asarray([0.02 + 0.01 * i, 0.03], jnp.float32))
    q_lens, ctx_before = [3, 1], [0, 5]
    slots, positions, block_tables = [], [], []
    for seq, (q_len, before) in enumerate(zip(q_lens, ctx_before)):
        blocks = [1 + 3 * seq + b for b in range(3)]
        block_tables.append(blocks)
        for pos in range(before, before + q_len):
            slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            positions.append(pos)
    slots.append(2)  # one padding token in the null block
    positions.append(0)
    meta = dict(slot_mapping=jnp.asarray(slots, jnp.int32),
                kv_lens=jnp.asarray([b + n for b, n in zip(ctx_before, q_lens)], jnp.int32),
                block_tables=jnp.asarray(block_tables, jnp.int32),
                cu_q_lens=jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32))
    ids = jnp.asarray([5, 9, 2, 7, 0], jnp.int32)
    rng = np.random.default_rng(1)
    pool_shape = (NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    pools = [tuple(jnp.asarray(rng.normal(size=pool_shape) * 0.1, jnp.float32).astype(jnp.float8_e4m3fn)
                   for _ in range(2)) for _ in range(config.num_hidden_layers)]
    sm_scale = config.head_dim ** -0.5

    @functools.partial(jax.jit, static_argnames="fused")
    def run(pools, fused):
        if fused:
            fn = functools.partial(_fused_paged_attention, sm_scale=sm_scale)
        else:
            fn = functools.partial(write_and_attend, sm_scale=sm_scale, impl="reference")
        attention = ReusableAttention(fn, meta, fuses_qk_transform=fused)
        return model(ids, jnp.asarray(positions, jnp.int32), pools, attention)

    hidden_fused, pools_fused = run(pools, True)
    hidden_plain, pools_plain = run(pools, False)
    np.testing.assert_allclose(np.asarray(hidden_fused), np.asarray(hidden_plain), rtol=1e-5, atol=1e-5)
    for layer_fused, layer_plain in zip(pools_fused, pools_plain):
        for got, want in zip(layer_fused, layer_plain):
            _assert_within_one_ulp(got, want)
