"""The fused residual add + RMSNorm: the Pallas kernel (interpret mode) vs the jnp reference, and the decoder that
carries (hidden, residual) vs the add-at-the-end layer formula it replaced."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax.ops  # noqa: F401  (registers rms_norm_impl "pallas" / "auto")
from models import norm as norm_lib
from models.attention import dense_causal_attention
from models.config import ModelConfig
from models.llama import ReusableAttention, set_rms_norm_impl
from models.loader import load_model
from models.norm import RMSNorm, rms_norm, rms_norm_reference
from models.testing import tiny_config
from paged_jax.ops.rms_norm import auto_impl, rms_norm_pallas

EPS = ModelConfig.from_hf_config(tiny_config("llama")).rms_norm_eps


def _inputs(seed, num_rows, hidden, dtype, scale=1.0):
    kx, kr, kw = jax.random.split(jax.random.key(seed), 3)
    x = (scale * jax.random.normal(kx, (num_rows, hidden), jnp.float32)).astype(dtype)
    residual = (scale * jax.random.normal(kr, (num_rows, hidden), jnp.float32)).astype(dtype)
    weight = (1.0 + 0.1 * jax.random.normal(kw, (hidden,), jnp.float32)).astype(dtype)
    return x, residual, weight


def _assert_normed_close(got, want, dtype):
    """Equal up to the f32 order of the sum of squares: at most one rounding step of ``dtype`` apart."""
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    got32, want32 = np.asarray(got, np.float32), np.asarray(want, np.float32)
    rtol = 2.0 ** -7 if dtype == jnp.bfloat16 else 1e-6
    np.testing.assert_allclose(got32, want32, rtol=rtol, atol=rtol)


# (rows, hidden, dtype): every T of {1, 3, 17, 64}, H of {64, 576, 1000, 4096} and both dtypes appear.
KERNEL_CASES = [(1, 4096, jnp.bfloat16), (3, 1000, jnp.float32), (17, 576, jnp.bfloat16), (64, 64, jnp.float32)]


def test_kernel_matches_reference_on_random_rows():
    for seed, (num_rows, hidden, dtype) in enumerate(KERNEL_CASES):
        x, residual, weight = _inputs(seed, num_rows, hidden, dtype)
        normed, new_residual = rms_norm_pallas(x, weight, residual, eps=EPS, interpret=True)
        want_normed, want_residual = rms_norm_reference(x, weight, residual, eps=EPS)
        # The residual add is one rounding of an exact float32 sum: bit for bit.
        np.testing.assert_array_equal(np.asarray(new_residual), np.asarray(want_residual))
        assert new_residual.dtype == dtype
        _assert_normed_close(normed, want_normed, dtype)
        if seed == 0:  # the residual-free variant (first layer; f32 in test_model_on_the_kernel_matches_xla)
            alone = rms_norm_pallas(x, weight, eps=EPS, interpret=True)
            _assert_normed_close(alone, rms_norm_reference(x, weight, eps=EPS), dtype)


def test_kernel_unit_offset_matches_reference():
    """Gemma's norm (scale by 1 + weight in float32, one rounding) on the kernel and the reference."""
    for seed, (num_rows, hidden, dtype) in enumerate(KERNEL_CASES):
        x, residual, weight = _inputs(20 + seed, num_rows, hidden, dtype)
        offset = (weight.astype(jnp.float32) - 1.0).astype(dtype)  # Gemma's weights sit near 0
        normed, new_residual = rms_norm_pallas(x, offset, residual, eps=EPS, unit_offset=True, interpret=True)
        want_normed, want_residual = rms_norm_reference(x, offset, residual, eps=EPS, unit_offset=True)
        np.testing.assert_array_equal(np.asarray(new_residual), np.asarray(want_residual))
        _assert_normed_close(normed, want_normed, dtype)
        # The same as Llama's norm with weight 1 + offset, up to where the rounding happens.
        llama = rms_norm_reference(x, 1.0 + offset.astype(jnp.float32), residual, eps=EPS, dtype=dtype)[0]
        np.testing.assert_allclose(np.asarray(want_normed, np.float32), np.asarray(llama, np.float32),
                                   rtol=2e-2, atol=2e-2)
        alone = rms_norm(x, offset, eps=EPS, unit_offset=True, impl="xla")
        _assert_normed_close(alone, rms_norm_reference(x, offset, eps=EPS, unit_offset=True), dtype)


