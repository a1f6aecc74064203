"""Block-FP8 weights (DeepSeek-V3's and Qwen3-MoE's published FP8 checkpoints: ``quant_method`` "fp8" with
``weight_block_size [rows, cols]``): each projection's ``weight float8_e4m3fn[out, in]`` beside ``weight_scale_inv
float32[ceil(out / rows), ceil(in / cols)]``, one scale per block, ``w = float(weight) * scale_inv[block]``.

The engine's FP8 layers (``models.quantization.linear.Fp8Linear``) scale per tensor or per channel, not per block:
the loader dequantizes the non-expert projections to the model dtype as it reads them
(``ModelConfig.fp8_weight_block``).
A mixture-of-experts layer's experts stay in float8 on the device (``MoeConfig.expert_format`` "fp8"):
``BlockFp8Experts`` is one stacked projection with its scales, which the grouped matmuls take in place of a float
stack (``models.moe``; the fused MoE kernel dequantizes each tile, ``paged_jax.ops.fused_moe``).
``dequantize`` (numpy, a checkpoint's ``[out, in]``) and ``BlockFp8Experts.dequantize`` (jnp, model layout) give
the float weights; ``quantize`` writes such tensors for test checkpoints.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
SCALE_SUFFIX = "_scale_inv"  # a quantized ``X.weight``'s scales are ``X.weight_scale_inv``


@functools.partial(jax.tree_util.register_dataclass, data_fields=("weight", "scale_inv"), meta_fields=("block",))
@dataclasses.dataclass(frozen=True)
class BlockFp8Experts:
    """One stacked expert projection in block FP8, model layout (a pytree; ``block`` static).

    Fields:
      weight: ``float8_e4m3fn[E, K, N]`` (``[in, out]`` per expert, the checkpoint's ``[out, in]`` transposed).
      scale_inv: ``float32[E, ceil(N / block[0]), ceil(K / block[1])]`` (the checkpoint's orientation): expert
        ``e``'s ``weight[e, k, n]`` means ``float(weight[e, k, n]) * scale_inv[e, n // block[0], k // block[1]]``.
      block: ``(rows, cols)`` of one scale in the checkpoint's ``[out, in]`` (``weight_block_size``).
    """

    weight: jax.Array
    scale_inv: jax.Array
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(E, K, N)``, the float stack's shape."""
        return tuple(self.weight.shape)

    def dequantize(self, dtype) -> jax.Array:
        """``dtype[E, K, N]``: each weight times its block's scale in float32, rounded once to ``dtype``."""
        _, k, n = self.weight.shape
        scales = jnp.repeat(jnp.repeat(self.scale_inv.astype(jnp.float32), self.block[0], axis=1), self.block[1],
                            axis=2)[:, :n, :k]  # [E, N, K]
        return (self.weight.astype(jnp.float32) * jnp.swapaxes(scales, 1, 2)).astype(dtype)


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
