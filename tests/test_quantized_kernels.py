"""Quantized kernels on CPU: the Pallas weight-only int4/int8 and FP8 matmuls (interpret mode; GEMV and dot paths)
against their jnp references on fresh random ragged shapes, their tuning and "auto" selection, their Triton
lowering, and the FP8 KV cache (write, the jnp reference and the Triton kernel reading e4m3 pages,
the per-layer k/v scales folded into the model)."""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.quantization.linear import (fp8_weight_only_matmul_reference, quantize_weight_fp8, quantize_weight_int8,
                                        weight_only_matmul_reference)
from models.quantization.packing import pack_int32
from paged_jax.ops import ragged_paged_attention, write_kv
from paged_jax.ops.quantized_matmul import (default_tuning, fp8_weight_only_matmul_pallas,
                                            weight_only_matmul_pallas)
from tests.test_ragged_paged_attention import make_batch, numpy_oracle


def _random_weight_only(rng, k, n, bits, group_size, act_order, dtype):
    """Random canonical arrays (every integer value, zero points and scales random) and the matching g_idx."""
    q = rng.integers(0, 1 << bits, size=(k, n))
    groups = k // group_size
    scales = jnp.asarray(rng.uniform(0.001, 0.05, size=(groups, n)), dtype)
    zeros = jnp.asarray(rng.integers(0, 1 << bits, size=(groups, n)), dtype)
    g_idx = jnp.asarray(rng.permutation(np.arange(k) // group_size).astype(np.int32)) if act_order else None
    return pack_int32(jnp.asarray(q), bits), scales, zeros, g_idx


@pytest.mark.parametrize("bits,dtype,act_order,block_m", [(4, jnp.float32, True, None), (8, jnp.bfloat16, False, None),
                                                      (4, jnp.bfloat16, False, 1), (4, jnp.float32, False, 16)])
def test_pallas_weight_only_matmul_matches_reference(bits, dtype, act_order, block_m):
    """Fresh ragged shapes every run (seeded by the clock, printed): M not a multiple of the row tile, N not of the
    column tile; int4 act-order (gathered scales; the table's path for M), int8 per channel in bf16 with K ending in
    a partial step, the GEMV path (block_m 1, several rows, post-scaled groups of 32 / 64 / 128) and the dot path
    (block_m 16: groups of 128 post-scaled, 32 / 64 dequantized per weight)."""
    seed = time.time_ns() % (1 << 31)
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 4 if block_m == 1 else 20))
    n = int(rng.choice([24, 40, 72]))
    k = 192 if bits == 4 else 128 * int(rng.integers(1, 3)) + 64
    group_size = int(rng.choice([32, 64, 128])) if bits == 4 and not act_order else 32 if act_order else k
    k = k if k % group_size == 0 else 256
    qweight, scales, zeros, g_idx = _random_weight_only(rng, k, n, bits, group_size, act_order, dtype)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    want = weight_only_matmul_reference(x, qweight, scales, zeros, g_idx, bits=bits, group_size=group_size)
    got = weight_only_matmul_pallas(x, qweight, scales, zeros, g_idx, bits=bits, group_size=group_size,
                                    interpret=True, split_k=2, block_m=block_m)
    assert got.shape == (m, n) and got.dtype == dtype
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    scale = float(jnp.max(jnp.abs(want.astype(jnp.float32)))) + 1e-6
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale, np.asarray(want, np.float32) / scale,
                               atol=tol, err_msg=f"seed={seed} m={m} n={n} k={k} g={group_size}")


