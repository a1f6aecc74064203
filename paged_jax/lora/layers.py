"""The batched low-rank update inside the jitted step: every token row adds ``x @ A[slot] @ B[slot]`` of its own
adapter slot (slot 0 = no adapter, all zeros), all rows and adapters in one program.

``LoRALayer`` is what ``models.llama`` receives per decoder layer (duck-typed: ``lora.add(name, x, y)``). It is a
pytree (slot ids and the layer's slot weights as leaves, the implementation name as static structure), so the
model's shared per-layer trace (``models.llama.ReusableAttention``) takes it as an argument like the KV layer.

Slot weights of one target (``paged_jax.lora.slots``): ``A: [in, S, R]`` and ``B: [S, R, out]`` with S = max_loras
+ 1 slots and R the target's rank width (``max_lora_rank`` times the projections fused into it; B is block
diagonal for a fused target), the adapter's scaling already folded into B.

Two implementations, same result (``LORA_IMPLS``):
* ``"masked"``: ``(x @ A_all) * onehot(slot) @ B_all`` with every slot side by side (``A_all = A.reshape(in, S*R)``):
  two dense matmuls whose extra work is S*R columns, the one-hot zeroing the other slots' ranks of each row;
  the weights are read once per step whatever the batch.
* ``"gather"``: per row ``x_t @ A[:, slot_t] @ B[slot_t]``: gathers one [in, R] and one [R, out] matrix per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LORA_IMPLS = ("masked", "gather")


def lora_delta(x: jax.Array, slot_ids: jax.Array, lora_a: jax.Array, lora_b: jax.Array, impl: str = "masked"
               ) -> jax.Array:
    """x: [T, in], slot_ids: int32[T] in [0, S), lora_a: [in, S, R], lora_b: [S, R, out] -> [T, out] in x.dtype."""
    num_tokens, in_features = x.shape
    num_slots, rank, out_features = lora_b.shape
    lora_a = lora_a.astype(x.dtype)
    lora_b = lora_b.astype(x.dtype)
    if impl == "masked":
        xa = jnp.dot(x, lora_a.reshape(in_features, num_slots * rank)).reshape(num_tokens, num_slots, rank)
        onehot = slot_ids[:, None] == jnp.arange(num_slots, dtype=slot_ids.dtype)[None, :]
        xa = jnp.where(onehot[:, :, None], xa, jnp.zeros((), xa.dtype))
        return jnp.dot(xa.reshape(num_tokens, num_slots * rank), lora_b.reshape(num_slots * rank, out_features))
    if impl == "gather":
        xa = jnp.einsum("ti,itr->tr", x, jnp.take(lora_a, slot_ids, axis=1))
        return jnp.einsum("tr,tro->to", xa, jnp.take(lora_b, slot_ids, axis=0))
    raise ValueError(f"lora impl must be one of {LORA_IMPLS}, got {impl!r}")


@jax.tree_util.register_pytree_node_class
class LoRALayer:
    """The LoRA state of one decoder layer for one step: ``slot_ids: int32[T]`` (each token's adapter slot) and
    ``weights: {target: (A, B)}`` (the layer's slot weights, ``lora_delta``'s layout). ``add(name, x, y)`` returns
    ``y + lora_delta(x)`` for a target it holds, ``y`` otherwise."""

    def __init__(self, slot_ids: jax.Array, weights: dict, impl: str = "masked"):
        self.slot_ids = slot_ids
        self.weights = weights
        self.impl = impl

    def add(self, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
        pair = self.weights.get(name)
        if pair is None:
            return y
        return y + lora_delta(x, self.slot_ids, pair[0], pair[1], self.impl).astype(y.dtype)

    def tree_flatten(self):
        return (self.slot_ids, self.weights), self.impl

    @classmethod
    def tree_unflatten(cls, impl, children):
        return cls(children[0], children[1], impl)
