"""The fused MoE op: the Pallas grouped matmul (interpret mode on CPU) against its ``lax.ragged_dot`` reference on
fresh random ragged inputs, and the whole op (sort, gate/up + SwiGLU, down, top-k combine) against a per-token loop;
with float weights, block-FP8 ones (float8 weights, a float32 scale per block) and MXFP4 ones (packed fp4 codes, an
e8m0 scale per 32 inputs)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.moe import (COMPARE_INVERSE_ROWS, grouped_matmul_for, in_pair_order, moe_experts_gathered, resolve_moe_impl,
                        route_top_k, sort_by_expert)
from models.quantization import block_fp8, mxfp4
from models.quantization.block_fp8 import BlockFp8Experts
from models.quantization.mxfp4 import Mxfp4Experts
from paged_jax.ops import fused_moe
from paged_jax.ops.fused_moe import (KernelConfig, default_config, grouped_matmul_pallas,
                                     grouped_matmul_pallas_differentiable, grouped_matmul_reference,
                                     moe_experts_reference, moe_experts_with, tile_schedule)
from paged_jax.ops.fused_moe.kernel import CONFIG_ENVS, split_steps

TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _random(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(dtype)


@pytest.mark.parametrize("group_sizes", [
    [0, 5, 1, 0, 20, 3],  # empty experts, a one-row expert, one spanning two 16-row tiles
    [1],
    [0, 0, 0, 7],
    [33, 0, 17, 16, 1, 0, 0, 2],
])
def test_tile_schedule_covers_every_row_once_by_its_expert(group_sizes):
    sizes = np.array(group_sizes, np.int32)
    rows = int(sizes.sum())
    expert, start, end = (np.asarray(a) for a in tile_schedule(jnp.asarray(sizes), rows, 16))
    owner = np.repeat(np.arange(len(sizes)), sizes)
    covered = np.zeros(rows, np.int32)
    for e, s, t in zip(expert, start, end):
        assert 0 <= t - s <= 16
        covered[s:t] += 1
        assert (owner[s:t] == e).all()
    assert (covered == 1).all()


def test_kernel_configs_parse_split_and_default_by_rows_per_expert():
    config = KernelConfig.parse("16/128/64/auto/4/3")
    assert config == KernelConfig(16, 128, 64, None, 4, 3) and KernelConfig.parse(str(config)) == config
    for bad in ("16/128/64/4/3", "16/100/64/1/4/3", "16/128/64/0/4/3", "8/128/64/1/4/3", "16/128/64/x/4/3"):
        with pytest.raises(ValueError, match="config|block_n|split_k|block_m"):
            KernelConfig.parse(bad)
    # K's steps cut into programs, none empty; "auto" doubles the splits while the launch stays within 512 programs.
    assert split_steps(768, 64, 8, 1) == (6, 2)
    assert split_steps(2048, 64, None, 8 * 6) == (8, 4)
    assert split_steps(768, 64, None, 8 * 16) == (4, 3)
    assert split_steps(2048, 64, None, 600) == (1, 32)
    assert split_steps(80, 16, 3, 1) == (3, 2)
    # Qwen3-30B-A3B's gate/up at decode (8 rows per token over 128 experts) and prefill.
    assert default_config(8, 128, 768, 2048) == KernelConfig(16, 128, 64, None, 4, 3)
    assert default_config(64 * 8, 128, 768, 2048).block_m == 16
    assert default_config(4096 * 8, 128, 768, 2048) == KernelConfig(128, 128, 64, 1, 8, 3)
    assert default_config(8, 4, 24, 40)[1:3] == (32, 64)  # tiles at most the padded dimensions
    # float32 rows: half the columns and two stages (the staged tiles' shared memory)
    assert default_config(4096 * 8, 128, 768, 2048, itemsize=4) == KernelConfig(128, 64, 64, 1, 8, 2)
    assert default_config(8, 128, 768, 2048, itemsize=4) == KernelConfig(16, 64, 64, None, 4, 2)


def test_default_config_from_the_environment(monkeypatch):
    """CONFIG_ENVS replace the decode and prefill launches (an in-engine sweep), refitted like the defaults; a bad
    spelling is a ValueError naming the variable."""
    decode_env, prefill_env = CONFIG_ENVS
    monkeypatch.setenv(decode_env, "16/32/128/1/4/4")
    assert default_config(8, 128, 768, 2048) == KernelConfig(16, 32, 128, 1, 4, 4)
    assert default_config(4096 * 8, 128, 768, 2048) == KernelConfig(128, 128, 64, 1, 8, 3)  # prefill: unchanged
    monkeypatch.setenv(prefill_env, "64/128/64/auto/4/3")
    assert default_config(4096 * 8, 128, 768, 2048) == KernelConfig(64, 128, 64, None, 4, 3)
    monkeypatch.setenv(decode_env, "16/32/128")
    with pytest.raises(ValueError, match=decode_env):
        default_config(8, 128, 768, 2048)

@pytest.mark.parametrize("num_tokens, fp8, kernels", [
    # Qwen3-30B-A3B at batch 1: gate/up's K split over 8 programs, down's over 4; 16-row tiles of 128 columns.
    (1, False, ("moe_grouped_matmul_gather_swiglu_bm16_bn128_bk64_s8", "moe_grouped_matmul_bm16_bn128_bk64_s4")),
    (1, True, ("moe_grouped_matmul_gather_swiglu_fp8_bm16_bn128_bk64_s8", "moe_grouped_matmul_fp8_bm16_bn128_bk64_s4")),
    (4096, False, ("moe_grouped_matmul_gather_swiglu_bm128_bn128_bk64_s1", "moe_grouped_matmul_bm128_bn128_bk64_s1")),
])
def test_default_launches_lower_to_triton_for_the_gpu(num_tokens, fp8, kernels):
    """The op at Qwen3-30B-A3B's shapes lowers for CUDA on the CPU (every kernel primitive has its Triton rule) with
    the default launches: nothing runs, only the kernels' names (tiles, K splits) are read off the module."""
    hidden, inter, num_experts, top_k = 2048, 768, 128, 8

    def stack(k, n):
        if not fp8:
            return jax.ShapeDtypeStruct((num_experts, k, n), jnp.bfloat16)
        return BlockFp8Experts(jax.ShapeDtypeStruct((num_experts, k, n), jnp.float8_e4m3fn),
                               jax.ShapeDtypeStruct((num_experts, n // 128, k // 128), jnp.float32), (128, 128))

    op = jax.jit(functools.partial(moe_experts_with, grouped_matmul_pallas))
    text = op.trace(jax.ShapeDtypeStruct((num_tokens, hidden), jnp.bfloat16), stack(hidden, inter),
                    stack(hidden, inter), stack(inter, hidden),
                    jax.ShapeDtypeStruct((num_tokens, top_k), jnp.float32),
                    jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32)).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert all(f'name = "{name}"' in text for name in kernels)

def _grouped_rows(rng, group_sizes, k, gather, dtype):
    """``(group_sizes int32[E], lhs [T or rows, k], row_index int32[rows] or None)``: the rows of each expert in
    order, gathered from half as many tokens when ``gather``."""
    sizes = jnp.asarray(group_sizes, jnp.int32)
    rows = int(sizes.sum())
    num_tokens = max(rows // 2, 1)
    lhs = _random(rng, (num_tokens if gather else rows, k), dtype)
    row_index = jnp.asarray(rng.integers(0, num_tokens, rows), jnp.int32) if gather else None
    return sizes, lhs, row_index


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group_sizes, k, n, gather, swiglu, config", [
    ([0, 5, 1, 0, 20, 3], 40, 24, False, False, KernelConfig(16, 16, 16, 1)),  # K, N not multiples; 3 K steps
    ([3, 0, 9, 1], 64, 48, True, True, KernelConfig(16, 32, 32, 1, 4, 2)),
    ([1, 0, 0, 0, 0, 0, 0, 0], 32, 32, True, True, None),  # one row (decode, top-1), K split by default
    ([70, 2, 0, 41], 96, 80, True, False, KernelConfig(64, 64, 32, 1)),  # 64-row tiles
    ([0, 0, 0], 16, 16, False, False, None),  # no rows at all
    ([0, 0, 37, 0], 80, 48, True, True, KernelConfig(16, 32, 16, 3)),  # one expert; 3 K splits, the last partial
    ([2, 1, 0, 5, 0, 0, 1], 64, 40, False, False, KernelConfig(16, 16, 16, None, 2, 1)),  # 7 experts, auto split
])
def test_grouped_matmul_kernel_matches_reference(dtype, group_sizes, k, n, gather, swiglu, config, request):
    rng = np.random.default_rng(abs(hash(request.node.name)) % 2**32)
    sizes, lhs, row_index = _grouped_rows(rng, group_sizes, k, gather, dtype)
    rows, num_experts = int(sizes.sum()), len(group_sizes)
    rhs = _random(rng, (num_experts, k, n), dtype)
    up_rhs = _random(rng, (num_experts, k, n), dtype) if swiglu else None
    out = grouped_matmul_pallas(lhs, rhs, sizes, row_index=row_index, up_rhs=up_rhs, interpret=True,
                                config=config)
    ref = grouped_matmul_reference(lhs, rhs, sizes, row_index=row_index, up_rhs=up_rhs)
    assert out.shape == (rows, n) and out.dtype == dtype
    scale = max(float(jnp.abs(ref.astype(jnp.float32)).max()) if rows else 0.0, 1.0)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=TOLERANCE[dtype] * scale, rtol=0)


