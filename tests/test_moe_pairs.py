"""The MoE decode kernels: the pair form (``models.moe.moe_experts_pairs``: two Pallas kernels, interpret mode on
CPU) against its reference (each pair's expert gathered) on fresh random inputs, the whole op against the sorted
reference, its derivatives; the router kernel against ``route_top_k``; the Triton lowering of a sparse layer at
Qwen3-30B-A3B's batch-1 shapes, and where the model takes them."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import moe
from models.config import ModelConfig
from models.moe import (PAIR_FORM_MAX_PAIRS, SparseMoeBlock, moe_experts_gathered, moe_experts_pairs,
                        pair_experts_reference, route_top_k)
from models.quantization.block_fp8 import BlockFp8Experts
from models.testing import tiny_config
from paged_jax.ops import fused_moe
from paged_jax.ops.fused_moe import (moe_experts_reference, pair_experts_pallas, pair_experts_pallas_differentiable,
                                     route_top_k_pallas, route_top_k_pallas_differentiable)
from paged_jax.ops.fused_moe.pair_kernel import pair_launch

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _random(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


def _experts(rng, num_experts, hidden, inter, dtype):
    return [_random(rng, shape, dtype) * 0.2 for shape in
            ((num_experts, hidden, inter), (num_experts, hidden, inter), (num_experts, inter, hidden))]


@pytest.mark.parametrize("num_tokens, top_k, num_experts, hidden, inter, block_n, block_k, dtype", [
    (2, 3, 5, 96, 40, 32, 32, jnp.float32),  # I not a multiple of the column block; pairs sharing experts
    (2, 3, 5, 96, 40, 32, 32, jnp.bfloat16),
    (1, 4, 4, 64, 64, 16, 16, jnp.bfloat16),  # K split over several programs, whole steps
    (2, 8, 9, 70, 33, 16, 32, jnp.float32),  # H and I not multiples of the K step: the last split partial
    (1, 1, 3, 16, 16, 128, 64, jnp.float32),  # one pair, blocks wider than the matrices
    (0, 2, 3, 16, 16, 16, 16, jnp.bfloat16),  # no tokens
])
def test_pair_kernels_match_reference(dtype, num_tokens, top_k, num_experts, hidden, inter, block_n, block_k,
                                      request):
    rng = np.random.default_rng(abs(hash(request.node.name)) % 2**32)
    x = _random(rng, (num_tokens, hidden), dtype)
    stacks = _experts(rng, num_experts, hidden, inter, dtype)
    ids = jnp.asarray(rng.integers(0, num_experts, (num_tokens, top_k)), jnp.int32)
    got = pair_experts_pallas(x, *stacks, ids, interpret=True, block_n=block_n, block_k=block_k)
    want = pair_experts_reference(x, *stacks, ids)
    assert got.shape == (num_tokens * top_k, hidden) and got.dtype == jnp.float32
    scale = max(float(jnp.abs(want).max()) if num_tokens else 0.0, 1.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOLERANCE[dtype] * scale, rtol=0)


def test_pair_kernels_refuse_mismatched_inputs():
    x, ids = jnp.zeros((1, 16), jnp.float32), jnp.zeros((1, 2), jnp.int32)
    stacks = [jnp.zeros(shape, jnp.float32) for shape in ((3, 16, 8), (3, 16, 8), (3, 8, 16))]
    with pytest.raises(ValueError, match="gate/up"):
        pair_experts_pallas(x, stacks[0], stacks[1][:, :, :4], stacks[2], ids, interpret=True)
    with pytest.raises(ValueError, match="must share"):
        pair_experts_pallas(x.astype(jnp.bfloat16), *stacks, ids, interpret=True)


def test_pair_launch_splits_k_up_to_its_program_target():
    # Qwen3-30B-A3B at batch 1: 8 pairs, gate|up [2048, 768] and down [768, 2048].
    assert pair_launch(8, 2048, 768) == (128, 6, 16, 2)
    assert pair_launch(8, 768, 2048) == (128, 16, 6, 2)
    assert pair_launch(1, 16, 16) == (16, 1, 1, 1)


@pytest.mark.parametrize("num_tokens, top_k, dtype", [(1, 8, jnp.bfloat16), (2, 3, jnp.float32), (3, 1, jnp.float32)])
def test_pair_form_matches_the_sorted_reference(num_tokens, top_k, dtype, request):
    rng = np.random.default_rng(abs(hash(request.node.name)) % 2**32)
    hidden, inter, num_experts = 32, 48, 16
    x = _random(rng, (num_tokens, hidden), dtype)
    stacks = _experts(rng, num_experts, hidden, inter, dtype)
    weights, ids = route_top_k(_random(rng, (num_tokens, num_experts), jnp.float32), top_k, True)
    kernel = functools.partial(pair_experts_pallas_differentiable, interpret=True)
    got = jax.jit(functools.partial(moe_experts_pairs, kernel))(x, *stacks, weights, ids)
    want = jax.jit(moe_experts_reference)(x, *stacks, weights, ids)
    gathered = jax.jit(moe_experts_gathered)(x, *stacks, weights, ids)
    scale = max(float(jnp.abs(want.astype(jnp.float32)).max()), 1.0)
    for out in (got, gathered):
        assert out.shape == x.shape and out.dtype == dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                                   atol=TOLERANCE[dtype] * scale, rtol=0)


def test_pair_kernel_derivatives_are_the_references():
    rng = np.random.default_rng(0)
    x = _random(rng, (2, 16), jnp.float32)
    stacks = _experts(rng, 3, 16, 16, jnp.float32)
    ids = jnp.asarray(rng.integers(0, 3, (2, 3)), jnp.int32)

    def loss(fn, *operands):
        return jnp.sum(fn(*operands, ids) ** 2)

    kernel = functools.partial(pair_experts_pallas_differentiable, interpret=True)
    got = jax.grad(functools.partial(loss, kernel), argnums=(0, 1, 2, 3))(x, *stacks)
    want = jax.grad(functools.partial(loss, pair_experts_reference), argnums=(0, 1, 2, 3))(x, *stacks)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, norm, dtype", [
    (1, 128, 8, True, jnp.bfloat16),  # Qwen3-30B-A3B at batch 1
    (37, 60, 2, False, jnp.float32),  # experts not a power of two; tokens over several programs
    (5, 8, 8, True, jnp.float32),  # every expert picked
])
def test_route_kernel_matches_reference(num_tokens, num_experts, top_k, norm, dtype, request):
    rng = np.random.default_rng(abs(hash(request.node.name)) % 2**32)
    logits = _random(rng, (num_tokens, num_experts), jnp.float32) * 3
    logits = logits.at[0, : num_experts // 2].set(0.5).astype(dtype)  # ties: the lower expert id first
    weights, ids = route_top_k_pallas(logits, top_k, norm, interpret=True)
    want_weights, want_ids = route_top_k(logits, top_k, norm)
    assert weights.dtype == jnp.float32 and ids.dtype == jnp.int32 and ids.shape == (num_tokens, top_k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="top_k"):
        route_top_k_pallas(logits, num_experts + 1, norm, interpret=True)


@pytest.mark.parametrize("bad_logit", [float("nan"), float("inf")])
def test_route_kernel_picks_real_experts_for_a_non_finite_row(bad_logit):
    """A row whose softmax is NaN (a NaN or infinite router logit) still routes to real experts, the reference's ids
    (the pair kernels index the expert weights with them: an id past the experts would read outside them) and NaN
    weights, as the reference's (the blow-up shows); the other rows are untouched."""
    rng = np.random.default_rng(5)
    logits = _random(rng, (3, 60), jnp.float32).at[1, 7].set(bad_logit)
    for norm in (True, False):
        weights, ids = route_top_k_pallas(logits, 4, norm, interpret=True)
        want_weights, want_ids = route_top_k(logits, 4, norm)
        np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
        assert int(ids.max()) < 60
        assert np.isnan(np.asarray(weights[1])).all()  # the blow-up shows, as in the reference's weights
        np.testing.assert_allclose(np.asarray(weights), np.asarray(want_weights), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("norm", [True, False])
def test_route_kernel_derivatives_are_the_references(norm):
    """What ``moe_impl="pallas"`` registers (``route_top_k_pallas_differentiable``) differentiates as
    ``route_top_k`` does: a model on the kernel stays differentiable."""
    rng = np.random.default_rng(3)
    logits = _random(rng, (2, 16), jnp.float32)
    cotangent = _random(rng, (2, 4), jnp.float32)
    kernel = functools.partial(route_top_k_pallas_differentiable, interpret=True)
    got, want = (jax.grad(lambda l, fn=fn: jnp.sum(fn(l, 4, norm)[0] * cotangent))(logits)
                 for fn in (kernel, route_top_k))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(want).max()) > 0