def test_kernel_edge_cases():
    # Large magnitudes, one batch: rows near 1e4 (the float32 sum without overflow) and rows near 1e30 (the float32
    # sum of squares overflows to inf in both, so those rows norm to 0).
    x, residual, weight = _inputs(7, 4, 1000, jnp.bfloat16)
    scale = jnp.asarray([[1e4], [1e4], [1e30], [1e30]], jnp.float32)
    x, residual = (x * scale).astype(jnp.bfloat16), (residual * scale).astype(jnp.bfloat16)
    normed, new_residual = rms_norm_pallas(x, weight, residual, eps=EPS, interpret=True)
    want_normed, want_residual = rms_norm_reference(x, weight, residual, eps=EPS)
    np.testing.assert_array_equal(np.asarray(new_residual), np.asarray(want_residual))
    _assert_normed_close(normed, want_normed, jnp.bfloat16)
    # A bf16 row with an f32 weight (cast to the compute dtype).
    x, residual, _ = _inputs(8, 3, 576, jnp.bfloat16)
    weight32 = jnp.linspace(0.5, 1.5, 576, dtype=jnp.float32)
    _assert_normed_close(rms_norm_pallas(x, weight32, eps=EPS, interpret=True),
                         rms_norm_reference(x, weight32, eps=EPS), jnp.bfloat16)
    # No rows: empty results, no launch.
    empty = jnp.zeros((0, 64), jnp.bfloat16)
    normed, new_residual = rms_norm_pallas(empty, jnp.ones((64,), jnp.bfloat16), empty, eps=EPS, interpret=True)
    assert normed.shape == new_residual.shape == (0, 64)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_pallas(x, weight32, residual[:, :64], eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="rms_norm_impl"):
        rms_norm(x, weight32, eps=EPS, impl="triton")
    with pytest.raises(ValueError, match="rms_norm_impl"):
        RMSNorm(64, eps=EPS, dtype=jnp.float32, param_dtype=jnp.float32, impl="fast")
    # "auto" is XLA off the GPU; the dispatcher takes any leading axes.
    assert auto_impl(1, 4096, jnp.bfloat16) == ("pallas" if jax.default_backend() == "gpu" else "xla")
    x3 = x.reshape(3, 8, 72)
    np.testing.assert_array_equal(np.asarray(rms_norm(x3, jnp.ones((72,), jnp.bfloat16), eps=EPS)),
                                  np.asarray(rms_norm_reference(x3, jnp.ones((72,), jnp.bfloat16), eps=EPS)))