def test_grouped_matmul_kernel_refuses_mismatched_inputs():
    lhs = jnp.zeros((4, 16), jnp.bfloat16)
    rhs = jnp.zeros((2, 16, 16), jnp.bfloat16)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul_pallas(lhs, rhs, jnp.array([4], jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="share one of"):
        grouped_matmul_pallas(lhs, rhs.astype(jnp.float32), jnp.array([2, 2], jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="lhs must be"):
        grouped_matmul_pallas(lhs[:, :8], rhs, jnp.array([2, 2], jnp.int32), interpret=True)


def _per_token_moe(x, w_gate, w_up, w_down, weights, ids):
    """The experts token by token, in float32 numpy: the op's definition, with no sorting."""
    x, w_gate, w_up, w_down = (np.asarray(a, np.float32) for a in (x, w_gate, w_up, w_down))
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(np.asarray(weights)[t], np.asarray(ids)[t]):
            gate, up = x[t] @ w_gate[e], x[t] @ w_up[e]
            out[t] += w * ((gate / (1 + np.exp(-gate)) * up) @ w_down[e])
    return out


@pytest.mark.parametrize("num_tokens, num_experts, top_k, dtype, one_expert", [
    (1, 8, 1, jnp.bfloat16, False), (13, 8, 2, jnp.float32, False), (6, 8, 8, jnp.bfloat16, False),
    (40, 16, 2, jnp.bfloat16, False), (20, 8, 1, jnp.float32, True)])
def test_moe_experts_kernel_and_reference_match_per_token_experts(num_tokens, num_experts, top_k, dtype, one_expert,
                                                                  request):
    """The kernel (its default launch: K split at these sizes), the reference and the gathered XLA forms against the
    per-token loop; ``one_expert``: every token routed to expert 5 alone."""
    rng = np.random.default_rng(abs(hash(request.node.name)) % 2**32)
    hidden, inter = 32, 48
    x = _random(rng, (num_tokens, hidden), dtype)
    w_gate = _random(rng, (num_experts, hidden, inter), dtype) * 0.2
    w_up = _random(rng, (num_experts, hidden, inter), dtype) * 0.2
    w_down = _random(rng, (num_experts, inter, hidden), dtype) * 0.2
    # A skewed router: uneven expert loads, some experts without tokens.
    bias = 100.0 * (jnp.arange(num_experts) == 5) if one_expert else jnp.linspace(0, 3, num_experts)
    logits = _random(rng, (num_tokens, num_experts), jnp.float32) + bias
    weights, ids = route_top_k(logits, top_k, norm_topk_prob=True)
    assert not one_expert or (ids == 5).all()
    expected = _per_token_moe(x, w_gate, w_up, w_down, weights, ids)
    reference = jax.jit(moe_experts_reference)(x, w_gate, w_up, w_down, weights, ids)
    kernel = _moe_experts_interpreted(x, w_gate, w_up, w_down, weights, ids)
    gathered = [jax.jit(functools.partial(moe_experts_gathered, reduce=reduce))(x, w_gate, w_up, w_down, weights, ids)
                for reduce in (False, True)]
    _check_moe_outputs(expected, reference, [kernel, *gathered], x.shape, dtype)


def _check_moe_outputs(expected, reference, others, shape, dtype) -> None:
    """The reference and the ``others`` (the kernel, other forms) each within twice ``dtype``'s tolerance of the
    per-token ``expected``, and each other one within its tolerance of the reference (scaled by the largest
    output)."""
    scale = max(np.abs(expected).max(), 1.0)
    for out in (reference, *others):
        assert out.shape == shape and out.dtype == dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), expected, atol=TOLERANCE[dtype] * scale * 2, rtol=0)
    for out in others:
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(reference, np.float32),
                                   atol=TOLERANCE[dtype] * scale, rtol=0)


