"""Quantized projections: NNX modules with ``nnx.Linear``'s call contract (``x[..., in] -> y[..., out]`` in the
compute dtype), swapped in for the decoder's projections by ``models.quantization.load``.

``WeightOnlyLinear`` (AWQ, GPTQ): the canonical layout every weight-only format is converted to is GPTQ's
  * ``qweight int32[in * bits / 32, out]``: ``pack = 32 / bits`` input rows per word; bits ``j*bits .. j*bits+bits-1``
    of word ``[r, c]`` hold the unsigned integer of input row ``pack * r + j``, column ``c``;
  * ``scales [G, out]`` and ``zeros [G, out]`` (compute dtype; ``zeros`` the real zero point, integers);
  * ``g_idx int32[in]`` (GPTQ act-order only, else None): the group of each input row; without it row ``k`` is in
    group ``k // group_size`` (``group_size = in``: one group, per-channel scales);
  * weight ``w[k, c] = (q[k, c] - zeros[g(k), c]) * scales[g(k), c]``.
  Packing along the inputs keeps the output axis whole, so column-parallel shards split ``qweight``, ``scales`` and
  ``zeros`` on axis 1, and row-parallel shards split ``qweight`` and ``g_idx`` on axis 0 (contiguous input rows:
  ``(in / tp) % pack == 0``) with the scales and zeros replicated (act-order groups are scattered over the rows).

``Fp8Linear`` (FP8 checkpoints, online ``fp8``): ``weight float8_e4m3fn[out, in]`` (the checkpoint's layout; column-
  parallel shards split axis 0, row-parallel ones axis 1), ``weight_scale float32[out]``
  (per channel) or ``[1]`` (per tensor), optional static ``input_scale float32[1]``; activations are quantized to
  e4m3 per token (dynamic), per tensor (dynamic or static), and multiplied by XLA's float8 dot
  (``preferred_element_type=float32``) then rescaled; or, without activation quantization (``activation_scheme``
  None: a weight-only checkpoint, or online fp8's o_proj / down_proj), the weights are upcast.

``Int8Linear`` (online ``int8``): ``Fp8Linear`` weight-only with ``weight int8[out, in]`` (symmetric, -127..127) and
  ``weight_scale float32[out]``: the same layout, bytes per weight and kernels (each upcasts a tile of either element
  type exactly), so it asks the selector as weight-only ``"fp8"`` and runs FP8's weight-only entries.

``matmul_impl`` of both modules (``MATMUL_IMPLS``): ``"xla"`` (int: ``weight_only_matmul_reference``, dequantize +
dot fused by XLA as it can; fp8: the float8 dot above, or the upcast dot for a layer without activation
quantization), ``"xla_native"`` (int: native ``int4`` / ``int8`` storage,
dequantized in the dot's operand; fp8: the weights upcast in the dot's operand, the scale applied after),
``"xla_native_grouped"`` (int only: native storage, a dot per group on the raw integers, scaled after; see
``models.quantization.native``), ``"pallas"`` (the skinny-M Pallas kernels of ``paged_jax.ops.quantized_matmul``:
weight-only, fp8 activations not quantized), ``"pallas_blocked"`` (the block-sliced M = 1 GEMV kernels of
``paged_jax.ops.quantized_gemv``, "pallas" for other M or shapes it does not take) or ``"auto"`` (default: chosen
per call by the static row count M, ``resolve_matmul_impl``). The storage of a weight-only module follows its
``matmul_impl`` (``IMPL_STORAGE``; "auto": the registered selector's storage): ``"packed"`` = the canonical int32
layout above, ``"native"`` = ``int4`` / ``int8 [in, out]`` (``models.quantization.native``); the constructor takes
either and converts. The kernels and the selector register themselves here (``register_weight_only_matmul``,
``register_fp8_matmul``, ``register_matmul_selector``) when ``paged_jax.ops`` is imported, so ``models`` never
imports ``paged_jax``; without a selector ``"auto"`` is ``"xla"`` on packed storage.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.quantization import native
from models.quantization.packing import pack_int32, unpack_int32

FP8_DTYPE = jnp.float8_e4m3fn
FP8_MAX = 448.0
# Smallest dynamic activation scale (vLLM's): an all-zero row still divides by something finite.
_MIN_ACTIVATION_SCALE = 1.0 / (FP8_MAX * 512.0)

MATMUL_IMPLS = ("auto", "xla", "xla_native", "xla_native_grouped", "pallas", "pallas_blocked")
# The weight-only storage each implementation reads ("packed": int32 words; "native": int4 / int8 [in, out]).
IMPL_STORAGE = {"xla": "packed", "pallas": "packed", "pallas_blocked": "packed", "xla_native": "native",
                "xla_native_grouped": "native"}
# The weight-only implementations whose dot multiplies by weights XLA dequantizes into a buffer (the Pallas kernels
# dequantize tiles in registers). XLA schedules such a dequantization once its parameters are ready, ahead of its dot,
# so a forward may hold several layers' dequantized weights at once.
XLA_DEQUANTIZING_IMPLS = ("xla", "xla_native", "xla_native_grouped")
FP8_IMPLS = ("auto", "xla", "xla_native", "pallas", "pallas_blocked")
# The format an FP8 layer that quantizes its activations asks the "auto" selector about (``resolve_matmul_impl``):
# "auto" may give it the float8 dot ("xla") where that beats the weight-only paths; a weight-only FP8 layer asks as
# "fp8" and never gets it.
FP8_W8A8 = "fp8_w8a8"

# XLA's GEMM autotuner checks each candidate kernel's output against the others at a relative tolerance
# (``xla_gpu_autotune_gemm_rtol``). At its default, the float8 dots of its Triton and cuBLASLt backends disagree on
# its random inputs' outputs near zero (FP8 rounding, not broken kernels), and sorting out that disagreement costs
# seconds per GEMM, growing with the rows: minutes for the forwards of a large engine. This tolerance is meant to
# admit the rounding while a broken kernel, off by far more, still fails the check.
FLOAT8_DOT_AUTOTUNE_RTOL = 0.2
FLOAT8_DOT_COMPILER_OPTIONS = {"xla_gpu_autotune_gemm_rtol": FLOAT8_DOT_AUTOTUNE_RTOL}

_WEIGHT_ONLY_MATMULS: dict[str, Callable] = {}
_FP8_MATMULS: dict[str, Callable] = {}
_FP8_RMS_NORM_MATMULS: dict[str, Callable] = {}
_FP8_SILU_MUL_MATMULS: dict[str, Callable] = {}
_MATMUL_SELECTOR: list[Callable[[str, int], str]] = []
_AUTO_STORAGE: list[Callable[[str], str]] = []


def register_weight_only_matmul(name: str, fn: Callable) -> None:
    """Make ``fn(x, qweight, scales, zeros, g_idx, *, bits, group_size) -> y`` selectable as ``matmul_impl``."""
    _WEIGHT_ONLY_MATMULS[name] = fn


def register_fp8_matmul(name: str, fn: Callable, *, rms_norm: Callable | None = None,
                        silu_mul: Callable | None = None) -> None:
    """Make ``fn(x[M, K], weight float8_e4m3fn[N, K], weight_scale f32[N] | [1]) -> y[M, N]`` (weight-only: the
    activations are not quantized; weights as ``Fp8Linear`` stores them) an ``Fp8Linear`` ``matmul_impl``.

    Optional fused forms of the same matmul, each returning None (at trace time) for a shape it does not take:
    ``rms_norm(x, residual, norm_weight, weight, weight_scale, *, eps, norm_dtype) -> (y, new_residual)`` with the
    fused residual add + RMSNorm of ``models.norm`` before it (``Fp8Linear.rms_norm_matmul``); ``silu_mul(gate_up,
    weight, weight_scale) -> y`` with SwiGLU's ``silu(gate) * up`` before it (``Fp8Linear.silu_mul_matmul``)."""
    _FP8_MATMULS[name] = fn
    for table, fused in ((_FP8_RMS_NORM_MATMULS, rms_norm), (_FP8_SILU_MUL_MATMULS, silu_mul)):
        if fused is None:
            table.pop(name, None)
        else:
            table[name] = fused


