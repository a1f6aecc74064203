"""RMSNorm fused with the residual add before it, as one Pallas (Triton) kernel: vLLM's ``fused_add_rms_norm``.

XLA builds a decoder norm as two kernels (the sum of squares, then the scaling) and the residual add before it as a
third; at small batches each is a launch that moves a few kilobytes. ``rms_norm_pallas`` does all three in one
launch with two outputs (the normed rows and the new residual), one program per row: the row is loaded once, the
sum of squares reduced in registers, and both results stored.

The math and its rounding steps are ``models.norm.rms_norm_reference``'s (the ``"xla"`` implementation and this
kernel's oracle): the residual add rounds to the input dtype, the normalization runs in float32 and rounds to the
compute dtype, the scale multiplies in the compute dtype. Sums of two and products of two 16-bit floats are formed
exactly in float32 and rounded once, so those steps agree bit for bit with XLA's; the normed rows differ from the
reference only by the float32 order of the sum of squares.

Importing this module registers the kernel as ``rms_norm_impl="pallas"`` and the ``"auto"`` selector
(``auto_impl``) with ``models.norm``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from models.norm import register_rms_norm, register_rms_norm_selector, rms_norm_reference
from paged_jax.ops.ragged_paged_attention.common import TRITON_COMPILER_PARAMS as _CompilerParams
from paged_jax.ops.ragged_paged_attention.common import next_pow2 as _next_pow2
from paged_jax.ops.ragged_paged_attention.common import triton_load as _load, triton_store as _store

# Dtypes the kernel takes (rows, residual and output).
KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
# Widest row "auto" gives the kernel: one program holds the whole row (next power of two) in registers, so much
# wider rows would spill; the checked shapes go up to 8192 (Llama-3-70B's hidden size).
AUTO_MAX_HIDDEN = 8192


def _rms_norm_kernel(*refs, hidden: int, tile: int, eps: float, has_residual: bool, dtype, unit_offset: bool):
    """Program i: row i. refs: x [N, H], (residual [N, H]), weight [H], then out [N, H], (new_residual [N, H])."""
    if has_residual:
        x_ref, res_ref, w_ref, out_ref, new_res_ref = refs
    else:
        x_ref, w_ref, out_ref = refs
    row = pl.program_id(0)
    col = jnp.arange(tile, dtype=jnp.int32)
    in_range = col < hidden
    load_col = jnp.where(in_range, col, 0)
    store_col = jnp.where(in_range, col, hidden)  # masked off; out of range for interpret mode too
    x = _load(x_ref.at[row, load_col], mask=in_range)
    if has_residual:
        # Exact in float32, rounded once to the row dtype: XLA's add of two 16-bit floats.
        summed = (x.astype(jnp.float32) + _load(res_ref.at[row, load_col], mask=in_range).astype(jnp.float32))
        x = summed.astype(x_ref.dtype)
        _store(new_res_ref.at[row, store_col], x, mask=in_range)
    x32 = jnp.where(in_range, x.astype(jnp.float32), 0.0)
    variance = jnp.sum(x32 * x32) / hidden
    if unit_offset:  # Gemma: scale by 1 + weight in float32, one rounding
        weight32 = _load(w_ref.at[load_col], mask=in_range).astype(jnp.float32)
        out = (x32 * jax.lax.rsqrt(variance + eps) * (1.0 + weight32)).astype(dtype)
        _store(out_ref.at[row, store_col], out, mask=in_range)
        return
    normed = (x32 * jax.lax.rsqrt(variance + eps)).astype(dtype)
    weight = _load(w_ref.at[load_col], mask=in_range).astype(dtype)
    # The product of two values of the compute dtype, formed in float32 and rounded once (exact for 16-bit).
    out = (weight.astype(jnp.float32) * normed.astype(jnp.float32)).astype(dtype)
    _store(out_ref.at[row, store_col], out, mask=in_range)


def rms_norm_pallas(x: jax.Array, weight: jax.Array, residual: jax.Array | None = None, *, eps: float, dtype=None,
                    unit_offset: bool = False, interpret: bool = False):
    """``models.norm.rms_norm_reference`` on rows, as one Pallas Triton kernel (one program per row).

    Args:
      x: ``[N, H]`` bf16 / fp16 / fp32; residual: None or ``[N, H]`` of ``x``'s dtype.
      weight: ``[H]``, any float dtype (cast to ``dtype``).
      eps: variance epsilon; dtype: compute dtype of the normed rows (default ``x.dtype``).
      unit_offset: scale by ``1 + weight`` in float32 (Gemma's norm; see ``rms_norm_reference``).
      interpret: run in Pallas interpret mode (CPU tests).
    Returns:
      ``normed dtype[N, H]``, or with a residual ``(normed, x + residual)`` (``x.dtype[N, H]``).
    N == 0 returns empty arrays without a launch.
    """
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    if x.ndim != 2:
        raise ValueError(f"x must be [N, H], got shape {x.shape}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual must match x ({x.shape} {x.dtype}), got {residual.shape} {residual.dtype}")
    if weight.shape != (x.shape[1],):
        raise ValueError(f"weight must be [{x.shape[1]}], got shape {weight.shape}")
    if jnp.dtype(x.dtype) not in KERNEL_DTYPES or dtype not in KERNEL_DTYPES:
        raise ValueError(f"rms_norm_pallas takes {', '.join(str(d) for d in KERNEL_DTYPES)}; got x {x.dtype}, "
                         f"dtype {dtype}")
    num_rows, hidden = x.shape
    if num_rows == 0:
        return rms_norm_reference(x, weight, residual, eps=eps, dtype=dtype, unit_offset=unit_offset)
    tile = _next_pow2(hidden)
    has_residual = residual is not None
    kernel = functools.partial(_rms_norm_kernel, hidden=hidden, tile=tile, eps=float(eps),
                               has_residual=has_residual, dtype=dtype, unit_offset=bool(unit_offset))
    out_shape = [jax.ShapeDtypeStruct((num_rows, hidden), dtype)]
    if has_residual:
        out_shape.append(jax.ShapeDtypeStruct((num_rows, hidden), x.dtype))
    inputs = (x, residual, weight) if has_residual else (x, weight)
    outs = pl.pallas_call(
        kernel,
        grid=(num_rows,),
        out_shape=out_shape,
        interpret=interpret,
        # As Triton's layer-norm tutorial: 256 elements per warp, 1 to 8 warps.
        compiler_params=_CompilerParams(num_warps=min(max(tile // 256, 1), 8), num_stages=1),
        name="fused_add_rms_norm" if has_residual else "rms_norm",
    )(*inputs)
    return (outs[0], outs[1]) if has_residual else outs[0]


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4, 5, 6))
def _differentiable(x, weight, residual, eps, dtype, unit_offset, interpret):
    return rms_norm_pallas(x, weight, residual, eps=eps, dtype=dtype, unit_offset=unit_offset, interpret=interpret)


@_differentiable.defjvp
def _differentiable_jvp(eps, dtype, unit_offset, interpret, primals, tangents):
    # The reference's derivative, recomputed: the kernel has no autodiff rule of its own. A JVP rule (linear in the
    # tangents) serves forward mode (jax.jvp) and, transposed by JAX, reverse mode (jax.grad) alike.
    out = _differentiable(*primals, eps, dtype, unit_offset, interpret)
    _, tangent_out = jax.jvp(lambda x, w, r: rms_norm_reference(x, w, r, eps=eps, dtype=dtype,
                                                                unit_offset=unit_offset), primals, tangents)
    return out, tangent_out


def rms_norm_pallas_differentiable(x: jax.Array, weight: jax.Array, residual: jax.Array | None = None, *,
                                   eps: float, dtype=None, unit_offset: bool = False, interpret: bool = False):
    """``rms_norm_pallas`` with the derivatives of ``rms_norm_reference`` (forward and reverse mode), so a model on the
    kernel stays differentiable (``paged_jax.research.scoring.score_tokens`` under ``jax.grad``). What ``rms_norm_impl="pallas"``
    runs."""
    dtype = x.dtype if dtype is None else jnp.dtype(dtype)
    return _differentiable(x, weight, residual, float(eps), dtype, bool(unit_offset), interpret)


def auto_impl(num_rows: int, hidden: int, dtype) -> str:
    """``rms_norm_impl="auto"`` for a static ``[num_rows, hidden]`` batch: the kernel on a GPU for its dtypes and
    rows up to ``AUTO_MAX_HIDDEN`` wide, else "xla"."""
    if (jax.default_backend() == "gpu" and num_rows > 0 and hidden <= AUTO_MAX_HIDDEN
            and jnp.dtype(dtype) in KERNEL_DTYPES):
        return "pallas"
    return "xla"


register_rms_norm("pallas", rms_norm_pallas_differentiable)
register_rms_norm_selector(auto_impl)

__all__ = ["AUTO_MAX_HIDDEN", "KERNEL_DTYPES", "auto_impl", "rms_norm_pallas", "rms_norm_pallas_differentiable"]
