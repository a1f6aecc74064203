"""What happens to q and k between the q/k/v projections and attention: RoPE (in halves, or Llama 4's interleaved
pairs; none on a NoPE layer), the per-head q/k RMSNorm (Qwen3's; Llama 4's weightless L2 norm), the FP8 KV cache's
scaling and Llama 4's per-token attention temperature on q, described by one small pytree (``QKTransform``) and
applied by ``apply_qk_transform``.

The model builds a ``QKTransform`` per layer and either applies it itself (jnp, the reference math) or hands it,
with the un-normed, un-rotated q/k, to an ``AttentionFn`` that declares ``fuses_qk_transform`` (e.g. the paged
attention of ``paged_jax.ops``, which runs the transform and the KV write as one kernel on a GPU). Both give the
same q, k, v: ``apply_qk_transform`` is the one definition of the math.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.norm import rms_norm_reference


@functools.lru_cache(maxsize=32)
def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling_items: tuple | None) -> np.ndarray:
    """RoPE inverse frequencies, float32[head_dim // 2], plain or scaled (``ModelConfig.rope_scaling``: llama3,
    linear, longrope, yarn).
    ``head_dim``: the rotated dims (``ModelConfig.rotary_dim`` when only part of a head rotates).

    Computed in float32 the way transformers does, so fp32 logits match it to rounding.
    ``rope_scaling_items`` is ``tuple(sorted(rope_scaling.items()))`` (hashable for the cache) or None.
    """
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    if rope_scaling_items is None:
        return (np.float32(1.0) / (np.float32(rope_theta) ** exponents)).astype(np.float32)
    scaling = dict(rope_scaling_items)
    if scaling["rope_type"] == "longrope":  # per-frequency factors: 1 / (factor * theta ** (2i / d))
        factors = np.asarray(scaling["long_factor" if scaling["use_long_factors"] else "short_factor"], np.float32)
        return (np.float32(1.0) / (factors * np.float32(rope_theta) ** exponents)).astype(np.float32)
    inv_freq = (np.float32(1.0) / (np.float32(rope_theta) ** exponents)).astype(np.float32)
    if scaling["rope_type"] == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if scaling["rope_type"] == "yarn":
        return _yarn_inv_freq(head_dim, float(rope_theta), scaling)
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    # Long wavelengths (low frequencies) are slowed by `factor`, short ones kept, the band between interpolated.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def _yarn_inv_freq(dim: int, base: float, scaling: dict) -> np.ndarray:
    """YaRN's blend of interpolated (``/ factor``) and kept frequencies over a linear ramp between the correction
    dims of ``beta_fast`` and ``beta_slow`` rotations (transformers' ``_compute_yarn_parameters``)."""
    pos_freqs = (np.float32(base) ** (np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)))
    extrapolation = (np.float32(1.0) / pos_freqs).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(scaling["factor"]) * pos_freqs)).astype(np.float32)
    original = scaling["original_max_position_embeddings"]

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = (np.float32(1.0) - ramp.astype(np.float32)).astype(np.float32)
    return (interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor).astype(np.float32)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray, attention_factor: float = 1.0
                 ) -> tuple[jax.Array, jax.Array]:
    """positions int32[T] -> (cos, sin), each float32[T, 1, R/2] for ``inv_freq`` float32[R/2], both multiplied by
    ``attention_factor`` (LongRoPE's and YaRN's; 1 otherwise);
    computed once per forward, shared by the layers using it."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # [T, R/2]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    if attention_factor != 1.0:
        cos, sin = cos * np.float32(attention_factor), sin * np.float32(attention_factor)
    return cos, sin


def rope_tables(config, positions: jax.Array) -> tuple:
    """The ``rope_cos_sin`` tables of a forward over ``positions`` int32[T] for a ``models.config.ModelConfig``:
    the model's RoPE first, then (Gemma 3, ``local_rope_theta``) the sliding layers' own; ``rope_table_index``
    says which one a layer uses. With ``attn_temperature`` (Llama 4) the last entry is the NoPE layers' q scales,
    ``attn_temperature_scales``' float32[T, 1, 1]."""
    rotary_dim = config.rotary_dim or config.head_dim
    scaling = config.rope_scaling
    inv_freq = rope_inv_freq(rotary_dim, float(config.rope_theta),
                             None if scaling is None else tuple(sorted(scaling.items())))
    factor = 1.0 if scaling is None else scaling.get("attention_factor", 1.0)
    tables = [rope_cos_sin(positions, inv_freq, factor)]
    if config.local_rope_theta is not None:
        tables.append(rope_cos_sin(positions, rope_inv_freq(rotary_dim, float(config.local_rope_theta), None)))
    if config.attn_temperature is not None:
        tables.append(attn_temperature_scales(positions, *config.attn_temperature))
    return tuple(tables)


def attn_temperature_scales(positions: jax.Array, floor_scale: float, attn_scale: float) -> jax.Array:
    """Llama 4's attention temperature of the NoPE layers: positions int32[T] -> float32[T, 1, 1], ``log1p(floor((p
    + 1) / floor_scale)) * attn_scale + 1`` (transformers' Llama4TextAttention, in float32)."""
    pos = positions.astype(jnp.float32)
    scales = jnp.log1p(jnp.floor((pos + 1.0) / np.float32(floor_scale))) * np.float32(attn_scale) + 1.0
    return scales[:, None, None]