def _moe_experts_interpreted(*args):
    """``moe_experts`` with ``impl="pallas"``, the kernel in interpret mode."""
    kernel = functools.partial(grouped_matmul_pallas_differentiable, interpret=True)
    return jax.jit(functools.partial(moe_experts_with, kernel))(*args)


def test_sort_by_expert_orders_pairs_stably_and_counts_only_real_experts():
    ids = jnp.array([[3, 0], [0, 4], [3, 1]], jnp.int32)  # 4: another device's expert (expert parallelism)
    order, group_sizes = sort_by_expert(ids, 4)
    assert order.tolist() == [1, 2, 5, 0, 4, 3] and group_sizes.tolist() == [2, 1, 0, 2]
    assert group_sizes.dtype == jnp.int32 and order.dtype == jnp.int32

@pytest.mark.parametrize("num_pairs", [1, 8, COMPARE_INVERSE_ROWS + 6])  # compared (decode) and scattered
def test_in_pair_order_inverts_the_sort(num_pairs):
    rng = np.random.default_rng(num_pairs)
    ids = jnp.asarray(rng.integers(0, 5, (num_pairs, 1)), jnp.int32)
    order, _ = sort_by_expert(ids, 5)
    sorted_rows = jnp.asarray(rng.standard_normal((num_pairs, 3)), jnp.float32)
    expected = np.zeros((num_pairs, 3), np.float32)
    expected[np.asarray(order)] = np.asarray(sorted_rows)
    np.testing.assert_array_equal(np.asarray(jax.jit(in_pair_order)(sorted_rows, order)), expected)

