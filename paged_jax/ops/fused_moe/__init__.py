"""The fused mixture-of-experts op: tokens sorted by expert, grouped matmuls for gate/up (with the SwiGLU
activation) and down, and the weighted top-k combine (vLLM's ``fused_moe``).

``moe_experts(x, w_gate, w_up, w_down, topk_weights, topk_ids, impl=...)`` is the op (``models.moe``, where the
model's sparse layers call it; ``moe_experts_with`` takes the grouped matmul itself); its grouped matmuls are, by
``impl``:

* ``"xla"``: ``grouped_matmul_reference`` (``lax.ragged_dot``), the jnp reference, and ``moe_experts_reference``
  the whole op on it;
* ``"pallas"``: ``grouped_matmul_pallas`` (``kernel.py``), one Pallas Triton kernel per grouped matmul, launched as
  ``default_config`` says (``KernelConfig``), on float, block-FP8 (``BlockFp8Experts``) or MXFP4 (``Mxfp4Experts``)
  experts; up to ``models.moe.PAIR_FORM_MAX_PAIRS`` (token, expert) pairs (16 / k tokens: a decode step of one or two
  tokens for top-8 routing) the decode kernels instead (``register_decode_kernels``;
  ``PAGED_JAX_MOE_DECODE_KERNELS=0`` turns them off): for float experts ``pair_experts_pallas`` (``pair_kernel.py``),
  each pair multiplied by its expert unsorted (``models.moe.moe_experts_pairs``), and for every expert format the
  router's softmax and top-k as one kernel (``route_kernel.py``);
* ``"auto"``: ``auto_impl``, the kernel on a GPU for its dtypes and FP8 scale blocks, else XLA.

The reference lives in ``models.moe`` (as the RMSNorm's does in ``models.norm``) so that models run without
``paged_jax``; importing this package registers the kernel there as ``moe_impl="pallas"`` and the ``"auto"``
selector, as ``paged_jax.ops`` does for every kernel.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from models.moe import (grouped_matmul_reference, moe_experts, moe_experts_reference, moe_experts_with,
                        pair_experts_reference, register_grouped_matmul, register_moe_selector, register_pair_experts,
                        register_route_top_k)
from paged_jax.ops.fused_moe.kernel import (KERNEL_DTYPES, KernelConfig, default_config, fp8_scale_block_supported,
                                             grouped_matmul_pallas, tile_schedule)
from paged_jax.ops.fused_moe.pair_kernel import pair_experts_pallas
from paged_jax.ops.fused_moe.route_kernel import route_top_k_pallas


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _differentiable(lhs, rhs, group_sizes, row_index, up_rhs, interpret):
    return grouped_matmul_pallas(lhs, rhs, group_sizes, row_index=row_index, up_rhs=up_rhs, interpret=interpret)


@_differentiable.defjvp
def _differentiable_jvp(interpret, primals, tangents):
    # The reference's derivative: the kernel has no autodiff rule of its own (forward and, transposed by JAX,
    # reverse mode alike).
    lhs, rhs, group_sizes, row_index, up_rhs = primals
    out = _differentiable(*primals, interpret)
    _, tangent_out = jax.jvp(
        lambda a, b, c: grouped_matmul_reference(a, b, group_sizes, row_index=row_index, up_rhs=c),
        (lhs, rhs, up_rhs), (tangents[0], tangents[1], tangents[4]))
    return out, tangent_out


def grouped_matmul_pallas_differentiable(lhs, rhs, group_sizes, *, row_index=None, up_rhs=None,
                                         interpret: bool = False):
    """``grouped_matmul_pallas`` with ``grouped_matmul_reference``'s derivatives, so a model on the kernel stays
    differentiable (``paged_jax.research.scoring.score_tokens`` under ``jax.grad``). What ``moe_impl="pallas"``
    runs."""
    return _differentiable(lhs, rhs, group_sizes, row_index, up_rhs, interpret)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5,))
def _pairs_differentiable(x, w_gate, w_up, w_down, topk_ids, interpret):
    return pair_experts_pallas(x, w_gate, w_up, w_down, topk_ids, interpret=interpret)


@_pairs_differentiable.defjvp
def _pairs_differentiable_jvp(interpret, primals, tangents):
    # The reference's derivative, as for the grouped kernel.
    x, w_gate, w_up, w_down, topk_ids = primals
    out = _pairs_differentiable(*primals, interpret)
    _, tangent_out = jax.jvp(lambda *ws: pair_experts_reference(*ws, topk_ids), (x, w_gate, w_up, w_down),
                             tangents[:4])
    return out, tangent_out


def pair_experts_pallas_differentiable(x, w_gate, w_up, w_down, topk_ids, *, interpret: bool = False):
    """``pair_experts_pallas`` with ``pair_experts_reference``'s derivatives: ``moe_impl="pallas"``'s pair form."""
    return _pairs_differentiable(x, w_gate, w_up, w_down, topk_ids, interpret)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _route_differentiable(router_logits, top_k, norm_topk_prob, interpret):
    return route_top_k_pallas(router_logits, top_k, norm_topk_prob, interpret=interpret)


@_route_differentiable.defjvp
def _route_differentiable_jvp(top_k, norm_topk_prob, interpret, primals, tangents):
    # The reference's derivative at the experts the kernel picked (a near-tie it breaks otherwise than XLA's top-k
    # still gets its own experts' tangent); the ids' tangent: float0.
    weights, ids = out = _route_differentiable(*primals, top_k, norm_topk_prob, interpret)

    def picked_weights(logits):
        picked = jnp.take_along_axis(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), ids, axis=-1)
        return picked / jnp.sum(picked, axis=-1, keepdims=True) if norm_topk_prob else picked

    _, weights_tangent = jax.jvp(picked_weights, primals, tangents)
    return out, (weights_tangent, np.zeros(ids.shape, jax.dtypes.float0))


def route_top_k_pallas_differentiable(router_logits, top_k: int, norm_topk_prob: bool, *, interpret: bool = False):
    """``route_top_k_pallas`` with ``models.moe.route_top_k``'s derivatives (at the experts the kernel picked):
    ``moe_impl="pallas"``'s decode-step router."""
    return _route_differentiable(router_logits, top_k, norm_topk_prob, interpret)