def test_kernel_gradients_are_the_reference_gradients():
    """What rms_norm_impl="pallas" runs is differentiable (score_tokens under jax.grad; jax.jvp): the reference's
    derivatives."""
    from paged_jax.ops.rms_norm import rms_norm_pallas_differentiable

    x, residual, weight = _inputs(3, 3, 64, jnp.float32)

    def loss(norm, x, weight, residual):
        normed, new_residual = norm(x, weight, residual, eps=EPS)
        return jnp.sum(normed * jnp.cos(normed)) + jnp.sum(new_residual ** 2)

    kernel = functools.partial(rms_norm_pallas_differentiable, interpret=True)
    got = jax.grad(functools.partial(loss, kernel), argnums=(0, 1, 2))(x, weight, residual)
    want = jax.grad(functools.partial(loss, rms_norm_reference), argnums=(0, 1, 2))(x, weight, residual)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    # Forward mode too (jax.jvp / jacfwd), and the norm without a residual.
    tangents = tuple(jnp.sin(a) for a in (x, weight, residual))
    got = jax.jvp(lambda *a: kernel(*a, eps=EPS), (x, weight, residual), tangents)[1]
    want = jax.jvp(lambda *a: rms_norm_reference(*a, eps=EPS), (x, weight, residual), tangents)[1]
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    got = jax.grad(lambda x: jnp.sum(jnp.cos(kernel(x, weight, eps=EPS))))(x)
    want = jax.grad(lambda x: jnp.sum(jnp.cos(rms_norm_reference(x, weight, eps=EPS))))(x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def _old_formula_hidden(model, input_ids, positions, attention):
    """main's decoder before the fusion: ``x = x + attn(norm(x)); x = x + mlp(norm(x))`` per layer, then the final
    norm, each norm the plain HF RMSNorm."""
    config = model.config

    def norm(module, x):
        return rms_norm_reference(x, module.scale[...], eps=module.eps, dtype=module.dtype)

    from models.llama import rope_cos_sin, rope_inv_freq
    rope = (rope_cos_sin(positions, rope_inv_freq(config.head_dim, float(config.rope_theta), None)),)
    x = model.model.embed_tokens(input_ids)
    for i, layer in enumerate(model.model.layers):
        attn_out, _ = layer.self_attn(i, norm(layer.input_layernorm, x), rope, None, attention)
        x = x + attn_out
        x = x + layer.mlp(norm(layer.post_attention_layernorm, x))
    return norm(model.model.norm, x)


def _dense_fn(meta, q, k, v, kv_layer, *, sm_scale, traces):
    traces.append(1)  # Python side effect: once per trace of a decoder layer
    out, _ = dense_causal_attention(meta, sm_scale)(None, q, k, v, None)
    return out, kv_layer


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decoder_with_residual_stream_equals_the_old_formula_bit_for_bit(dtype):
    """The reference path (XLA on CPU): the restructured decoder (residual carried, adds inside the norms, one
    nested-jit trace for layers 1..) gives exactly the hidden states of the add-at-the-end formula."""
    config = ModelConfig.from_hf_config(tiny_config("qwen3", num_hidden_layers=3))
    model, _ = load_model(None, config=config, load_format="dummy", dtype=dtype)
    ids = jnp.asarray([5, 9, 2, 7, 7, 0], jnp.int32)
    positions = jnp.asarray([0, 1, 2, 0, 1, 0], jnp.int32)
    segment_ids = jnp.asarray([0, 0, 0, 1, 1, -1], jnp.int32)
    sm_scale = config.head_dim ** -0.5
    caches = [jnp.float32(i) for i in range(config.num_hidden_layers)]

    @jax.jit
    def old(segment_ids):
        return _old_formula_hidden(model, ids, positions, dense_causal_attention(segment_ids, sm_scale))

    @jax.jit
    def new_closure(segment_ids):
        return model(ids, positions, None, dense_causal_attention(segment_ids, sm_scale))[0]

    @jax.jit
    def new_reusable(segment_ids):
        attention = ReusableAttention(functools.partial(_dense_fn, sm_scale=sm_scale, traces=traces), segment_ids)
        return model(ids, positions, caches, attention)[0]

    traces = []
    want = np.asarray(old(segment_ids))
    if dtype == "float32":  # the unrolled path (closure attention) once
        np.testing.assert_array_equal(np.asarray(new_closure(segment_ids)), want)
    np.testing.assert_array_equal(np.asarray(new_reusable(segment_ids)), want)
    # One trace shared by every layer (the first takes a zero residual).
    assert len(traces) == 1


def test_model_on_the_kernel_matches_xla(monkeypatch):
    """rms_norm_impl="pallas" (interpret mode on CPU): one kernel per norm, 2 per layer + the final one, and the
    same logits as the XLA norms up to the sum order."""
    calls = []

    def kernel(*args, **kwargs):
        calls.append(1)  # at trace time: once per norm in the traced forward
        return rms_norm_pallas(*args, interpret=True, **kwargs)

    monkeypatch.setitem(norm_lib._REGISTRY._impls, "pallas", kernel)
    config = ModelConfig.from_hf_config(tiny_config("llama", num_hidden_layers=2))
    model, _ = load_model(None, config=config, load_format="dummy", dtype="float32")
    ids = jnp.asarray([3, 1, 4, 1, 5], jnp.int32)
    positions = jnp.arange(5, dtype=jnp.int32)
    segment_ids = jnp.zeros((5,), jnp.int32)

    def logits_fn():  # a new function per trace: jit caches traces by function, and the impl is not an argument
        def logits(segment_ids):
            hidden, _ = model(ids, positions, None, dense_causal_attention(segment_ids, config.head_dim ** -0.5))
            return model.compute_logits(hidden)

        return jax.jit(logits)

    want = np.asarray(logits_fn()(segment_ids))
    assert not calls
    set_rms_norm_impl(model, "pallas")
    got = np.asarray(logits_fn()(segment_ids))
    assert len(calls) == 2 * config.num_hidden_layers + 1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert model.model.layers[0].input_layernorm.impl == "pallas"
    assert model.model.layers[0].self_attn.q_norm is None  # llama: no q/k norms (Qwen3: in the q/k transform)
    # A model on a mesh keeps XLA norms (a pallas_call is not partitioned): refused by name, not silently run.
    model.sharding_plan = "plan"  # what TensorParallelLlamaForCausalLM carries
    with pytest.raises(ValueError, match="mesh"):
        set_rms_norm_impl(model, "auto")
    set_rms_norm_impl(model, "xla")