def test_route_top_k_renormalizes_only_when_asked():
    logits = jnp.array([[0.0, 1.0, 2.0, 3.0]])
    probs = np.asarray(jax.nn.softmax(logits[0]))
    weights, ids = route_top_k(logits, 2, norm_topk_prob=False)
    assert ids.tolist() == [[3, 2]] and ids.dtype == jnp.int32
    np.testing.assert_allclose(np.asarray(weights[0]), probs[[3, 2]], rtol=1e-6)
    weights, _ = route_top_k(logits, 2, norm_topk_prob=True)
    np.testing.assert_allclose(np.asarray(weights[0]), probs[[3, 2]] / probs[[3, 2]].sum(), rtol=1e-6)


def test_kernel_derivatives_are_the_references():
    rng = np.random.default_rng(0)
    sizes = jnp.array([3, 0, 4], jnp.int32)
    lhs, rhs, up = _random(rng, (5, 16), jnp.float32), _random(rng, (3, 16, 16), jnp.float32), \
        _random(rng, (3, 16, 16), jnp.float32)
    row_index = jnp.asarray(rng.integers(0, 5, 7), jnp.int32)

    def loss(fn, a, b, c):
        return jnp.sum(fn(a, b, sizes, row_index=row_index, up_rhs=c) ** 2)

    kernel = functools.partial(grouped_matmul_pallas_differentiable, interpret=True)
    got = jax.grad(functools.partial(loss, kernel), argnums=(0, 1, 2))(lhs, rhs, up)
    want = jax.grad(functools.partial(loss, grouped_matmul_reference), argnums=(0, 1, 2))(lhs, rhs, up)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-4)


def test_auto_runs_xla_on_cpu_and_unknown_impls_are_refused():
    assert resolve_moe_impl("auto", 64, 32, jnp.bfloat16) == "xla"
    with pytest.raises(ValueError, match="^moe_impl must be one of"):
        resolve_moe_impl("triton", 64, 32, jnp.bfloat16)