def rope_table_index(config, layer_idx: int) -> int:
    """Which of ``rope_tables(config, ...)`` layer ``layer_idx`` rotates with."""
    return int(config.local_rope_theta is not None and config.layer_windows[layer_idx] is not None)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool = False) -> jax.Array:
    """Rotate ``x: [T, H, D]`` (HF "rotate_half" layout) in float32 by ``rope_cos_sin`` tables of ``R/2`` frequencies:
    the first ``R`` dims rotate, the rest pass through (partial rotary); returns x.dtype. ``interleaved``: frequency
    ``i`` rotates the pair ``(x[2i], x[2i + 1])`` (Llama 4's complex multiply; whole heads only)."""
    x32 = x.astype(jnp.float32)
    if interleaved:
        pairs = x32.reshape(*x.shape[:-1], -1, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1)
        return out.reshape(x.shape).astype(x.dtype)
    rotary_dim = 2 * cos.shape[-1]
    half = rotary_dim // 2
    x1, x2 = x32[..., :half], x32[..., half:rotary_dim]
    # Equivalent to x * cat(cos, cos) + rotate_half(x) * cat(sin, sin) with rotate_half(x) = cat(-x2, x1).
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x32[..., rotary_dim:]], axis=-1)
    return out.astype(x.dtype)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["cos", "sin", "q_norm_weight", "k_norm_weight", "kv_scale", "q_scale"],
                   meta_fields=["norm_eps", "dtype", "norm_unit_offset", "rope_interleaved"])
@dataclasses.dataclass(frozen=True)
class QKTransform:
    """One layer's q/k transform for a flat batch of T tokens (a pytree: arrays are leaves, the rest static).

    Fields:
      cos, sin: ``rope_cos_sin`` tables, float32[T, 1, R/2] (shared by the layers of a forward using them); R < D
        (partial rotary) rotates the first R dims of each head only. Both None: no RoPE (Llama 4's NoPE layers).
      q_norm_weight, k_norm_weight: the per-head RMSNorm weights, [D] (param dtype), or None (no q/k norm;
        both or neither).
      kv_scale: float32[2] = (k_scale, v_scale) of an FP8 KV cache with scales, or None.
      norm_eps: the q/k norms' epsilon (None without them).
      dtype: the compute dtype the q/k norms cast to (None without them).
      norm_unit_offset: the q/k norms scale by ``1 + weight`` (Gemma 3; ``models.norm.rms_norm_reference``).
      q_scale: None, or float32[T, 1, 1]: q's per-token factor, applied last (Llama 4's attention temperature,
        ``attn_temperature_scales``).
      rope_interleaved: RoPE rotates interleaved pairs (``apply_rope``; Llama 4).
    """

    cos: jax.Array
    sin: jax.Array
    q_norm_weight: jax.Array | None = None
    k_norm_weight: jax.Array | None = None
    kv_scale: jax.Array | None = None
    norm_eps: float | None = None
    dtype: Any = None
    norm_unit_offset: bool = False
    q_scale: jax.Array | None = None
    rope_interleaved: bool = False

    def __post_init__(self):
        if (self.q_norm_weight is None) != (self.k_norm_weight is None):
            raise ValueError("q_norm_weight and k_norm_weight must both be given or both be None")
        if self.q_norm_weight is not None and self.norm_eps is None:
            raise ValueError("norm_eps is required with q/k norm weights")

    @property
    def has_qk_norm(self) -> bool:
        return self.q_norm_weight is not None


def apply_qk_transform(transform: QKTransform, q: jax.Array, k: jax.Array, v: jax.Array):
    """The reference (jnp) transform: q [T, Hq, D], k / v [T, Hkv, D] -> (q, k, v), same shapes and dtypes.

    q/k norm (if any; ``models.norm.rms_norm_reference``) -> RoPE on q and k (float32 math, cast back; none when
    ``cos`` is None) -> with ``kv_scale`` q * k_scale, k / k_scale, v / v_scale (float32 math, cast back): the
    cache then holds k / k_scale and v / v_scale, q . k is unchanged, and the model rescales the attention output
    by v_scale, so attention kernels read the cache without scales -> with ``q_scale`` q * q_scale (float32 math,
    cast back). (Llama 4 normalizes after its RoPE; a rotation keeps each head's norm, so the order is the same.)
    """
    if transform.has_qk_norm:
        offset = transform.norm_unit_offset
        q = rms_norm_reference(q, transform.q_norm_weight, eps=transform.norm_eps, dtype=transform.dtype,
                               unit_offset=offset)
        k = rms_norm_reference(k, transform.k_norm_weight, eps=transform.norm_eps, dtype=transform.dtype,
                               unit_offset=offset)
    if transform.cos is not None:
        q = apply_rope(q, transform.cos, transform.sin, transform.rope_interleaved)
        k = apply_rope(k, transform.cos, transform.sin, transform.rope_interleaved)
    if transform.kv_scale is not None:
        k_scale, v_scale = transform.kv_scale[0], transform.kv_scale[1]
        q, k, v = ((q * k_scale).astype(q.dtype), (k / k_scale).astype(k.dtype), (v / v_scale).astype(v.dtype))
    return scale_q(transform, q), k, v


def scale_q(transform: QKTransform, q: jax.Array) -> jax.Array:
    """q [T, Hq, D] times ``transform.q_scale`` (float32 math, cast back); q itself without one."""
    return q if transform.q_scale is None else (q * transform.q_scale).astype(q.dtype)