def auto_impl(num_rows: int, hidden: int, dtype, scale_block: tuple[int, int] | None = None) -> str:
    """``moe_impl="auto"`` for ``num_rows`` sorted rows: the kernel on a GPU for its dtypes and, for block-FP8
    experts, their ``scale_block`` (``fp8_scale_block_supported``), else "xla"."""
    if (jax.default_backend() == "gpu" and num_rows > 0 and jnp.dtype(dtype) in KERNEL_DTYPES
            and (scale_block is None or fp8_scale_block_supported(scale_block))):
        return "pallas"
    return "xla"


# On by default (read at import): "0" leaves moe_impl="pallas"'s decode-sized steps on the sorted grouped kernels and
# XLA's softmax and top-k (``register_decode_kernels`` is then not called).
DECODE_KERNELS_ENV = "PAGED_JAX_MOE_DECODE_KERNELS"


def register_decode_kernels() -> None:
    """Make ``moe_impl="pallas"`` run decode-sized steps (up to ``models.moe.PAIR_FORM_MAX_PAIRS`` pairs) as the pair
    form (float experts) and their router as the route kernel: what importing this package does unless
    ``DECODE_KERNELS_ENV=0``."""
    register_pair_experts("pallas", pair_experts_pallas_differentiable)
    register_route_top_k("pallas", route_top_k_pallas_differentiable)


def decode_kernels_requested() -> bool:
    """Whether ``DECODE_KERNELS_ENV`` asks for the decode kernels (unset or "1": yes; "0": no); ValueError naming
    the variable for any other value."""
    value = os.environ.get(DECODE_KERNELS_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{DECODE_KERNELS_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


register_grouped_matmul("pallas", grouped_matmul_pallas_differentiable)
register_moe_selector(auto_impl)
if decode_kernels_requested():
    register_decode_kernels()

__all__ = ["KernelConfig", "auto_impl", "decode_kernels_requested", "default_config", "grouped_matmul_pallas",
           "grouped_matmul_pallas_differentiable", "grouped_matmul_reference", "moe_experts", "moe_experts_reference",
           "moe_experts_with", "pair_experts_pallas", "pair_experts_pallas_differentiable", "register_decode_kernels",
           "route_top_k_pallas", "route_top_k_pallas_differentiable", "tile_schedule"]
