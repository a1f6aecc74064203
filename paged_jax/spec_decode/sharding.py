"""Model drafters on a tensor-parallel target's mesh (vLLM runs the drafter with the target's tensor-parallel size).

The drafter is laid out by the target's rules (``paged_jax.parallel.plan``) in a ``ShardingPlan`` of its own shape
on the target's mesh (``drafter_plan``): its attention heads split over tp (rewritten by ``head_layout`` where they
do not divide it), its MLPs Megatron-split, its KV pool sharded over its KV heads like the target's, its attention
under ``shard_map``. A draft model is loaded straight into its shards (``models.tensor_parallel``); an EAGLE /
EAGLE-3 head is loaded at its checkpoint shape, then head-rewritten and placed (``shard_head``): ``fc`` and ``d2t``
replicated, an EAGLE-3 head's own LM head vocabulary-parallel (vLLM's ``ReplicatedLinear`` / ``ParallelLMHead``),
and the target's embedding and LM head it shares kept as the target's own arrays (never copied).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from models.config import ModelConfig
from models.eagle import EagleHead
from models.eagle3 import Eagle3Head
from models.norm import RMSNorm
from paged_jax.parallel import ShardingPlan

# A head's parameters (by their first path entry) every device holds whole: fc reads the whole hidden state (its
# input is not split), d2t maps every draft id.
_REPLICATED = ("fc", "d2t")


def drafter_plan(config: ModelConfig, target_plan: ShardingPlan) -> ShardingPlan:
    """The drafter's plan (its layers' shape ``config``) on ``target_plan``'s mesh and KV layout. ValueError as
    ``ShardingPlan.create`` for a shape without sharding rules."""
    return ShardingPlan.create(config, target_plan.mesh, kv_layout=target_plan.kv_layout)


def shard_head(head: EagleHead | Eagle3Head, plan: ShardingPlan, shared: tuple) -> EagleHead | Eagle3Head:
    """``head`` (its layers of ``plan.config``'s shape, its own weights on any device) -> the same head of
    ``plan.model_config``'s shape, each own weight head-rewritten and placed in its shards on ``plan.mesh``; the
    arrays of ``shared`` (the target's, already on the mesh) are kept as they are. Its norms run the jnp RMSNorm (a
    Pallas call is not partitioned over a mesh)."""
    config = dataclasses.replace(head.config, model=plan.model_config)
    if isinstance(head, Eagle3Head):
        make = lambda: Eagle3Head(config, dtype=head.dtype, rngs=nnx.Rngs(0))  # noqa: E731
    else:
        make = lambda: EagleHead(config, head.target, fc_bias=head.fc.bias is not None,  # noqa: E731
                                 dtype=head.dtype, rngs=nnx.Rngs(0))
    graphdef, abstract = nnx.split(nnx.eval_shape(make))
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
    return sharded


def _place(plan: ShardingPlan, path: tuple, value: jax.Array) -> jax.Array:
    """One of a head's own parameters (checkpoint shape) -> rewritten for ``plan``'s heads, in its shards."""
    if path[0] in _REPLICATED:
        return jax.device_put(value, plan.replicated)
    value = plan.rewrite_param(path, np.asarray(value), np)  # on the host: each device gets its shard only
    return jax.device_put(value, NamedSharding(plan.mesh, plan.param_spec(path, tuple(value.shape))))


def bytes_per_device(array: jax.Array) -> int:
    """Bytes one device holds of ``array`` (its shard; the whole of a replicated or one-device array)."""
    return math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize


def buffer_key(array: jax.Array) -> tuple[int, ...]:
    """The device buffers of ``array``'s shards here: two arrays with the same key are the same memory (a leaf the
    drafter shares with the target)."""
    return tuple(shard.data.unsafe_buffer_pointer() for shard in array.addressable_shards)

