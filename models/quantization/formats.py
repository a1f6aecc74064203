"""On-disk layouts of quantized projections -> the canonical arrays of ``models.quantization.linear`` (numpy, host).

Each quantized projection ``<module>`` (e.g. ``model.layers.0.self_attn.q_proj``) is stored as:
  * AWQ (GEMM): ``qweight int32[in, out/8]`` packed along the outputs in AWQ's order (nibble ``i`` of a word holds
    column ``AWQ_PACK_ORDER[i]`` of its block of 8), ``qzeros int32[in/g, out/8]`` packed the same way,
    ``scales float16[in/g, out]``; ``w = (q - z) * s``.
  * GPTQ: ``qweight int32[in*bits/32, out]`` packed along the inputs (already canonical), ``qzeros
    int32[G, out*bits/32]`` packed along the outputs in order, ``scales float16[G, out]``, ``g_idx int32[in]``;
    v1 (``checkpoint_format="gptq"``) stores ``zero - 1``; ``w = (q - z) * s[g_idx]``.
  * FP8 (compressed-tensors float-quantized, vLLM ``fp8``): ``weight float8_e4m3fn[out, in]``, ``weight_scale``
    (``[]``/``[1]`` per tensor, ``[out, 1]`` per channel), optional ``input_scale`` (static activations).
KV-cache scales (FP8 KV): ``self_attn.k_scale`` / ``v_scale`` (or vLLM's older spellings, ``KV_SCALE_NAMES``).
"""

from __future__ import annotations

import numpy as np

from models.quantization.config import QuantConfig

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Checkpoint names of a layer's KV-cache scales, relative to ``model.layers.{i}.self_attn``; the first one present
# is used (vLLM's remapping of the spellings quantizers have written).
KV_SCALE_NAMES = {"k": ("k_scale", "k_proj.k_scale", "k_proj.output_scale", "attn.k_scale"),
                  "v": ("v_scale", "v_proj.v_scale", "v_proj.output_scale", "attn.v_scale")}


def projection_tensor_names(qc: QuantConfig, module: str) -> tuple[list[str], list[str]]:
    """(required, optional) checkpoint tensor names of one quantized projection (bias handled by the caller)."""
    if qc.method == "awq":
        return [f"{module}.qweight", f"{module}.qzeros", f"{module}.scales"], []
    if qc.method == "gptq":
        return [f"{module}.qweight", f"{module}.qzeros", f"{module}.scales"], [f"{module}.g_idx"]
    optional = [f"{module}.weight_zero_point", f"{module}.input_zero_point"]
    required = [f"{module}.weight", f"{module}.weight_scale"]
    if qc.activation_scheme == "static":
        required.append(f"{module}.input_scale")
    else:
        optional.append(f"{module}.input_scale")  # dynamic checkpoints may still ship a calibration-time scale
    return required, optional