def register_matmul_selector(fn: Callable[[str, int], str], storage: Callable[[str], str] | None = None) -> None:
    """``fn(format "int4" | "int8" | "fp8" | FP8_W8A8, rows M) -> implementation name`` decides
    ``matmul_impl="auto"``; ``storage(format) -> "packed" | "native"`` is the weight-only storage of "auto" modules
    (every name ``fn`` returns for that format must read it; None = "packed")."""
    _MATMUL_SELECTOR[:] = [fn]
    _AUTO_STORAGE[:] = [storage] if storage is not None else []


def weight_storage(matmul_impl: str, fmt: str) -> str:
    """``"packed"`` | ``"native"``: the storage a weight-only module of ``matmul_impl`` holds."""
    if matmul_impl == "auto":
        return _AUTO_STORAGE[0](fmt) if _AUTO_STORAGE else "packed"
    return IMPL_STORAGE[matmul_impl]


def resolve_matmul_impl(matmul_impl: str, fmt: str, m: int) -> str:
    """The implementation a layer of ``matmul_impl`` runs for ``m`` rows (static shape: no recompile at run time);
    "auto" asks the registered selector ("xla" without one)."""
    if matmul_impl != "auto":
        return matmul_impl
    return _MATMUL_SELECTOR[0](fmt, m) if _MATMUL_SELECTOR else "xla"