@pytest.mark.parametrize("block_m", [1, 16])
def test_pallas_fp8_weight_only_matmul_matches_reference(block_m):
    """FP8 weights upcast in the kernel (GEMV and dot paths), per-channel and per-tensor scales, and online int8's
    int8 weights in the same layout; ragged M / N / K."""
    rng = np.random.default_rng(time.time_ns() % (1 << 31))
    m, k, n = (2, 200, 40) if block_m == 1 else (5, 72, 24)
    w = jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.float32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    for strategy in ("channel", "tensor", "int8"):
        weight, weight_scale = quantize_weight_int8(w) if strategy == "int8" else quantize_weight_fp8(w, strategy)
        want = fp8_weight_only_matmul_reference(x, weight, weight_scale)
        got = fp8_weight_only_matmul_pallas(x, weight, weight_scale, interpret=True, block_m=block_m, split_k=2)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_default_tuning_paths_and_split():
    t = default_tuning("int4", 1, 4096, 4096, group_size=128)
    assert t["block_m"] == 1 and t["post_scale"] and t["block_k"] <= 128
    assert -(-4096 // t["block_n"]) * t["split_k"] >= 128  # batch 1 fills the GPU through split-K
    small = default_tuning("int4", 1, 4096, 4096, group_size=32)  # the step shrinks to a group, steps grow
    assert small["post_scale"] and small["block_k"] == 32 and small["steps"] >= 2
    assert not default_tuning("int4", 1, 4096, 4096, group_size=128, act_order=True)["post_scale"]
    dot = default_tuning("int4", 16, 4096, 4096, group_size=32)  # a dot needs 16 packed rows: 32 rows dequantize
    assert dot["block_m"] == 16 and dot["block_k"] >= 128 and not dot["post_scale"]
    assert default_tuning("int8", 64, 4096, 14336, group_size=-1)["post_scale"]
    assert "post_scale" not in default_tuning("fp8", 1, 4096, 4096)
    with pytest.raises(ValueError, match="knobs"):
        default_tuning("fp8", 1, 64, 64, block_q=4)


def test_matmul_impl_auto_selects_by_static_rows(monkeypatch):
    """"auto": the tuning table's implementation per (format, M bucket) on the GPU only (XLA elsewhere, in the
    storage the table implies); per call by the static row count (a compiled step never switches); an FP8 layer
    runs weight-only where the selector names a weight-only path, the float8 dot where it names "xla"."""
    from models.quantization import linear
    from paged_jax.ops import quantized_matmul_tuning as table
    from paged_jax.ops.quantized_matmul import select_matmul_impl

    for (fmt, bucket), impl in table.AUTO_IMPL.items():
        assert table.auto_impl(fmt, bucket, "gpu") == impl and impl in linear.MATMUL_IMPLS
        assert fmt != "fp8" or impl in linear.FP8_IMPLS
        assert table.storage(fmt) == linear.weight_storage("auto", fmt)  # one storage per format, registered
    assert table.auto_impl("int4", 17, "gpu") == table.AUTO_IMPL[("int4", 64)]
    # FP8 layers that quantize their activations: the weight-only entries below FP8_DOT_MIN_ROWS, the float8 dot
    # from it; a weight-only FP8 layer never gets the float8 dot; off the GPU both ask for "xla".
    threshold = table.FP8_DOT_MIN_ROWS
    for rows in (1, 16, threshold - 1):
        assert table.auto_impl(linear.FP8_W8A8, rows, "gpu") == table.auto_impl("fp8", rows, "gpu") != "xla"
    for rows in (threshold, 2048):
        assert table.auto_impl(linear.FP8_W8A8, rows, "gpu") == "xla"
        assert table.auto_impl("fp8", rows, "gpu") == table.AUTO_IMPL[("fp8", 64)]
    assert table.auto_impl(linear.FP8_W8A8, 1, "cpu") == table.auto_impl("fp8", 1, "cpu") == "xla"
    assert select_matmul_impl("int4", 1) == "xla"  # tests run on CPU
    with monkeypatch.context() as patch:
        patch.setitem(table.AUTO_IMPL, ("int4", 1), "xla_native")
        with pytest.raises(ValueError, match="mixes"):
            table.storage("int4")
        for bucket in table.M_BUCKETS:
            patch.setitem(table.AUTO_IMPL, ("int4", bucket), "xla_native_grouped")
        assert table.storage("int4") == "native" and table.auto_impl("int4", 1, "cpu") == "xla_native"
    calls = []
    monkeypatch.setattr(linear, "_MATMUL_SELECTOR", [lambda fmt, m: "pallas" if m <= 2 else "xla"])
    monkeypatch.setitem(linear._WEIGHT_ONLY_MATMULS, "pallas",
                        lambda *a, **kw: calls.append("int") or linear.weight_only_matmul_reference(*a, **kw))
    monkeypatch.setitem(linear._FP8_MATMULS, "pallas",
                        lambda *a: calls.append("fp8") or linear.fp8_weight_only_matmul_reference(*a))
    rng = np.random.default_rng(0)
    qweight, scales, zeros, _ = _random_weight_only(rng, 64, 16, 4, 32, False, jnp.float32)
    layer = linear.WeightOnlyLinear(qweight, scales, zeros, bits=4, group_size=32, dtype=jnp.float32)
    weight, weight_scale = quantize_weight_fp8(jnp.asarray(rng.standard_normal((64, 16)), jnp.float32))
    fp8 = linear.Fp8Linear(weight, weight_scale, activation_scheme="dynamic_token", dtype=jnp.float32)
    fp8_weight_only = linear.Fp8Linear(weight, weight_scale, activation_scheme=None, dtype=jnp.float32)
    upcast = linear._FP8_MATMULS["xla_native"]
    monkeypatch.setitem(linear._FP8_MATMULS, "xla_native", lambda *a: calls.append("upcast") or upcast(*a))
    asked = []
    selector = linear._MATMUL_SELECTOR[0]
    monkeypatch.setattr(linear, "_MATMUL_SELECTOR", [lambda fmt, m: asked.append(fmt) or selector(fmt, m)])
    for rows, expect in ((2, ["int", "fp8"]), (3, [])):
        calls.clear()
        x = jnp.asarray(rng.standard_normal((rows, 64)), jnp.float32)
        layer(x)
        got = fp8(x)
        assert calls == expect
        exact = linear.fp8_weight_only_matmul_reference(x, weight, weight_scale)
        err = float(jnp.max(jnp.abs(got - exact)) / jnp.max(jnp.abs(exact)))
        assert (err < 1e-6) == (rows == 2)  # weight-only at small M; quantized activations above
        # A weight-only FP8 layer asks as "fp8" and stays exact up to the product: its "xla" is the upcast dot.
        asked.clear()
        calls.clear()
        np.testing.assert_allclose(np.asarray(fp8_weight_only(x)), np.asarray(exact), rtol=1e-6, atol=1e-6)
        assert asked == ["fp8"] and calls == (["fp8"] if rows == 2 else ["upcast"])
        asked.clear()
        fp8(x)
        assert asked == [linear.FP8_W8A8]
    with pytest.raises(ValueError, match="matmul_impl"):
        linear.WeightOnlyLinear(qweight, scales, zeros, bits=4, group_size=32, dtype=jnp.float32, matmul_impl="x")
    with pytest.raises(ValueError, match="matmul_impl"):
        linear.Fp8Linear(weight, weight_scale, activation_scheme=None, dtype=jnp.float32,
                         matmul_impl="xla_native_grouped")


@pytest.mark.parametrize("bits,group_size,act_order", [(4, 32, False), (4, 64, True), (8, -1, False)])
def test_native_storage_matmuls_match_reference(bits, group_size, act_order):
    """Native int4 / int8 storage (``xla_native``: dequantized in the dot's operand; ``xla_native_grouped``: a dot
    per group, scaled after) against the packed layout's reference; the storage converts both ways exactly, the
    layer's dequantized kernel and ``concat`` (fused projections) keep their meaning; FP8 upcast in XLA."""
    from models.quantization import linear, native

    rng = np.random.default_rng(time.time_ns() % (1 << 31))
    k, n = 256, 40
    gs = k if group_size == -1 else group_size
    qweight, scales, zeros, g_idx = _random_weight_only(rng, k, n, bits, gs, act_order, jnp.float32)
    x = jnp.asarray(rng.standard_normal((3, k)), jnp.float32)
    want = weight_only_matmul_reference(x, qweight, scales, zeros, g_idx, bits=bits, group_size=gs)
    assert bool((native.native_to_packed(native.packed_to_native(qweight, bits), bits) == qweight).all())
    for impl in ("xla_native", "xla_native_grouped"):
        layer = linear.WeightOnlyLinear(qweight, scales, zeros, g_idx, bits=bits, group_size=gs, dtype=jnp.float32,
                                        matmul_impl=impl)
        assert layer.storage == "native" and layer.qweight.dtype == native.NATIVE_DTYPES[bits]
        assert layer.in_features == k
        np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(want), atol=1e-5 * float(jnp.abs(want).max()))
        np.testing.assert_array_equal(np.asarray(layer.dequantized_kernel()),
                                      np.asarray(linear.dequantize_weight_only(qweight, scales, zeros, g_idx,
                                                                               bits=bits, group_size=gs,
                                                                               dtype=jnp.float32)))
        fused = linear.WeightOnlyLinear.concat([layer, layer])
        if fused is not None:
            assert fused.storage == "native"
            np.testing.assert_allclose(np.asarray(fused(x)[:, n:]), np.asarray(want),
                                       atol=1e-5 * float(jnp.abs(want).max()))
        packed = linear.WeightOnlyLinear(layer.qweight[...], scales, zeros, g_idx, bits=bits, group_size=gs,
                                         dtype=jnp.float32, matmul_impl="xla")
        np.testing.assert_array_equal(np.asarray(packed.qweight[...]), np.asarray(qweight))
    weight, weight_scale = quantize_weight_fp8(jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.float32))
    fp8 = linear.Fp8Linear(weight, weight_scale, activation_scheme="dynamic_token", dtype=jnp.float32,
                           matmul_impl="xla_native")
    exact = fp8_weight_only_matmul_reference(x, weight, weight_scale)
    np.testing.assert_allclose(np.asarray(fp8(x)), np.asarray(exact), rtol=1e-5, atol=1e-6)
    # Fused projections (q/k/v, gate/up): FP8 weights [out, in] side by side along the outputs, unequal widths,
    # a per-tensor scale made per-channel.
    other_w, other_scale = quantize_weight_fp8(jnp.asarray(rng.standard_normal((k, 24)) * 0.02, jnp.float32), "tensor")
    other = linear.Fp8Linear(other_w, other_scale, activation_scheme="dynamic_token", dtype=jnp.float32,
                             matmul_impl="xla_native")
    fused = linear.Fp8Linear.concat([fp8, other])
    assert fused.weight.shape == (n + 24, k) and fused.out_features == n + 24
    side_by_side = np.concatenate([np.asarray(fp8(x)), np.asarray(other(x))], 1)
    np.testing.assert_allclose(np.asarray(fused(x)), side_by_side, atol=1e-5 * float(np.abs(side_by_side).max()))
    np.testing.assert_array_equal(np.asarray(fused.dequantized_kernel()),
                                  np.concatenate([fp8.dequantized_kernel(), other.dequantized_kernel()], 1))


