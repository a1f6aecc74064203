"""What a sparse MoE layer does besides computing its experts: the part of the experts one device holds (expert
parallelism) and recording each token's routing (vLLM's "routed experts" for RL replay, per-expert load).

* ``local_experts_partial``: a device holding experts ``[first, first + E_local)`` computes, for every token, the
  weighted sum over those of its top-k experts that are local (float32, not yet rounded); summing that over the
  devices (``paged_jax.parallel.expert_parallel``) gives ``models.moe.moe_experts``' result.
* Routing capture: with ``set_routing_capture(model, True)`` (a static switch, set before tracing) every sparse layer
  (``models.moe.SparseMoeBlock``) sows its top-k ids as an ``nnx.Intermediate`` named ``routed_experts``;
  ``pop_routed_experts(model)`` collects them after the forward as ``[T, num_sparse_layers, top_k]``. Off (the
  default), the layers trace exactly as before.
* ``set_expert_parallel``: the sparse layers' experts run through a callable (experts split over devices).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from models.moe import ROUTED_EXPERTS, SparseMoeBlock, expert_operand, in_pair_order, sort_by_expert


def local_experts_partial(grouped_matmul: Callable, x: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                          w_down: jax.Array, topk_weights: jax.Array, topk_ids: jax.Array,
                          first_expert: jax.Array) -> jax.Array:
    """One device's share of ``moe_experts``: its local experts on every (token, slot) pair routed to them.

    Args:
      grouped_matmul: ``models.moe.grouped_matmul_reference``'s contract.
      x: ``dtype[T, H]`` (every token; the routing is the same on every device).
      w_gate, w_up: ``[E_local, H, I]``; w_down: ``[E_local, I, H]``: experts ``first_expert + e`` (or each a
        ``BlockFp8Experts`` of that shape).
      topk_weights: ``float32[T, k]``; topk_ids: ``int32[T, k]`` global expert ids in ``[0, E)``.
      first_expert: int32 scalar, the global id of local expert 0.
    Returns:
      ``float32[T, H]``: ``sum_j topk_weights[t, j] * expert_{ids[t, j]}(x[t])`` over the slots whose expert is
      local (zero for a token with none); the sum of these over the devices is the whole layer.

    Pairs of other devices' experts get the id ``E_local`` (sorted last, outside every group) and weight 0: the
    grouped matmuls run on ``T * k`` rows of which only the local ones are in a group (a kernel skips the others'
    tiles), and their rows are zeroed before the combine, whatever a kernel leaves there.
    """
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_local = w_gate.shape[0]
    local_ids = topk_ids - first_expert
    is_local = (local_ids >= 0) & (local_ids < num_local)
    local_ids = jnp.where(is_local, local_ids, num_local)
    order, group_sizes = sort_by_expert(local_ids, num_local)  # the out-of-range id counts in no group
    dtype = x.dtype
    act = grouped_matmul(x, expert_operand(w_gate, dtype), group_sizes, row_index=order // top_k,
                         up_rhs=expert_operand(w_up, dtype))
    out_sorted = grouped_matmul(act, expert_operand(w_down, dtype), group_sizes)  # [T * k, H]
    in_group = jnp.arange(out_sorted.shape[0]) < jnp.sum(group_sizes)
    out_sorted = jnp.where(in_group[:, None], out_sorted, 0)
    out = in_pair_order(out_sorted, order).reshape(num_tokens, top_k, hidden).astype(jnp.float32)
    weights = jnp.where(is_local, topk_weights, 0.0)
    return jnp.sum(out * weights[:, :, None], axis=1)


def _sparse_blocks(model) -> list[SparseMoeBlock]:
    return [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]


def set_routing_capture(model, capture: bool):
    """In place: whether every sparse layer of ``model`` (a ``models.llama.LlamaForCausalLM``) records its top-k
    ids (static: set before tracing). ValueError for a model without sparse layers. Returns ``model``."""
    blocks = _sparse_blocks(model)
    if capture and not blocks:
        raise ValueError(f"{model.config.architecture} has no mixture-of-experts layers: no routed experts")
    for block in blocks:
        block.capture_routing = bool(capture)
    return model


def set_expert_parallel(model, experts_fn):
    """In place: every sparse layer of ``model`` runs its experts through ``experts_fn`` (static, hashable; see
    ``SparseMoeBlock.expert_parallel``), or ``models.moe.moe_experts`` when None. Returns ``model``."""
    for block in _sparse_blocks(model):
        block.expert_parallel = experts_fn
    return model


def pop_routed_experts(model) -> jax.Array:
    """After a forward of a capturing ``model``: ``int32[T, num_sparse_layers, k]``, each token's top-k expert ids
    of every sparse layer in layer order (largest weight first); the recorded values are removed from the model."""
    ids = []
    for block in _sparse_blocks(model):
        sown = getattr(block, ROUTED_EXPERTS, None)
        if sown is None:
            raise ValueError("pop_routed_experts: the model did not record its routing (set_routing_capture, and "
                             "run its layers inline: a reusable attention traces each layer apart)")
        ids.append(sown.get_value()[-1])
        delattr(block, ROUTED_EXPERTS)
    return jnp.stack(ids, axis=1)


def routing_dtype(num_experts: int):
    """The narrowest unsigned integer dtype holding expert ids ``[0, num_experts)`` (what is fetched per token)."""
    return jnp.uint8 if num_experts <= 256 else jnp.uint16


def expert_load(topk_ids: jax.Array, num_experts: int, valid: jax.Array) -> jax.Array:
    """``topk_ids int32[T, L, k]``, ``valid bool[T]`` -> ``int32[L, E]``: tokens routed to each expert of each sparse
    layer, over the valid tokens (a token counts once per slot it gives the expert; its k slots are distinct)."""
    ids = jnp.where(valid[:, None, None], topk_ids, num_experts)  # padding tokens: an out-of-range id
    one_layer = lambda layer_ids: jnp.bincount(layer_ids.reshape(-1), length=num_experts)  # noqa: E731
    return jax.vmap(one_layer, in_axes=1)(ids).astype(jnp.int32)