def _unpack_columns(packed: np.ndarray, bits: int, order=None) -> np.ndarray:
    """``int32[R, C*pack]`` packed along columns -> ``int32[R, C*pack]`` unsigned values in natural column order."""
    pack = 32 // bits
    words = packed.astype(np.int64) & 0xFFFFFFFF
    shifts = np.arange(pack, dtype=np.int64) * bits
    nibbles = (words[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)  # [R, C, pack]: nibble i
    if order is not None:  # nibble i holds column order[i]: place it there
        values = np.empty_like(nibbles)
        values[:, :, list(order)] = nibbles
        nibbles = values
    return nibbles.reshape(packed.shape[0], -1).astype(np.int32)


def pack_rows(values: np.ndarray, bits: int) -> np.ndarray:
    """``int[in, out]`` unsigned values -> ``int32[in*bits/32, out]`` packed along rows (the canonical layout)."""
    pack = 32 // bits
    v = values.astype(np.uint32).reshape(values.shape[0] // pack, pack, values.shape[1])
    shifts = (np.arange(pack, dtype=np.uint32) * bits)[None, :, None]
    return np.bitwise_or.reduce(v << shifts, axis=1).astype(np.uint32).view(np.int32)


def _check_shape(name: str, array: np.ndarray, expected: tuple[int, ...]) -> None:
    if tuple(array.shape) != tuple(expected):
        raise ValueError(f"tensor {name!r} has shape {tuple(array.shape)} but the model expects {tuple(expected)}")


def convert_projection(qc: QuantConfig, module: str, tensors: dict[str, np.ndarray], in_features: int,
                       out_features: int) -> dict:
    """One projection's checkpoint tensors -> the keyword arguments of its quantized module (numpy arrays; float
    arrays in float32, cast by the caller). Shapes are checked against ``in_features`` / ``out_features``."""
    if qc.method == "awq":
        return _convert_awq(qc, module, tensors, in_features, out_features)
    if qc.method == "gptq":
        return _convert_gptq(qc, module, tensors, in_features, out_features)
    return _convert_fp8(qc, module, tensors, in_features, out_features)


def _convert_awq(qc, module, tensors, in_features, out_features) -> dict:
    groups = in_features // qc.group_size
    if in_features % qc.group_size or out_features % 8 or in_features % 8:
        raise ValueError(f"{module}: [{in_features}, {out_features}] does not fit AWQ group_size {qc.group_size}")
    qweight, qzeros, scales = (tensors[f"{module}.{n}"] for n in ("qweight", "qzeros", "scales"))
    _check_shape(f"{module}.qweight", qweight, (in_features, out_features // 8))
    _check_shape(f"{module}.qzeros", qzeros, (groups, out_features // 8))
    _check_shape(f"{module}.scales", scales, (groups, out_features))
    values = _unpack_columns(qweight, 4, AWQ_PACK_ORDER)  # [in, out]
    zeros = _unpack_columns(qzeros, 4, AWQ_PACK_ORDER)  # [G, out]
    return dict(kind="weight_only", qweight=pack_rows(values, 4), scales=scales.astype(np.float32),
                zeros=zeros.astype(np.float32), g_idx=None, bits=4, group_size=qc.group_size)


def _convert_gptq(qc, module, tensors, in_features, out_features) -> dict:
    bits, pack = qc.bits, 32 // qc.bits
    group_size = in_features if qc.group_size == -1 else qc.group_size
    if in_features % group_size or in_features % pack or out_features % pack:
        raise ValueError(f"{module}: [{in_features}, {out_features}] does not fit GPTQ bits={bits} "
                         f"group_size={qc.group_size}")
    groups = in_features // group_size
    qweight, qzeros, scales = (tensors[f"{module}.{n}"] for n in ("qweight", "qzeros", "scales"))
    _check_shape(f"{module}.qweight", qweight, (in_features // pack, out_features))
    _check_shape(f"{module}.qzeros", qzeros, (groups, out_features // pack))
    _check_shape(f"{module}.scales", scales, (groups, out_features))
    zeros = _unpack_columns(qzeros, bits) + qc.gptq_zero_offset
    g_idx = tensors.get(f"{module}.g_idx")
    if g_idx is not None:
        _check_shape(f"{module}.g_idx", g_idx, (in_features,))
        g_idx = g_idx.astype(np.int32)
        if g_idx.min() < 0 or g_idx.max() >= groups:
            raise ValueError(f"{module}.g_idx has groups outside [0, {groups})")
        if np.array_equal(g_idx, np.arange(in_features, dtype=np.int32) // group_size):
            g_idx = None  # contiguous groups (no act-order): the faster broadcast path
    return dict(kind="weight_only", qweight=qweight.astype(np.int32), scales=scales.astype(np.float32),
                zeros=zeros.astype(np.float32), g_idx=g_idx, bits=bits, group_size=group_size)


def _convert_fp8(qc, module, tensors, in_features, out_features) -> dict:
    weight = tensors[f"{module}.weight"]
    _check_shape(f"{module}.weight", weight, (out_features, in_features))
    if weight.dtype != np.dtype("float8_e4m3fn"):
        raise ValueError(f"tensor {module}.weight is {weight.dtype}, expected float8_e4m3fn (F8_E4M3)")
    for zp in ("weight_zero_point", "input_zero_point"):
        if f"{module}.{zp}" in tensors and np.any(tensors[f"{module}.{zp}"] != 0):
            raise ValueError(f"{module}.{zp}: asymmetric FP8 is not supported")
    scale = tensors[f"{module}.weight_scale"].astype(np.float32)
    if scale.size == 1:
        scale = scale.reshape(1)
    elif scale.size == out_features:
        scale = scale.reshape(out_features)
    else:
        raise ValueError(f"tensor {module}.weight_scale has shape {scale.shape}: expected one scale per tensor or "
                         f"per output channel ({out_features})")
    input_scale = None
    if qc.activation_scheme == "static":
        input_scale = tensors[f"{module}.input_scale"].astype(np.float32)
        if input_scale.size != 1:
            raise ValueError(f"tensor {module}.input_scale has shape {input_scale.shape}: expected one scale")
        input_scale = input_scale.reshape(1)
    return dict(kind="fp8", weight=weight, weight_scale=scale, input_scale=input_scale)  # [out, in], as stored