def test_blocked_gemv_matches_reference():
    """The block-sliced M = 1 GEMV (interpret mode): int4 with groups 32 / 64 / 128 and zero points, K shares
    (split_k) and a remainder step after the unrolled loop; int8 per channel; FP8 (a per-tensor scale); and
    the fallback to the "pallas" kernel (a shape that does not tile; M > 1 and act-order g_idx take the same
    branch) with the same results."""
    from paged_jax.ops.quantized_gemv import blocked_tuning, fp8_gemv_blocked, weight_only_gemv_blocked

    seed = time.time_ns() % (1 << 31)
    rng = np.random.default_rng(seed)

    def check(got, want, what):
        scale = float(jnp.max(jnp.abs(want))) + 1e-6
        np.testing.assert_allclose(np.asarray(got, np.float32) / scale, np.asarray(want, np.float32) / scale,
                                   atol=1e-5, err_msg=f"seed={seed} {what}")

    for bits, group_size, k, n, m, act_order, knobs in (
            (4, int(rng.choice([32, 64, 128])), 512, 64, 1, False, dict(block_n=32, block_k=64, steps=3, split_k=2)),
            (8, -1, 256, 32, 1, False, dict(block_n=16, block_k=32, steps=2, split_k=4)),
            (4, 32, 256, 40, 1, False, dict(block_n=32, block_k=32)),  # 40 columns do not tile: fallback
            (4, 32, 256, 64, 2, False, dict(block_n=32, block_k=32)),  # M > 1: fallback
            (4, 32, 256, 64, 1, True, dict(block_n=32, block_k=32))):  # act-order g_idx: fallback
        gs = k if group_size == -1 else group_size
        qweight, scales, zeros, g_idx = _random_weight_only(rng, k, n, bits, gs, act_order, jnp.float32)
        tiles = blocked_tuning(f"int{bits}", n, k, group_size=gs, **knobs) is not None
        assert tiles == (n % 32 == 0)  # the shape's test; M and g_idx are the kernel entry's
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
        want = weight_only_matmul_reference(x, qweight, scales, zeros, g_idx, bits=bits, group_size=gs)
        got = weight_only_gemv_blocked(x, qweight, scales, zeros, g_idx, bits=bits, group_size=gs, interpret=True,
                                       **knobs)
        assert got.shape == (m, n)
        check(got, want, f"int{bits} g{gs} n={n} m={m}")
    w = jnp.asarray(rng.standard_normal((256, 64)) * 0.02, jnp.float32)
    x = jnp.asarray(rng.standard_normal((1, 256)), jnp.float32)
    weight, weight_scale = quantize_weight_fp8(w, "tensor")  # [1] scale: broadcast like a per-channel one
    assert weight.shape == (64, 256)  # [out, in]
    for dot_rows in (0, 16):  # CUDA-core products; tensor-core dot (float32 activations: a float32 dot)
        got = fp8_gemv_blocked(x, weight, weight_scale, interpret=True, block_n=32, block_k=32, steps=3, split_k=2,
                               dot_rows=dot_rows)
        check(got, fp8_weight_only_matmul_reference(x, weight, weight_scale), f"fp8 dot_rows={dot_rows}")
    # Online int8's int8 [out, in] weights: upcast through float16's bits (every value -127..127 and the edges of the
    # bias trick at -128 / 127 reached), CUDA-core and tensor-core paths, float32 and bf16 activations.
    q = jnp.asarray(rng.integers(-128, 128, size=(64, 256)), jnp.int8).at[0, :2].set(jnp.asarray([-128, 127], jnp.int8))
    q_scale = jnp.asarray(rng.uniform(1e-3, 2e-2, size=64), jnp.float32)
    for act_dtype, dot_rows in ((jnp.float32, 0), (jnp.float32, 16), (jnp.bfloat16, 16)):
        xa = x.astype(act_dtype)
        got = fp8_gemv_blocked(xa, q, q_scale, interpret=True, block_n=32, block_k=32, steps=3, split_k=2,
                               dot_rows=dot_rows)
        want = fp8_weight_only_matmul_reference(xa.astype(jnp.float32), q, q_scale)
        scale = float(jnp.max(jnp.abs(want)))
        np.testing.assert_allclose(np.asarray(got, np.float32) / scale, np.asarray(want) / scale,
                                   atol=1e-5 if act_dtype == jnp.float32 else 1e-2,
                                   err_msg=f"seed={seed} int8 {jnp.dtype(act_dtype).name} dot_rows={dot_rows}")
    # bf16 activations on the tensor-core path run a float16 dot: values beyond float16's range are clipped to it.
    big = x.at[0, 7].set(1e6).astype(jnp.bfloat16)
    got = fp8_gemv_blocked(big, weight, weight_scale, interpret=True, block_n=32, block_k=64, dot_rows=16)
    want = fp8_weight_only_matmul_reference(jnp.clip(big.astype(jnp.float32), -65504.0, 65504.0), weight,
                                            weight_scale)
    scale = float(jnp.max(jnp.abs(want)))  # bf16 output: compare at its precision (unclipped would be ~15x off)
    np.testing.assert_allclose(np.asarray(got, np.float32) / scale, np.asarray(want) / scale, atol=1e-2,
                               err_msg=f"seed={seed} fp8 clip")
    with pytest.raises(ValueError, match="dot_rows"):
        blocked_tuning("int4", 64, 512, group_size=128, dot_rows=16)
    # The tensor-core path needs K steps of >= 16 (a dot's side): 200 inputs (8 | 200) do not tile it, 40 outputs
    # do not tile block_n 32; both fall back to the "pallas" kernel, here with per-channel scales.
    assert blocked_tuning("fp8", 64, 200, block_k=64, dot_rows=16) is None
    assert blocked_tuning("fp8", 64, 200, block_k=64, dot_rows=0)["block_k"] == 8
    for k, n in ((200, 64), (256, 40)):
        weight, weight_scale = quantize_weight_fp8(jnp.asarray(rng.standard_normal((k, n)) * 0.02, jnp.float32))
        assert blocked_tuning("fp8", n, k, block_n=32, block_k=64, dot_rows=16) is None
        x = jnp.asarray(rng.standard_normal((1, k)), jnp.float32)
        got = fp8_gemv_blocked(x, weight, weight_scale, interpret=True, block_n=32, block_k=64, dot_rows=16)
        check(got, fp8_weight_only_matmul_reference(x, weight, weight_scale), f"fp8 fallback k={k} n={n}")