def test_route_kernel_derivative_is_taken_at_the_experts_it_picked(monkeypatch):
    """Where the kernel's ids differ from XLA's top-k (a near-tie broken otherwise), the weights' tangent is the
    softmax's at the kernel's experts, not at XLA's: here a stand-in kernel picks the 2nd..5th largest."""
    def second_to_fifth(logits, top_k, norm_topk_prob, interpret=False):
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        ids = jnp.argsort(-probs, axis=-1)[:, 1:1 + top_k].astype(jnp.int32)
        picked = jnp.take_along_axis(probs, ids, axis=-1)
        return (picked / picked.sum(-1, keepdims=True) if norm_topk_prob else picked), ids

    monkeypatch.setattr(fused_moe, "route_top_k_pallas", second_to_fifth)
    rng = np.random.default_rng(8)
    logits, tangent = _random(rng, (2, 16), jnp.float32), _random(rng, (2, 16), jnp.float32)
    for norm in (True, False):
        _, got = jax.jvp(lambda l, norm=norm: route_top_k_pallas_differentiable(l, 4, norm)[0], (logits,), (tangent,))
        _, want = jax.jvp(lambda l, norm=norm: second_to_fifth(l, 4, norm)[0], (logits,), (tangent,))
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)


def test_batch_one_step_lowers_to_the_decode_kernels_for_the_gpu(monkeypatch):
    """A Qwen3-MoE sparse block ("auto" on a GPU) lowers for CUDA on the CPU. Without the decode kernels
    (``PAGED_JAX_MOE_DECODE_KERNELS=0``: none registered) its one-token step sorts and runs the grouped kernels; with
    them (the default) its router runs as the route kernel and its experts as the two pair kernels (named by their
    launches), with no sort; at 16 tokens the sorted grouped kernels and XLA's top-k; block-FP8 experts keep the
    grouped form. Nothing runs, only the module is read."""
    monkeypatch.setattr(fused_moe.jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(moe, "_PAIR_EXPERTS", {})
    monkeypatch.setattr(moe, "_ROUTERS", {})
    hidden, inter, num_experts, top_k = 2048, 768, 128, 8
    config = ModelConfig.from_hf_config(tiny_config("qwen3_moe", hidden_size=hidden, moe_intermediate_size=inter,
                                                    num_experts=num_experts, num_experts_per_tok=top_k))
    # Abstract weights: the lowering needs their shapes only.
    block = nnx.eval_shape(lambda: SparseMoeBlock(config, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                                  rngs=nnx.Rngs(0), init_std=0.02))
    graph, state = nnx.split(block)

    def lowered(num_tokens, experts=None):
        def run(state, x, experts):
            layer = nnx.merge(graph, state)
            if experts is not None:
                layer.experts.projections = lambda: experts
            return layer(x)
        return jax.jit(run).trace(state, jax.ShapeDtypeStruct((num_tokens, hidden), jnp.bfloat16), experts).lower(
            lowering_platforms=("cuda",)).as_text()

    default = lowered(1)
    assert "moe_grouped_matmul" in default and "sort" in default and "moe_pair" not in default
    fused_moe.register_decode_kernels()
    one = lowered(1)
    assert one.count("__gpu$xla.gpu.triton") == 3 and "sort" not in one
    for name in ("moe_route_top8", "moe_pair_gate_up_bn128_bk64_s16", "moe_pair_down_bn128_bk64_s6"):
        assert f'name = "{name}"' in one
    assert 8 * 2 <= PAIR_FORM_MAX_PAIRS < 16 * top_k

    def routed(expert_parallel):  # the router alone: experts over devices route with XLA's (the mesh splits it)
        def run(state, x):
            layer = nnx.merge(graph, state)
            layer.expert_parallel = expert_parallel
            return layer.route(x)
        return jax.jit(run).trace(state, jax.ShapeDtypeStruct((1, hidden), jnp.bfloat16)).lower(
            lowering_platforms=("cuda",)).as_text()

    assert "moe_route_top8" in routed(None) and "moe_route_top8" not in routed(object())
    sixteen = lowered(16)
    assert "moe_grouped_matmul" in sixteen and "moe_pair" not in sixteen and "moe_route_top8" not in sixteen
    fp8 = [BlockFp8Experts(jax.ShapeDtypeStruct((num_experts, k, n), jnp.float8_e4m3fn),
                           jax.ShapeDtypeStruct((num_experts, n // 128, k // 128), jnp.float32), (128, 128))
           for k, n in ((hidden, inter), (hidden, inter), (inter, hidden))]
    assert "moe_grouped_matmul" in lowered(1, fp8)


def test_decode_kernels_env_is_read_or_refused(monkeypatch):
    monkeypatch.delenv(fused_moe.DECODE_KERNELS_ENV, raising=False)
    assert fused_moe.decode_kernels_requested()  # on by default
    monkeypatch.setenv(fused_moe.DECODE_KERNELS_ENV, "0")
    assert not fused_moe.decode_kernels_requested()
    monkeypatch.setenv(fused_moe.DECODE_KERNELS_ENV, "yes")
    with pytest.raises(ValueError, match="PAGED_JAX_MOE_DECODE_KERNELS must be 0 or 1"):
        fused_moe.decode_kernels_requested()