def test_auto_falls_back_to_xla_for_fp8_scale_blocks_the_kernel_cannot_tile(monkeypatch):
    monkeypatch.setattr(fused_moe.jax, "default_backend", lambda: "gpu")
    assert resolve_moe_impl("auto", 64, 32, jnp.bfloat16, (128, 128)) == "pallas"
    assert resolve_moe_impl("auto", 64, 32, jnp.bfloat16, (8, 8)) == "xla"
    assert resolve_moe_impl("auto", 64, 32, jnp.bfloat16) == "pallas"
    assert resolve_moe_impl("pallas", 64, 32, jnp.bfloat16, (8, 8)) == "pallas"  # an explicit choice stays
    odd = BlockFp8Experts(jnp.zeros((2, 32, 32), jnp.float8_e4m3fn), jnp.ones((2, 4, 4), jnp.float32), (8, 8))
    # What the experts' callers (moe_experts, expert parallelism, gpt-oss, Llama 4) resolve through.
    assert grouped_matmul_for("auto", 64, 32, jnp.bfloat16, odd) is grouped_matmul_reference
    assert grouped_matmul_for("auto", 64, 32, jnp.bfloat16, odd.weight) is not grouped_matmul_reference


def _block_fp8_stack(rng, num_experts, k, n, block, dtype_scale=1.0):
    """``(BlockFp8Experts [E, k, n], the float32 weights it means [E, k, n])``: random experts of different
    magnitudes quantized per ``block`` of the checkpoint's ``[out, in]`` (``block_fp8.quantize``)."""
    weights, scales, floats = [], [], []
    for e in range(num_experts):
        w = rng.standard_normal((n, k)).astype(np.float32) * dtype_scale * (1 + e % 3)
        quantized, scale_inv = block_fp8.quantize(w, block)
        weights.append(quantized.T)
        scales.append(scale_inv)
        floats.append(block_fp8.dequantize(quantized, scale_inv, block).T)
    stack = BlockFp8Experts(jnp.asarray(np.stack(weights)), jnp.asarray(np.stack(scales)), block)
    return stack, np.stack(floats)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group_sizes, k, n, gather, swiglu, scale_block, config", [
    # K, N not multiples of the scale blocks
    ([0, 5, 1, 0, 20, 3], 40, 72, False, False, (32, 16), KernelConfig(16, 32, 32, 1)),
    # the published 128x128 blocks, partial last ones; K split in two by default
    ([3, 0, 9, 1], 160, 136, True, True, (128, 128), None),
    ([1, 0, 0, 0], 64, 48, True, True, (16, 16), None),  # one row (decode, top-1)
    # 64-row tiles, tiles shrunk to the scales
    ([70, 2, 0, 41], 96, 80, True, False, (64, 32), KernelConfig(64, 64, 64, 1)),
    # one expert; K's 5 steps over 3 splits of 2 (the last one's second step past K)
    ([0, 6, 0, 0], 160, 64, True, False, (32, 32), KernelConfig(16, 32, 32, 4)),
])
def test_block_fp8_kernel_matches_reference(dtype, group_sizes, k, n, gather, swiglu, scale_block, config,
                                            request):
    """Float8 weights with one float32 scale per block: the kernel (dequantizing each tile) equals the reference,
    and the reference equals the grouped matmul on the float weights the checkpoint means, rounded to ``dtype``."""
    rng = np.random.default_rng(abs(hash(request.node.name)) % 2**32)
    sizes, lhs, row_index = _grouped_rows(rng, group_sizes, k, gather, dtype)
    rows, num_experts = int(sizes.sum()), len(group_sizes)
    rhs, rhs_float = _block_fp8_stack(rng, num_experts, k, n, scale_block)
    up_rhs, up_float = _block_fp8_stack(rng, num_experts, k, n, scale_block) if swiglu else (None, None)
    assert rhs.weight.dtype == jnp.float8_e4m3fn and rhs.scale_inv.shape == (
        num_experts, -(-n // scale_block[0]), -(-k // scale_block[1]))
    out = grouped_matmul_pallas(lhs, rhs, sizes, row_index=row_index, up_rhs=up_rhs, interpret=True,
                                config=config)
    ref = grouped_matmul_reference(lhs, rhs, sizes, row_index=row_index, up_rhs=up_rhs)
    on_floats = grouped_matmul_reference(lhs, jnp.asarray(rhs_float).astype(dtype), sizes, row_index=row_index,
                                         up_rhs=None if up_float is None else jnp.asarray(up_float).astype(dtype))
    assert out.shape == (rows, n) and out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(on_floats, np.float32))
    scale = max(float(jnp.abs(ref.astype(jnp.float32)).max()), 1.0)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=TOLERANCE[dtype] * scale, rtol=0)