def test_kernels_lower_to_triton_on_cpu():
    """Each kernel path lowers to Triton IR for the GPU (Hopper) from a CPU-only jaxlib: an unsupported primitive in
    a kernel fails here, not first on the GPU."""
    import jax
    from jax import export

    spec = jax.ShapeDtypeStruct
    checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
    k, n = 512, 256
    for m, bits, group_size, act_order in ((1, 4, 128, False), (16, 4, 32, True), (16, 8, k, False)):
        args = [spec((m, k), jnp.bfloat16), spec((k * bits // 32, n), jnp.int32), spec((k // group_size, n),
                jnp.bfloat16), spec((k // group_size, n), jnp.bfloat16), spec((k,), jnp.int32) if act_order else None]
        fn = jax.jit(lambda x, q, s, z, g, bits=bits, group_size=group_size: weight_only_matmul_pallas(
            x, q, s, z, g, bits=bits, group_size=group_size))
        module = export.export(fn, platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
        assert "xla.gpu.triton" in module
    for m in (1, 16):
        export.export(jax.jit(fp8_weight_only_matmul_pallas), platforms=["cuda"], disabled_checks=checks)(
            spec((m, k), jnp.bfloat16), spec((n, k), jnp.float8_e4m3fn), spec((n,), jnp.float32))
    from paged_jax.ops.quantized_gemv import fp8_gemv_blocked, weight_only_gemv_blocked

    for bits, group_size in ((4, 128), (8, k)):  # grouped and per-channel blocked GEMV
        fn = jax.jit(lambda x, q, s, z, bits=bits, group_size=group_size: weight_only_gemv_blocked(
            x, q, s, z, bits=bits, group_size=group_size))
        module = export.export(fn, platforms=["cuda"], disabled_checks=checks)(
            spec((1, k), jnp.bfloat16), spec((k * bits // 32, n), jnp.int32), spec((k // group_size, n), jnp.bfloat16),
            spec((k // group_size, n), jnp.bfloat16)).mlir_module()
        assert "gemv_blocked" in module
    for dot_rows, weight_dtype in ((0, jnp.float8_e4m3fn), (16, jnp.float8_e4m3fn), (16, jnp.int8)):
        module = export.export(jax.jit(functools.partial(fp8_gemv_blocked, dot_rows=dot_rows)), platforms=["cuda"],
                               disabled_checks=checks)(
            spec((1, k), jnp.bfloat16), spec((n, k), weight_dtype), spec((n,), jnp.float32)).mlir_module()
        assert "gemv_blocked" in module
    from paged_jax.ops.quantized_gemv import fp8_rms_norm_gemv_blocked, fp8_silu_mul_gemv_blocked

    row, w, s = spec((1, k), jnp.bfloat16), spec((n, k), jnp.float8_e4m3fn), spec((n,), jnp.float32)
    fused = [(functools.partial(fp8_rms_norm_gemv_blocked, eps=1e-6), (row, row, spec((k,), jnp.bfloat16), w, s)),
             (fp8_silu_mul_gemv_blocked, (spec((1, 2 * k), jnp.bfloat16), w, s))]
    for fn, args in fused:  # the prologues (a when-guarded store, the sigmoid's exp)
        module = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()
        assert "gemv_blocked" in module


def test_fp8_kv_pool_write_saturates():
    pages = jnp.zeros((2, 4, 1, 16), jnp.float8_e4m3fn)
    big = jnp.full((1, 1, 16), 1000.0, jnp.float32)
    k_pages, _ = write_kv(pages, pages, big, -big, jnp.asarray([5], jnp.int32))
    assert float(k_pages[1, 1, 0, 0].astype(jnp.float32)) == 448.0  # not NaN
    assert not bool(jnp.isnan(k_pages.astype(jnp.float32)).any())


@pytest.mark.parametrize("impl,tuning", [("reference", {}), ("triton", {}),
                                         ("triton", dict(fp8_dots_in_fp16=False, block_k=32))])
def test_attention_reads_fp8_pages(impl, tuning):
    """Both the jnp reference and the Triton kernel (interpret; its default fp16 dots, and dots in q's dtype) read an
    e4m3 pool, against a float64 oracle of the same (dequantized) pages; q in bf16 as on the GPU."""
    batch = make_batch(11, [1, 5, 1], [9, 21, 33], hq=4, hkv=2, d=32, block_size=8, dtype=jnp.float32)
    batch["k_pages"] = batch["k_pages"].astype(jnp.float8_e4m3fn)
    batch["v_pages"] = batch["v_pages"].astype(jnp.float8_e4m3fn)
    batch["q"] = batch["q"].astype(jnp.bfloat16)
    sm_scale = 32 ** -0.5
    want = numpy_oracle(batch, sm_scale)
    got = ragged_paged_attention(**batch, sm_scale=sm_scale, impl=impl, interpret=impl == "triton", **tuning)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2, rtol=3e-2)
    with pytest.raises(ValueError, match="mosaic"):
        ragged_paged_attention(**batch, sm_scale=sm_scale, impl="mosaic", interpret=True)


def test_fp8_pool_fp16_dots_clip_q_and_need_an_fp8_pool():
    """The fp16 dots of an FP8 pool stay finite for a query beyond float16's range (q is clipped to it; the result
    is the softmax's hard max: V of the key with the largest clipped score); asking for them on a bf16 pool is
    refused by name."""
    from paged_jax.ops.ragged_paged_attention.triton_kernel import default_tuning

    assert default_tuning(8, 8, 4, 2, 4, 8, 1)["block_k"] == 128 and default_tuning(8, 8, 4, 2, 4, 8, 1)[
        "fp8_dots_in_fp16"]
    assert default_tuning(8, 8, 4, 2, 4, 8)["block_k"] == 64 and not default_tuning(8, 8, 4, 2, 4, 8)[
        "fp8_dots_in_fp16"]
    assert default_tuning(256, 2, 4, 2, 64, 8, 1)["block_k"] == 64  # prefill tiles of an FP8 pool keep 64 keys
    batch = make_batch(12, [1], [20], hq=2, hkv=1, d=16, block_size=8, dtype=jnp.float32)
    batch["k_pages"] = batch["k_pages"].astype(jnp.float8_e4m3fn)
    batch["v_pages"] = batch["v_pages"].astype(jnp.float8_e4m3fn)
    batch["q"] = (batch["q"] * 1e6).astype(jnp.bfloat16)
    got = np.asarray(ragged_paged_attention(**batch, sm_scale=0.25, impl="triton", interpret=True), np.float32)
    assert np.isfinite(got).all()
    pages = np.asarray(batch["k_pages"].astype(jnp.float32)), np.asarray(batch["v_pages"].astype(jnp.float32))
    block_ids = np.asarray(batch["block_tables"])[0, :3]
    keys = pages[0][block_ids].reshape(-1, 16)[:20]
    values = pages[1][block_ids].reshape(-1, 16)[:20]
    q = np.clip(np.asarray(batch["q"].astype(jnp.float32))[0], -65504, 65504)  # what the kernel's dots see
    np.testing.assert_allclose(got[0], values[np.argmax(q @ keys.T, axis=1)], atol=0.07, rtol=0.07)
    bf16 = dict(batch, k_pages=batch["k_pages"].astype(jnp.bfloat16), v_pages=batch["v_pages"].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="fp8_dots_in_fp16"):
        ragged_paged_attention(**bf16, sm_scale=0.25, impl="triton", interpret=True, fp8_dots_in_fp16=True)


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


@pytest.mark.parametrize("weights", ["fp8", "int8"])
def test_fp8_gemv_prologues_match_the_unfused_layers(monkeypatch, weights):
    """The blocked 8-bit GEMV's prologues (interpret mode; FP8 weights, and online int8's): the residual add + RMSNorm
    inside the qkv / gate_up GEMVs and SwiGLU's activation inside the down GEMV give the unfused kernels' results
    (new residual bit for bit), fall back (None) where the GEMV does not tile; and a decoder layer on them at one
    token, run as the engine runs it, takes all three fused forms and equals the same model with the fusions
    refused."""
    from flax import nnx

    from models import norm as norm_lib
    from models.attention import dense_causal_attention
    from models.config import ModelConfig
    from models.llama import LlamaForCausalLM, ReusableAttention, fuse_projections, set_rms_norm_impl
    from models.norm import rms_norm_reference
    from models.quantization import linear as linear_lib
    from models.quantization.config import resolve_quantization
    from models.quantization.load import quantize_model
    from models.testing import tiny_config
    from paged_jax.ops.quantized_gemv import (fp8_gemv_blocked, fp8_rms_norm_gemv_blocked,
                                              fp8_silu_mul_gemv_blocked)
    from paged_jax.ops.rms_norm import rms_norm_pallas

    seed = time.time_ns() % (1 << 31)
    rng = np.random.default_rng(seed)
    k, n = 96, 48  # K = 3 * 32: the norm's row loads run in 32-wide chunks
    quantize = quantize_weight_int8 if weights == "int8" else quantize_weight_fp8
    weight, weight_scale = quantize(jnp.asarray(rng.standard_normal((k, n)) * 0.05, jnp.float32))
    # Two K shares (fp32 partial rows summed by XLA) and one (the kernel writes the output dtype); the tensor-core
    # dot on bf16 activations (the engine's) and the CUDA-core products on float32 ones.
    for dtype, split_k, dot_rows in ((jnp.bfloat16, 2, 16), (jnp.bfloat16, 1, 16), (jnp.float32, 2, 0)):
        knobs = dict(interpret=True, block_n=16, block_k=16, steps=2, split_k=split_k, dot_rows=dot_rows)
        what = f"seed={seed} {jnp.dtype(dtype).name} split_k={split_k} dot_rows={dot_rows}"
        tol = 1e-2 if dtype == jnp.bfloat16 else 1e-5
        x, residual = (jnp.asarray(rng.standard_normal((1, k)) * 4, dtype) for _ in range(2))
        norm_weight = jnp.asarray(rng.standard_normal(k), dtype)
        y, new_residual = fp8_rms_norm_gemv_blocked(x, residual, norm_weight, weight, weight_scale, eps=1e-5,
                                                    **knobs)
        normed, want_residual = rms_norm_reference(x, norm_weight, residual, eps=1e-5)
        assert y.dtype == dtype and new_residual.dtype == dtype
        np.testing.assert_array_equal(np.asarray(new_residual, np.float32), np.asarray(want_residual, np.float32))
        want = fp8_gemv_blocked(normed, weight, weight_scale, **knobs)
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32), atol=tol * 4, rtol=tol,
                                   err_msg=f"{what} rms_norm prologue")
        gate_up = jnp.asarray(rng.standard_normal((1, 2 * k)) * 2, dtype)
        gate, up = jnp.split(gate_up, 2, axis=-1)
        got = fp8_silu_mul_gemv_blocked(gate_up, weight, weight_scale, **knobs)
        assert got.dtype == dtype
        want = fp8_gemv_blocked(jax.nn.silu(gate) * up, weight, weight_scale, **knobs)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tol * 4,
                                   rtol=tol, err_msg=f"{what} silu_mul prologue")
    # Shapes the blocked GEMV does not take: the fused forms decline and the caller runs the two apart.
    two_rows = jnp.concatenate([x, x])
    assert fp8_rms_norm_gemv_blocked(two_rows, two_rows, norm_weight, weight, weight_scale, eps=1e-5, **knobs) is None
    assert fp8_silu_mul_gemv_blocked(gate_up, weight, weight_scale, **{**knobs, "block_n": 64}) is None
    # K = 264 tiles 8-wide CUDA-core steps but its row load would take 33 chunks of 8: declined.
    odd_weight, odd_scale = quantize(jnp.asarray(rng.standard_normal((264, n)) * 0.05, jnp.float32))
    odd = jnp.asarray(rng.standard_normal((1, 264)), dtype)
    assert fp8_rms_norm_gemv_blocked(odd, odd, jnp.ones((264,), dtype), odd_weight, odd_scale, eps=1e-5,
                                     **{**knobs, "block_k": 8}) is None

    # A decoder whose FP8 projections run the blocked GEMV and whose norms run the kernel, both in interpret mode.
    calls = {"rms_norm": 0, "silu_mul": 0, "refused": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls[name] += 1
            return out
        return run

    def refuse(*args, **kwargs):
        return None

    monkeypatch.setitem(norm_lib._REGISTRY._impls, "pallas", functools.partial(rms_norm_pallas, interpret=True))
    monkeypatch.setitem(linear_lib._FP8_MATMULS, "pallas_blocked", functools.partial(fp8_gemv_blocked, **knobs))
    config = ModelConfig.from_hf_config(tiny_config("llama"))
    model = LlamaForCausalLM(config, dtype=dtype, rngs=nnx.Rngs(seed % 1000))
    quantize_model(model, resolve_quantization(weights, {}), matmul_impl="pallas_blocked")
    set_rms_norm_impl(fuse_projections(model), "pallas")
    dense = dense_causal_attention(jnp.zeros((1,), jnp.int32), sm_scale=0.25)

    def hidden(fused: bool):
        for table, name, fn in ((linear_lib._FP8_RMS_NORM_MATMULS, "rms_norm", fp8_rms_norm_gemv_blocked),
                                (linear_lib._FP8_SILU_MUL_MATMULS, "silu_mul", fp8_silu_mul_gemv_blocked)):
            fn = functools.partial(fn, **knobs)
            monkeypatch.setitem(table, "pallas_blocked", counted(name, fn) if fused else counted("refused", refuse))
        # Reusable, as the engine's: the layers share one trace under their nested jit (traced once: counted once)
        # and the first gets a zero residual, so both norms have a residual to add. A new one per call: the nested
        # jit's cache is keyed by it, so the second call traces again with the other table.
        attention = ReusableAttention(lambda metadata, q, k, v, kv_layer: dense(None, q, k, v, kv_layer), None)
        out, _ = model(jnp.asarray([7], jnp.int32), jnp.asarray([3], jnp.int32), None, attention)
        return np.asarray(out, np.float32)

    fused = hidden(True)
    assert calls == {"rms_norm": 2, "silu_mul": 1, "refused": 0}  # qkv and gate_up take their norm; down its activation
    unfused = hidden(False)
    assert calls == {"rms_norm": 2, "silu_mul": 1, "refused": 3}  # traced again: all three declined
    np.testing.assert_allclose(fused, unfused, atol=tol * 10, rtol=tol * 10, err_msg=f"seed={seed} model")
