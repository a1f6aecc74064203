"""RMSNorm, alone or fused with the residual add before it (vLLM's ``rms_norm`` / ``fused_add_rms_norm``).

The math is Hugging Face's Llama RMSNorm, with its rounding steps: for ``x, residual: dtype[..., H]``

    new_residual = x + residual                                    # in dtype (the decoder's residual add)
    s = float32(new_residual)
    normed = weight.astype(dtype) * (s * rsqrt(mean(s * s) + eps)).astype(dtype)

and, with ``unit_offset`` (Gemma's norm: the weight is stored as an offset from 1, the product rounds once)

    normed = (s * rsqrt(mean(s * s) + eps) * (1 + float32(weight))).astype(dtype)

``rms_norm_reference`` is that, in jnp: the ``"xla"`` implementation (XLA fuses it as it can) and the oracle of any
other. Other implementations register themselves here (``register_rms_norm``; the Pallas kernel of
``paged_jax.ops.rms_norm`` does when ``paged_jax.ops`` is imported, and with it the selector of ``"auto"``), so
``models`` never imports ``paged_jax``. Without a selector ``"auto"`` is ``"xla"``.

Implementations take a 2-D batch of rows ``[N, H]``; ``rms_norm`` flattens the leading axes.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from models.impl_registry import ImplRegistry

RMS_NORM_IMPLS = ("auto", "xla", "pallas", "batch_invariant")

# fn(x [N, H], weight [H], residual [N, H] | None, *, eps, dtype, unit_offset) -> normed | (normed, new_residual);
# "auto" selector fn(num_rows, hidden, dtype) -> implementation name
_REGISTRY = ImplRegistry("rms_norm_impl", RMS_NORM_IMPLS)


def register_rms_norm(name: str, fn: Callable) -> None:
    """Make ``fn(x [N, H], weight [H], residual [N, H] | None, *, eps: float, dtype, unit_offset: bool) -> normed
    dtype[N, H] | (normed, new_residual x.dtype[N, H])`` the implementation ``name`` (one of ``RMS_NORM_IMPLS``)."""
    _REGISTRY.register(name, fn)


def register_rms_norm_selector(fn: Callable[[int, int, jnp.dtype], str]) -> None:
    """``fn(num_rows, hidden, dtype) -> name`` decides ``impl="auto"`` from static shapes (no recompile at run
    time)."""
    _REGISTRY.register_selector(fn)


def check_rms_norm_impl(impl: str) -> str:
    """``impl`` itself, or a ValueError naming ``rms_norm_impl``."""
    return _REGISTRY.check(impl)


def resolve_rms_norm_impl(impl: str, num_rows: int, hidden: int, dtype) -> str:
    """The implementation ``impl`` runs for a static ``[num_rows, hidden]`` batch of ``dtype``."""
    return _REGISTRY.resolve(impl, num_rows, hidden, jnp.dtype(dtype))


def rms_norm_reference(x: jax.Array, weight: jax.Array, residual: jax.Array | None = None, *, eps: float,
                       dtype=None, unit_offset: bool = False):
    """The jnp RMSNorm (see the module docstring) over the last axis.

    Args:
      x: ``[..., H]``; residual: None or the same shape and dtype as ``x``.
      weight: ``[H]`` (any float dtype; cast to ``dtype``).
      eps: the variance epsilon (``ModelConfig.rms_norm_eps``).
      dtype: the compute dtype of the output (default ``x.dtype``).
      unit_offset: scale by ``1 + weight`` in float32 (Gemma's RMSNorm) instead of by ``weight`` in ``dtype``.
    Returns:
      ``normed dtype[..., H]`` without a residual; with one ``(normed, new_residual x.dtype[..., H])``, where
      ``new_residual = x + residual`` is also what was normalized.
    """
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    if residual is not None:
        x = x + residual
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    if unit_offset:
        normed = (x32 * jax.lax.rsqrt(variance + eps) * (1.0 + weight.astype(jnp.float32))).astype(dtype)
    else:
        normed = weight.astype(dtype) * (x32 * jax.lax.rsqrt(variance + eps)).astype(dtype)
    return normed if residual is None else (normed, x)


register_rms_norm("xla", rms_norm_reference)


def rms_norm(x: jax.Array, weight: jax.Array, residual: jax.Array | None = None, *, eps: float, dtype=None,
             impl: str = "auto", unit_offset: bool = False):
    """RMSNorm of ``x`` (``[..., H]``), fused with ``x + residual`` when ``residual`` is given, by implementation
    ``impl`` (``RMS_NORM_IMPLS``; "auto": the registered selector's choice for the static shape, else "xla").
    Same arguments and results as ``rms_norm_reference``."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({x.shape} {x.dtype}), got {residual.shape} {residual.dtype}")
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"weight must be [{x.shape[-1]}] to match x, got shape {weight.shape}")
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    num_rows = rows.shape[0]
    name = resolve_rms_norm_impl(impl, num_rows, hidden, dtype)
    if name == "xla":  # no reshape: XLA fuses the jnp form with its neighbours as it likes
        return rms_norm_reference(x, weight, residual, eps=eps, dtype=dtype, unit_offset=unit_offset)
    res_rows = None if residual is None else residual.reshape(-1, hidden)
    out = _REGISTRY[name](rows, weight, res_rows, eps=eps, dtype=dtype, unit_offset=unit_offset)
    if residual is None:
        return out.reshape(x.shape)
    normed, new_residual = out
    return normed.reshape(x.shape), new_residual.reshape(x.shape)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a learned ``scale`` (HF ``weight``), optionally fused with the residual add
    before it: ``norm(x)`` -> normed; ``norm(x, residual)`` -> ``(normed, x + residual)`` (vLLM's layer contract).

    ``impl`` (static, one of ``RMS_NORM_IMPLS``) picks the implementation; ``models.llama.set_rms_norm_impl`` sets it
    on a model's decoder norms. ``unit_offset`` (static): Gemma's norm, which scales by ``1 + scale`` (its weights,
    and so its initial ``scale``, are 0).
    """

    def __init__(self, dim: int, *, eps: float, dtype, param_dtype, impl: str = "auto", rngs: nnx.Rngs | None = None,
                 unit_offset: bool = False):
        self.scale = nnx.Param(jnp.full((dim,), 0.0 if unit_offset else 1.0, dtype=param_dtype))
        self.unit_offset = unit_offset
        self.eps = eps
        self.dtype = dtype
        self.impl = check_rms_norm_impl(impl)

    def runs_kernel(self, x: jax.Array) -> bool:
        """Whether this norm runs as a kernel (not ``"xla"``) on ``x [..., H]``'s static shape; a projection may then
        take it into its own kernel (``models.llama.norm_then_project``)."""
        rows = x.size // x.shape[-1] if x.shape[-1] else 0
        return resolve_rms_norm_impl(self.impl, rows, x.shape[-1], self.dtype) != "xla"

    def __call__(self, x: jax.Array, residual: jax.Array | None = None):
        return rms_norm(x, self.scale[...], residual, eps=self.eps, dtype=self.dtype, impl=self.impl,
                        unit_offset=self.unit_offset)