@pytest.mark.parametrize("num_tokens, top_k, dtype", [(1, 2, jnp.bfloat16), (13, 2, jnp.float32),
                                                      (24, 3, jnp.bfloat16)])
def test_block_fp8_moe_experts_match_per_token_experts(num_tokens, top_k, dtype, request):
    """The whole op on block-FP8 experts (uneven loads, experts without tokens): kernel and reference equal the
    per-token loop over the float weights the checkpoint means."""
    rng = np.random.default_rng(abs(hash(request.node.name)) % 2**32)
    num_experts, hidden, inter = 8, 48, 40  # neither a multiple of the 32-wide scale blocks
    x = _random(rng, (num_tokens, hidden), dtype)
    experts = [_block_fp8_stack(rng, num_experts, k, n, (32, 32), 0.2)
               for k, n in ((hidden, inter), (hidden, inter), (inter, hidden))]
    logits = _random(rng, (num_tokens, num_experts), jnp.float32) + jnp.linspace(0, 3, num_experts)
    weights, ids = route_top_k(logits, top_k, norm_topk_prob=True)
    floats = [jnp.asarray(f).astype(dtype) for _, f in experts]
    expected = _per_token_moe(x, *floats, weights, ids)
    stacks = [stack for stack, _ in experts]
    reference = jax.jit(moe_experts_reference)(x, *stacks, weights, ids)
    kernel = _moe_experts_interpreted(x, *stacks, weights, ids)
    gathered = jax.jit(moe_experts_gathered)(x, *stacks, weights, ids)
    _check_moe_outputs(expected, reference, [kernel, gathered], x.shape, dtype)


def test_block_fp8_kernel_refuses_what_it_cannot_tile():
    lhs = jnp.zeros((4, 32), jnp.bfloat16)
    weight = jnp.zeros((2, 32, 32), jnp.float8_e4m3fn)
    odd = BlockFp8Experts(weight, jnp.ones((2, 4, 4), jnp.float32), (8, 8))
    with pytest.raises(ValueError, match=r"weight_block_size \[8, 8\].*moe_impl='xla'"):
        grouped_matmul_pallas(lhs, odd, jnp.array([2, 2], jnp.int32), interpret=True)
    not_fp8 = BlockFp8Experts(weight.astype(jnp.bfloat16), jnp.ones((2, 1, 1), jnp.float32), (128, 128))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        grouped_matmul_pallas(lhs, not_fp8, jnp.array([2, 2], jnp.int32), interpret=True)
    fp8 = BlockFp8Experts(weight, jnp.ones((2, 1, 1), jnp.float32), (128, 128))
    with pytest.raises(ValueError, match="up_rhs must match"):
        grouped_matmul_pallas(lhs, fp8, jnp.array([2, 2], jnp.int32), up_rhs=weight.astype(jnp.bfloat16),
                              interpret=True)


def test_block_fp8_kernel_derivatives_in_the_rows_are_the_references():
    """The whole op on block-FP8 experts under ``jax.grad`` in ``x`` (``score_tokens``' use): the kernel's
    derivative (the reference's) equals the reference's."""
    rng = np.random.default_rng(3)
    stacks = [_block_fp8_stack(rng, 4, k, n, (16, 16), 0.2)[0] for k, n in ((32, 48), (32, 48), (48, 32))]
    x = _random(rng, (5, 32), jnp.float32)
    weights, ids = route_top_k(_random(rng, (5, 4), jnp.float32), 2, norm_topk_prob=True)
    kernel = functools.partial(grouped_matmul_pallas_differentiable, interpret=True)

    def grad(matmul):
        return jax.grad(lambda x: jnp.sum(moe_experts_with(matmul, x, *stacks, weights, ids) ** 2))(x)

    want = np.asarray(grad(grouped_matmul_reference))
    np.testing.assert_allclose(np.asarray(grad(kernel)), want, rtol=0, atol=TOLERANCE[jnp.float32] * np.abs(want).max())


