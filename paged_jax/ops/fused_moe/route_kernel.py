"""The router's softmax and top-k as one Pallas (Triton) kernel: ``models.moe.route_top_k``.

XLA runs ``lax.top_k`` over a row of experts as a sort (two sort kernels a layer on a GPU) after a softmax kernel and
before a renormalizing fusion. Here a program holds ``block_t`` tokens' logits (every expert of a row, padded to a
power of two) in registers, takes the float32 softmax, then picks the ``top_k`` largest probabilities one at a time
(the largest, the lowest expert index among equal ones, as ``lax.top_k`` orders them; the pick removed before the
next), and stores the weights (renormalized when ``norm_topk_prob``) and ids, largest first.

The oracle is ``models.moe.route_top_k``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from paged_jax.ops.ragged_paged_attention.common import TRITON_COMPILER_PARAMS as _CompilerParams
from paged_jax.ops.ragged_paged_attention.common import next_pow2
from paged_jax.ops.ragged_paged_attention.common import triton_load as _load, triton_store as _store

MAX_BLOCK_T = 16  # tokens a program routes
# One warp a program: the k rounds of row reductions then stay within a warp (shuffles, no shared-memory barrier).
NUM_WARPS = 1


def _route_kernel(logits_ref, weights_ref, ids_ref, *, top_k: int, norm_topk_prob: bool, block_t: int,
                  padded_experts: int):
    """Program ``i``: tokens ``[i * block_t, (i + 1) * block_t)`` of ``logits_ref [T, E]`` -> ``weights_ref
    float32[T, k]``, ``ids_ref int32[T, k]``."""
    num_tokens, num_experts = logits_ref.shape
    rows = pl.program_id(0) * block_t + jnp.arange(block_t, dtype=jnp.int32)
    row_ok = rows < num_tokens
    rows_c = jnp.where(row_ok, rows, 0)
    experts = jnp.arange(padded_experts, dtype=jnp.int32)
    mask = row_ok[:, None] & (experts < num_experts)[None, :]
    logits = _load(logits_ref.at[rows_c[:, None], experts[None, :]], mask=mask, other=float("-inf"))
    logits = logits.astype(jnp.float32)
    shifted = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))  # padded experts: exp(-inf) = 0
    probs = shifted / jnp.sum(shifted, axis=1, keepdims=True)
    # Below every probability: a padded expert is never picked before a real one. A NaN probability (a NaN or
    # infinite logit) ranks there too, so every id stays a real expert's (the pair kernels index weights with it).
    remaining = jnp.where(mask & ~jnp.isnan(probs), probs, -1.0)
    picked_weights, picked_ids = [], []
    for _ in range(top_k):
        best = jnp.max(remaining, axis=1)
        best_id = jnp.min(jnp.where(remaining == best[:, None], experts[None, :], padded_experts), axis=1)
        picked_weights.append(jnp.where(best < 0, jnp.nan, best))  # a NaN row's weights stay NaN, as the reference's
        picked_ids.append(best_id)
        remaining = jnp.where(experts[None, :] == best_id[:, None], -2.0, remaining)
    total = functools.reduce(jnp.add, picked_weights)
    store_rows = jnp.where(row_ok, rows, num_tokens)
    for j, (weight, expert) in enumerate(zip(picked_weights, picked_ids)):
        _store(weights_ref.at[store_rows, j], weight / total if norm_topk_prob else weight, mask=row_ok)
        _store(ids_ref.at[store_rows, j], expert, mask=row_ok)


@functools.partial(jax.jit, static_argnames=("top_k", "norm_topk_prob", "interpret"))
def route_top_k_pallas(router_logits: jax.Array, top_k: int, norm_topk_prob: bool, *,
                       interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``models.moe.route_top_k`` as one kernel: ``router_logits [T, E]`` (any float dtype) -> ``(weights
    float32[T, top_k], ids int32[T, top_k])``, the top-k experts of the float32 softmax, largest first (lowest id
    among equal ones), the weights renormalized to sum to 1 when ``norm_topk_prob``. ``interpret``: Pallas interpret
    mode (CPU tests)."""
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, {num_experts}] (the router's experts), got {top_k}")
    if num_tokens == 0:
        return jnp.zeros((0, top_k), jnp.float32), jnp.zeros((0, top_k), jnp.int32)
    block_t = min(next_pow2(num_tokens), MAX_BLOCK_T)
    kernel = functools.partial(_route_kernel, top_k=top_k, norm_topk_prob=norm_topk_prob, block_t=block_t,
                               padded_experts=next_pow2(num_experts))
    return pl.pallas_call(
        kernel,
        grid=(-(-num_tokens // block_t),),
        out_shape=(jax.ShapeDtypeStruct((num_tokens, top_k), jnp.float32),
                   jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32)),
        interpret=interpret,
        compiler_params=_CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        name=f"moe_route_top{top_k}",
    )(router_logits)