def _check_matmul_impl(matmul_impl: str) -> None:
    if matmul_impl not in MATMUL_IMPLS:
        raise ValueError(f"matmul_impl must be one of {MATMUL_IMPLS}, got {matmul_impl!r}")


def group_index(in_features: int, group_size: int) -> np.ndarray:
    """``int32[in]``: the group of each input row when groups are contiguous."""
    return (np.arange(in_features, dtype=np.int32) // group_size).astype(np.int32)


def dequantize_weight_only(qweight, scales, zeros, g_idx, *, bits: int, group_size: int, dtype) -> jax.Array:
    """The canonical weight-only arrays -> ``dtype[in, out]`` weights ``(q - zeros[g]) * scales[g]``."""
    q = unpack_int32(qweight, bits)
    in_features, out = q.shape
    if g_idx is None:  # contiguous groups: a broadcast instead of a gather, which XLA can fuse into the dot
        groups = scales.shape[0]
        q = q.reshape(groups, in_features // groups, out).astype(dtype)
        w = (q - zeros.astype(dtype)[:, None, :]) * scales.astype(dtype)[:, None, :]
        return w.reshape(in_features, out)
    return (q.astype(dtype) - zeros.astype(dtype)[g_idx]) * scales.astype(dtype)[g_idx]


def weight_only_matmul_reference(x, qweight, scales, zeros, g_idx, *, bits: int, group_size: int) -> jax.Array:
    """``x[M, in] @ dequantized w -> [M, out]`` in ``x.dtype`` (fp32 accumulation); the jnp oracle of the Pallas
    kernel and the engine's default path (XLA fuses what it can of the dequantization into the dot)."""
    w = dequantize_weight_only(qweight, scales, zeros, g_idx, bits=bits, group_size=group_size, dtype=x.dtype)
    return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


register_weight_only_matmul("xla", weight_only_matmul_reference)
register_weight_only_matmul("xla_native", native.native_matmul)
register_weight_only_matmul("xla_native_grouped", native.native_grouped_matmul)


def fp8_weight_only_matmul_reference(x, weight, weight_scale) -> jax.Array:
    """``x[M, K] @ (weight float8_e4m3fn[N, K] * weight_scale f32[N, 1] | [1]).T`` -> ``[M, N]`` in ``x.dtype`` (the
    weights upcast to ``x.dtype``, fp32 accumulation): the oracle of the Pallas FP8 weight-only kernels."""
    w = (weight.astype(jnp.float32) * weight_scale.astype(jnp.float32).reshape(-1, 1)).astype(x.dtype)
    return jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(x.dtype)


def _param(value):
    return None if value is None else nnx.Param(value)


class WeightOnlyLinear(nnx.Module):
    """int4 / int8 weight-only projection in the canonical layout (module docstring). Shapes: ``qweight
    int32[in*bits/32, out]`` (packed storage) or ``int4 | int8 [in, out]`` (native storage: ``matmul_impl``
    "xla_native*"; either is accepted and converted to the storage of ``matmul_impl``), ``scales, zeros dtype[G,
    out]``, ``g_idx int32[in] | None``, ``bias dtype[out] | None``. ``matmul_impl``: one of ``MATMUL_IMPLS``
    (module docstring; default "auto")."""

    def __init__(self, qweight, scales, zeros, g_idx=None, bias=None, *, bits: int, group_size: int, dtype,
                 matmul_impl: str = "auto"):
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        _check_matmul_impl(matmul_impl)
        self.storage = weight_storage(matmul_impl, f"int{bits}")
        if native.is_native(qweight) and self.storage == "packed":
            qweight = native.native_to_packed(qweight, bits)
        elif not native.is_native(qweight) and self.storage == "native":
            qweight = native.packed_to_native(qweight, bits)
        self.qweight = nnx.Param(qweight)
        self.scales = nnx.Param(scales)
        self.zeros = nnx.Param(zeros)
        self.g_idx = _param(g_idx)
        self.bias = _param(bias)
        self.bits = bits
        self.group_size = group_size
        self.in_features = qweight.shape[0] * (1 if self.storage == "native" else 32 // bits)
        self.out_features = qweight.shape[1]
        self.dtype = dtype
        self.matmul_impl = matmul_impl

    def __call__(self, x: jax.Array) -> jax.Array:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1]).astype(self.dtype)
        impl = resolve_matmul_impl(self.matmul_impl, f"int{self.bits}", x2.shape[0])
        if IMPL_STORAGE[impl] != self.storage:
            raise ValueError(f"matmul_impl {impl!r} reads {IMPL_STORAGE[impl]} weights; this layer holds "
                             f"{self.storage} ones (the 'auto' selector's storage disagrees with its choice)")
        fn = _WEIGHT_ONLY_MATMULS[impl]
        g_idx = None if self.g_idx is None else self.g_idx[...]
        qweight, scales, zeros = self.qweight[...], self.scales[...], self.zeros[...]
        if impl in XLA_DEQUANTIZING_IMPLS:
            # Ties the weights to this layer's input: XLA cannot dequantize them before the input exists, so a
            # forward holds one projection's dequantized weights at a time instead of hoisting every layer's
            # dequantization to the start (``dequantized_weight_bytes`` sizes the KV pool on this).
            x2, qweight, scales, zeros = jax.lax.optimization_barrier((x2, qweight, scales, zeros))
        y = fn(x2, qweight, scales, zeros, g_idx, bits=self.bits, group_size=self.group_size)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y.reshape(*lead, self.out_features)

    def dequantized_kernel(self, dtype=jnp.float32) -> jax.Array:
        """``dtype[in, out]``: the weights this layer multiplies by."""
        g_idx = None if self.g_idx is None else self.g_idx[...]
        if self.storage == "native":
            return native.dequantize_native(self.qweight[...], self.scales[...], self.zeros[...], g_idx,
                                            bits=self.bits, dtype=dtype)
        return dequantize_weight_only(self.qweight[...], self.scales[...], self.zeros[...], g_idx, bits=self.bits,
                                      group_size=self.group_size, dtype=dtype)

    @staticmethod
    def concat(layers: Sequence["WeightOnlyLinear"]) -> "WeightOnlyLinear | None":
        """One layer equal to ``layers`` side by side (output columns concatenated), or None when they cannot share
        one matmul (act-order ``g_idx``: each layer orders its rows differently; other bits / groups / dtype)."""
        first = layers[0]
        if any(layer.g_idx is not None for layer in layers) or any(
                (layer.bits, layer.group_size, layer.dtype, layer.bias is None)
                != (first.bits, first.group_size, first.dtype, first.bias is None) for layer in layers):
            return None
        cat = lambda name: jnp.concatenate([getattr(layer, name)[...] for layer in layers], axis=-1)  # noqa: E731
        return WeightOnlyLinear(cat("qweight"), cat("scales"), cat("zeros"), None,
                                None if first.bias is None else cat("bias"), bits=first.bits,
                                group_size=first.group_size, dtype=first.dtype, matmul_impl=first.matmul_impl)


def quantize_weight_only(kernel: jax.Array, *, bits: int, group_size: int, zero_point: bool, dtype):
    """Round-to-nearest quantization of ``kernel [in, out]`` into the canonical layout:
    ``(qweight int32[in*bits/32, out], scales dtype[G, out], zeros dtype[G, out])``; ``group_size=-1``: one group.

    Symmetric: ``scale = max|w| / (2^(bits-1) - 1)``, zero ``2^(bits-1)`` (int8 online: vLLM's per-channel
    symmetric int8). Asymmetric: ``scale = (max - min) / (2^bits - 1)``, zero ``round(-min / scale)``.
    Traceable (the loader jits it per shape).
    """
    in_features, out = kernel.shape
    group_size = in_features if group_size == -1 else group_size
    if in_features % group_size:
        raise ValueError(f"quantization: group_size {group_size} does not divide a layer's {in_features} input "
                         f"features")
    groups = in_features // group_size
    w = kernel.astype(jnp.float32).reshape(groups, group_size, out)
    qmax = (1 << bits) - 1
    if zero_point:
        lo = jnp.minimum(w.min(axis=1), 0.0)
        hi = jnp.maximum(w.max(axis=1), 0.0)
        scales = jnp.maximum(hi - lo, 1e-8) / qmax
        zeros = jnp.clip(jnp.round(-lo / scales), 0, qmax)
    else:
        half = 1 << (bits - 1)
        scales = jnp.maximum(jnp.abs(w).max(axis=1), 1e-8) / (half - 1)
        zeros = jnp.full_like(scales, half)
    scales = scales.astype(dtype)
    s32 = scales.astype(jnp.float32)
    q = jnp.clip(jnp.round(w / s32[:, None, :]) + zeros[:, None, :], 0, qmax).astype(jnp.int32)
    return pack_int32(q.reshape(in_features, out), bits), scales, zeros.astype(dtype)


class Fp8Linear(nnx.Module):
    """FP8 projection. ``weight float8_e4m3fn[out, in]`` (the checkpoint's layout, inputs contiguous: Hopper's
    tensor cores read 8-bit operands K-major, and the GEMV reads whole K runs), ``weight_scale float32[out] | [1]``,
    ``input_scale float32[1] | None`` (static scheme), ``bias dtype[out] | None``; ``activation_scheme`` as in
    ``QuantConfig``.
    ``matmul_impl`` (``FP8_IMPLS``) "pallas" / "pallas_blocked" / "xla_native" run weight-only: the activations are
    not quantized (exact up to the bf16 product), whatever the scheme; "xla" keeps the float8 dot (without an
    ``activation_scheme``: the upcast weights in XLA's dot, as "xla_native"); "auto" asks the selector per M as
    format ``FP8_W8A8`` when activations are quantized (on the GPU: weight-only kernels at small M, the float8 dot
    from ``FP8_DOT_MIN_ROWS``; elsewhere "xla"), else as "fp8" (weight-only at every M)."""

    WEIGHT_DTYPE = FP8_DTYPE

    def __init__(self, weight, weight_scale, input_scale=None, bias=None, *, activation_scheme: str | None, dtype,
                 matmul_impl: str = "auto"):
        if activation_scheme not in (None, "static", "dynamic_token", "dynamic_tensor"):
            raise ValueError(f"unknown activation_scheme {activation_scheme!r}")
        if matmul_impl not in FP8_IMPLS:
            raise ValueError(f"matmul_impl of an FP8 layer must be one of {FP8_IMPLS}, got {matmul_impl!r}")
        self.matmul_impl = matmul_impl
        if (activation_scheme == "static") != (input_scale is not None):
            raise ValueError("the static activation scheme needs input_scale (and only it)")
        if jnp.dtype(weight.dtype) != jnp.dtype(self.WEIGHT_DTYPE):
            raise ValueError(f"{type(self).__name__} weights must be {jnp.dtype(self.WEIGHT_DTYPE).name}, got "
                             f"{jnp.dtype(weight.dtype).name}")
        self.weight = nnx.Param(weight)
        self.weight_scale = nnx.Param(weight_scale)
        self.input_scale = _param(input_scale)
        self.bias = _param(bias)
        self.activation_scheme = activation_scheme
        self.out_features = weight.shape[0]
        self.dtype = dtype

    @property
    def selector_format(self) -> str:
        """The format ``resolve_matmul_impl`` is asked about: ``FP8_W8A8`` when activations are quantized."""
        return "fp8" if self.activation_scheme is None else FP8_W8A8

    def __call__(self, x: jax.Array) -> jax.Array:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        w_scale = self.weight_scale[...].astype(jnp.float32)
        impl = resolve_matmul_impl(self.matmul_impl, self.selector_format, x2.shape[0])
        if impl != "xla" or self.activation_scheme is None:  # weight-only ("xla": the upcast in XLA's dot)
            y = _FP8_MATMULS["xla_native" if impl == "xla" else impl](x2.astype(self.dtype), self.weight[...], w_scale)
        else:
            x_q, x_scale = quantize_activations_fp8(
                x2, self.activation_scheme, None if self.input_scale is None else self.input_scale[...])
            y = jax.lax.dot_general(x_q, self.weight[...], (((1,), (1,)), ((), ())),
                                    preferred_element_type=jnp.float32)
            y = y * x_scale * w_scale
        return self._finish(y, lead)

    def _fused(self, table: dict, rows: int) -> Callable | None:
        return table.get(resolve_matmul_impl(self.matmul_impl, self.selector_format, rows))

    def _finish(self, y: jax.Array, lead: tuple) -> jax.Array:
        y = y.astype(self.dtype)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y.reshape(*lead, self.out_features)

    def rms_norm_matmul(self, x: jax.Array, residual: jax.Array, norm_weight: jax.Array, *, eps: float,
                        norm_dtype) -> tuple[jax.Array, jax.Array] | None:
        """``(self(normed), new_residual)`` for ``normed, new_residual = models.norm.rms_norm_reference(x,
        norm_weight, residual, eps=eps, dtype=norm_dtype)`` (``x, residual [..., in]``), as one kernel when this
        layer's implementation has a fused form for x's static shape (``register_fp8_matmul(rms_norm=)``); None
        otherwise: the caller runs the norm and the matmul apart."""
        lead = x.shape[:-1]
        x2, res2 = x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1])
        fused = self._fused(_FP8_RMS_NORM_MATMULS, x2.shape[0])
        if fused is None or jnp.dtype(norm_dtype) != jnp.dtype(self.dtype):
            return None
        out = fused(x2, res2, norm_weight, self.weight[...], self.weight_scale[...].astype(jnp.float32), eps=eps,
                    norm_dtype=jnp.dtype(norm_dtype))
        if out is None:
            return None
        y, new_residual = out
        return self._finish(y, lead), new_residual.reshape(residual.shape)

    def silu_mul_matmul(self, gate_up: jax.Array) -> jax.Array | None:
        """``self(jax.nn.silu(gate) * up)`` for ``gate_up [..., 2 * in]`` = [gate | up], as one kernel when this
        layer's implementation has a fused form for the static shape (``register_fp8_matmul(silu_mul=)``); None
        otherwise."""
        lead = gate_up.shape[:-1]
        rows = gate_up.reshape(-1, gate_up.shape[-1])
        fused = self._fused(_FP8_SILU_MUL_MATMULS, rows.shape[0])
        if fused is None or rows.dtype != jnp.dtype(self.dtype):
            return None
        y = fused(rows, self.weight[...], self.weight_scale[...].astype(jnp.float32))
        return None if y is None else self._finish(y, lead)

    def dequantized_kernel(self, dtype=jnp.float32) -> jax.Array:
        """``dtype[in, out]``, like ``nnx.Linear.kernel``."""
        scale = self.weight_scale[...].astype(jnp.float32).reshape(-1, 1)
        return (self.weight[...].astype(jnp.float32) * scale).T.astype(dtype)

    @staticmethod
    def concat(layers: Sequence["Fp8Linear"]) -> "Fp8Linear | None":
        """Side by side (per-tensor scales become per-channel), or None for static input scales (each layer
        quantizes the shared input with its own scale) or differing schemes."""
        first = layers[0]
        if first.activation_scheme == "static" or any(
                (layer.activation_scheme, layer.dtype, layer.bias is None)
                != (first.activation_scheme, first.dtype, first.bias is None) for layer in layers):
            return None
        scales = [jnp.broadcast_to(layer.weight_scale[...], (layer.out_features,)) for layer in layers]
        bias = None if first.bias is None else jnp.concatenate([layer.bias[...] for layer in layers])
        return type(first)(jnp.concatenate([layer.weight[...] for layer in layers], axis=0),
                         jnp.concatenate(scales), None, bias, activation_scheme=first.activation_scheme,
                         dtype=first.dtype, matmul_impl=first.matmul_impl)