def _mxfp4_stack(rng, num_experts, k, n, std=1.0):
    """``Mxfp4Experts [E, k, n]``: random experts of different magnitudes quantized as the checkpoints hold them
    (``mxfp4.quantize`` of each ``[out, in]``)."""
    weight = rng.standard_normal((num_experts, n, k)).astype(np.float32) * std
    weight *= (1 + np.arange(num_experts) % 3)[:, None, None]
    blocks, scales = mxfp4.quantize(weight)
    return Mxfp4Experts(jnp.asarray(blocks), jnp.asarray(scales))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("group_sizes, k, n, gather, swiglu, config", [
    # experts without rows; K (160) not a multiple of the 64-wide K step, N (72) not of the 32-wide tile
    ([0, 5, 1, 0, 20, 3], 160, 72, False, False, KernelConfig(16, 32, 64, 1)),
    ([1, 0, 0, 0], 96, 48, True, True, None),  # T = 1 (top-1): the default launch splits K over programs
    ([3, 0, 9, 1], 64, 40, True, False, KernelConfig(16, 16, 16, 1)),  # a 16-wide K step widened to one 32-run
    ([70, 2, 0, 41], 128, 80, True, True, KernelConfig(64, 64, 64, 1)),  # 64-row tiles
    # all rows on one expert; K's 5 32-runs over 3 splits of 2 (the last one's second step past K)
    ([0, 37, 0, 0], 160, 64, True, False, KernelConfig(16, 32, 32, 3)),
])
def test_mxfp4_kernel_matches_reference(dtype, group_sizes, k, n, gather, swiglu, config, request):
    """MXFP4 experts (packed fp4 codes, an e8m0 scale per 32 inputs) decoded per tile in the kernel equal the
    reference (every expert dequantized, then ``lax.ragged_dot``)."""
    rng = np.random.default_rng(abs(hash(request.node.name)) % 2**32)
    sizes, lhs, row_index = _grouped_rows(rng, group_sizes, k, gather, dtype)
    rows, num_experts = int(sizes.sum()), len(group_sizes)
    rhs = _mxfp4_stack(rng, num_experts, k, n)
    up_rhs = _mxfp4_stack(rng, num_experts, k, n) if swiglu else None
    assert rhs.shape == (num_experts, k, n) and rhs.blocks.dtype == rhs.scales.dtype == jnp.uint8
    out = grouped_matmul_pallas(lhs, rhs, sizes, row_index=row_index, up_rhs=up_rhs, interpret=True,
                                config=config)
    ref = grouped_matmul_reference(lhs, rhs, sizes, row_index=row_index, up_rhs=up_rhs)
    assert out.shape == (rows, n) and out.dtype == dtype
    scale = max(float(jnp.abs(ref.astype(jnp.float32)).max()), 1.0)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=TOLERANCE[dtype] * scale, rtol=0)


def test_mxfp4_moe_experts_match_per_token_experts():
    """The whole op on MXFP4 experts (uneven loads, experts without tokens): the kernel, the reference and the
    gathered form equal the per-token loop over the dequantized weights."""
    rng = np.random.default_rng(7)
    num_tokens, num_experts, top_k, hidden, inter, dtype = 9, 8, 2, 64, 96, jnp.bfloat16
    x = _random(rng, (num_tokens, hidden), dtype)
    stacks = [_mxfp4_stack(rng, num_experts, k, n, 0.2) for k, n in ((hidden, inter), (hidden, inter),
                                                                     (inter, hidden))]
    logits = _random(rng, (num_tokens, num_experts), jnp.float32) + jnp.linspace(0, 3, num_experts)
    weights, ids = route_top_k(logits, top_k, norm_topk_prob=True)
    expected = _per_token_moe(x, *(w.dequantize(dtype) for w in stacks), weights, ids)
    reference = jax.jit(moe_experts_reference)(x, *stacks, weights, ids)
    kernel = _moe_experts_interpreted(x, *stacks, weights, ids)
    gathered = jax.jit(moe_experts_gathered)(x, *stacks, weights, ids)
    _check_moe_outputs(expected, reference, [kernel, gathered], x.shape, dtype)


def test_mxfp4_kernel_refuses_what_it_cannot_read():
    stack = Mxfp4Experts(jnp.zeros((2, 32, 1, 16), jnp.uint8), jnp.zeros((2, 32, 1), jnp.uint8))
    sizes = jnp.array([2, 2], jnp.int32)
    with pytest.raises(ValueError, match="MXFP4 rhs needs uint8"):
        grouped_matmul_pallas(jnp.zeros((4, 32), jnp.int32), stack, sizes, interpret=True)
    with pytest.raises(ValueError, match="up_rhs must match"):
        grouped_matmul_pallas(jnp.zeros((4, 32), jnp.bfloat16), stack, sizes, up_rhs=jnp.zeros((2, 32, 32)),
                              interpret=True)
