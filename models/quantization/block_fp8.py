"""Block-FP8 weights (DeepSeek-V3's published checkpoints: ``quantization_config`` ``quant_method`` "fp8" with
``weight_block_size [rows, cols]``): each projection's ``weight float8_e4m3fn[out, in]`` beside ``weight_scale_inv
float32[ceil(out / rows), ceil(in / cols)]``, one scale per block, ``w = float(weight) * scale_inv[block]``.

The engine's FP8 layers (``models.quantization.linear.Fp8Linear``) scale per tensor or per channel, not per block:
the loader dequantizes these weights to the model dtype as it reads them (``ModelConfig.fp8_weight_block``).
``quantize`` writes such tensors for test checkpoints.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
SCALE_SUFFIX = "_scale_inv"  # a quantized ``X.weight``'s scales are ``X.weight_scale_inv``


def scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a ``[out, in]`` weight."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def dequantize(weight: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """``weight float8_e4m3fn[out, in]``, ``scale_inv [ceil(out / rows), ceil(in / cols)]`` -> ``float32[out, in]``;
    ValueError naming the shapes when the scales do not tile the weight."""
    if weight.ndim != 2 or tuple(scale_inv.shape) != scale_shape(weight.shape, block):
        raise ValueError(f"block-FP8 weight {tuple(weight.shape)} needs weight_scale_inv of shape "
                         f"{scale_shape(weight.shape, block) if weight.ndim == 2 else '?'} for blocks {block}, got "
                         f"{tuple(scale_inv.shape)}")
    out_dim, in_dim = weight.shape
    scales = np.repeat(np.repeat(scale_inv.astype(np.float32), block[0], axis=0), block[1], axis=1)
    return weight.astype(np.float32) * scales[:out_dim, :in_dim]


def quantize(weight: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """``float32[out, in]`` -> ``(float8_e4m3fn[out, in], float32 weight_scale_inv)``: each block scaled so its
    largest magnitude is ``FP8_MAX`` (test checkpoints in the published layout)."""
    out_dim, in_dim = weight.shape
    rows, cols = scale_shape(weight.shape, block)
    padded = np.zeros((rows * block[0], cols * block[1]), np.float32)
    padded[:out_dim, :in_dim] = weight
    blocks = padded.reshape(rows, block[0], cols, block[1])
    amax = np.abs(blocks).max(axis=(1, 3))
    scale_inv = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    scaled = blocks / scale_inv[:, None, :, None]
    quantized = scaled.reshape(padded.shape)[:out_dim, :in_dim].astype(ml_dtypes.float8_e4m3fn)
    return quantized, scale_inv