class Int8Linear(Fp8Linear):
    """Online int8 projection: ``weight int8[out, in]`` (symmetric: ``w = q * weight_scale``, ``q`` in -127..127),
    ``weight_scale float32[out]``, ``bias dtype[out] | None``; weight-only (``activation_scheme`` None). It runs
    ``Fp8Linear``'s weight-only paths: XLA's dot on the upcast weights, and the 8-bit ``[N, K]`` Pallas kernels,
    which upcast an int8 tile exactly as they do an e4m3 one."""

    WEIGHT_DTYPE = jnp.int8

    def __init__(self, weight, weight_scale, input_scale=None, bias=None, *, activation_scheme: str | None = None,
                 dtype, matmul_impl: str = "auto"):
        if activation_scheme is not None or input_scale is not None:
            raise ValueError("Int8Linear is weight-only: activation_scheme and input_scale must be None")
        super().__init__(weight, weight_scale, None, bias, activation_scheme=None, dtype=dtype,
                         matmul_impl=matmul_impl)


def compiler_options(model: nnx.Module) -> dict[str, float]:
    """XLA options (``jax.jit(..., compiler_options=)``) for the programs that run ``model``: empty, unless it holds
    a float8 dot (an ``Fp8Linear`` that quantizes its activations, with ``matmul_impl`` "xla" or "auto"):
    ``FLOAT8_DOT_COMPILER_OPTIONS``, the GEMM autotuner's tolerance widened to ``FLOAT8_DOT_AUTOTUNE_RTOL`` (for
    every GEMM of the program: XLA takes it per compile). Ignored by backends without GEMM autotuning (CPU)."""
    if any(isinstance(node, Fp8Linear) and node.activation_scheme is not None and node.matmul_impl in ("auto", "xla")
           for _, node in nnx.iter_graph(model)):
        return dict(FLOAT8_DOT_COMPILER_OPTIONS)
    return {}


