"""Model drafters on a tensor-parallel target's mesh (vLLM runs the drafter with the target's tensor-parallel size).

The drafter is laid out by the target's rules (``paged_jax.parallel.plan``) in a ``ShardingPlan`` of its own shape
on the target's mesh (``drafter_plan``): its attention heads split over tp (rewritten by ``head_layout`` where they
do not divide it), its MLPs Megatron-split, its KV pool sharded over its KV heads like the target's, its attention
under ``shard_map``. A draft model is loaded straight into its shards (``models.tensor_parallel``); an EAGLE /
EAGLE-3 head or an MTP layer is loaded at its checkpoint shape, then head-rewritten and placed (``shard_head``):
``fc`` / ``eh_proj`` and ``d2t`` replicated, a head's own LM head vocabulary-parallel (vLLM's ``ReplicatedLinear`` /
``ParallelLMHead``), an MTP layer's latent attention and experts as the target's layers, and the target's embedding
and LM head it shares kept as the target's own arrays (never copied).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from models.config import ModelConfig
from models.eagle import EagleHead
from models.eagle3 import Eagle3Head
from models.moe import SparseMoeBlock
from models.mtp import MtpHead
from models.norm import RMSNorm
from paged_jax.parallel import ShardingPlan

# A head's parameters (by their first path entry) every device holds whole: fc / eh_proj read the whole hidden
# state (their input is not split), d2t maps every draft id.
_REPLICATED = ("fc", "eh_proj", "d2t")
# An MTP layer's own LM head: split as the target's (vocabulary-parallel).
_LM_HEAD = ("shared_head", "head")


def drafter_plan(config: ModelConfig, target_plan: ShardingPlan) -> ShardingPlan:
    """The drafter's plan (its layers' shape ``config``) on ``target_plan``'s mesh and KV layout (its experts, if
    any, split as the target's). ValueError as ``ShardingPlan.create`` for a shape without sharding rules."""
    return ShardingPlan.create(config, target_plan.mesh, kv_layout=target_plan.kv_layout,
                               expert_parallel=target_plan.expert_parallel and config.moe is not None)


def _resized(head, plan: ShardingPlan):
    """-> a function building ``head``'s kind of module with its layers of ``plan.model_config``'s shape."""
    if isinstance(head, Eagle3Head):
        config = dataclasses.replace(head.config, model=plan.model_config)
        return lambda: Eagle3Head(config, dtype=head.dtype, rngs=nnx.Rngs(0))
    if isinstance(head, MtpHead):  # built from its target's shape: the heads as the plan lays them out
        heads = {name: getattr(plan.model_config, name) for name in ("num_attention_heads", "num_key_value_heads")}
        target = dataclasses.replace(head.target, **heads)
        return lambda: MtpHead(target, own_head=head.shared_head.head is not None, dtype=head.dtype,
                               rngs=nnx.Rngs(0))
    config = dataclasses.replace(head.config, model=plan.model_config)
    return lambda: EagleHead(config, head.target, fc_bias=head.fc.bias is not None, dtype=head.dtype,
                             rngs=nnx.Rngs(0))


def shard_head(head: EagleHead | Eagle3Head | MtpHead, plan: ShardingPlan, shared: tuple):
    """``head`` (its layers of ``plan.config``'s shape, its own weights on any device) -> the same head of
    ``plan.model_config``'s shape, each own weight head-rewritten and placed in its shards on ``plan.mesh``; the
    arrays of ``shared`` (the target's, already on the mesh) are kept as they are. Its norms run the jnp RMSNorm (a
    Pallas call is not partitioned over a mesh); its experts run as the target's (``plan.moe_experts``, else XLA's
    partitioning of the width-split experts)."""
    graphdef, abstract = nnx.split(nnx.eval_shape(_resized(head, plan)))
    shapes = {path: tuple(variable.get_value().shape) for path, variable in nnx.to_flat_state(abstract)}
    placed = []
    for path, variable in nnx.to_flat_state(nnx.state(head)):
        value = variable.get_value()
        if not any(value is array for array in shared):
            value = _place(plan, path, value)
        if tuple(value.shape) != shapes[path]:
            raise ValueError(f"draft head parameter {'.'.join(map(str, path))}: shape {value.shape} after the head "
                             f"rewrite, the sharded head's is {shapes[path]}")
        placed.append((path, variable.replace(value)))
    sharded = nnx.merge(graphdef, nnx.from_flat_state(placed))
    for _, module in nnx.iter_graph(sharded):
        if isinstance(module, RMSNorm):
            module.impl = "xla"
        if isinstance(module, SparseMoeBlock):
            module.expert_parallel = plan.moe_experts
            module.impl = "xla" if plan.moe_experts is None else "auto"
    return sharded


def _place(plan: ShardingPlan, path: tuple, value: jax.Array) -> jax.Array:
    """One of a head's own parameters (checkpoint shape) -> rewritten for ``plan``'s heads, in its shards."""
    if path[0] in _REPLICATED:
        return jax.device_put(value, plan.replicated)
    if tuple(path[:2]) == _LM_HEAD:
        path = ("lm_head", *path[2:])
    value = plan.rewrite_param(path, np.asarray(value), np)  # on the host: each device gets its shard only
    return jax.device_put(value, NamedSharding(plan.mesh, plan.param_spec(path, tuple(value.shape))))


def buffer_key(array: jax.Array) -> tuple[int, ...]:
    """The device buffers of ``array``'s shards here: two arrays with the same key are the same memory (a leaf the
    drafter shares with the target)."""
    return tuple(shard.data.unsafe_buffer_pointer() for shard in array.addressable_shards)