def quantize_activations_fp8(x: jax.Array, scheme: str, input_scale=None) -> tuple[jax.Array, jax.Array]:
    """``x[M, K]`` -> ``(float8_e4m3fn[M, K], float32 scale [M, 1] (per token) or [1, 1])`` with
    ``x ~ q * scale``; ``scale = max|x| / 448`` over each row (``dynamic_token``) or the tensor
    (``dynamic_tensor``), or ``input_scale`` (``static``)."""
    x32 = x.astype(jnp.float32)
    if scheme == "static":
        scale = input_scale.astype(jnp.float32).reshape(1, 1)
    else:
        amax = jnp.max(jnp.abs(x32), axis=-1, keepdims=True)
        if scheme == "dynamic_tensor":
            amax = jnp.max(amax, keepdims=True)
        scale = jnp.maximum(amax / FP8_MAX, _MIN_ACTIVATION_SCALE)
    return jnp.clip(x32 / scale, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE), scale


def quantize_weight_fp8(kernel: jax.Array, strategy: str = "channel") -> tuple[jax.Array, jax.Array]:
    """``kernel [in, out]`` -> ``(float8_e4m3fn[out, in]`` (``Fp8Linear``'s layout), ``float32 scale [out]`` (channel)
    or ``[1]`` (tensor)``)``."""
    w = kernel.astype(jnp.float32).T
    amax = jnp.max(jnp.abs(w), axis=1) if strategy == "channel" else jnp.max(jnp.abs(w)).reshape(1)
    scale = jnp.maximum(amax, 1e-12) / FP8_MAX
    return jnp.clip(w / scale.reshape(-1, 1), -FP8_MAX, FP8_MAX).astype(FP8_DTYPE), scale


def quantize_weight_int8(kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``kernel [in, out]`` -> ``(int8[out, in]`` (``Int8Linear``'s layout), ``float32 scale [out]``)``: symmetric
    per output channel, ``scale = max|w| / 127``, round to nearest."""
    w = kernel.astype(jnp.float32).T
    scale = jnp.maximum(jnp.max(jnp.abs(w), axis=1), 1e-12) / 127.0
    return jnp.clip(jnp.round(w / scale[:, None]), -127, 127).astype(jnp.int8), scale


register_fp8_matmul("xla_native", native.fp8_upcast_matmul)

QUANTIZED_LINEAR_TYPES = (WeightOnlyLinear, Fp8Linear)  # Int8Linear is an Fp8Linear
