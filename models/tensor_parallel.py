"""The tensor-parallel Llama model, and building it with every weight already in its shards.

``models`` is the lowest layer and knows nothing of meshes: what the tensor-parallel model needs from a layout is the
small ``TensorParallelPlan`` protocol below, which ``paged_jax.parallel.ShardingPlan`` implements (parameter
shardings, the head rewrite, per-device attention, gathered logits).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import loader
from models.config import ModelConfig
from models.llama import AttentionFn, LlamaForCausalLM
from models.moe import set_moe_impl
from models.moe_routing import set_expert_parallel


class TensorParallelPlan(Protocol):
    """What a tensor-parallel model and its loaders need from a sharding layout.

    Implementations must be hashable and immutable: the plan is static module data (it lives in the graphdef) and
    a key of compiled initializers.
    """

    config: ModelConfig  # the checkpoint's shape
    model_config: ModelConfig  # the shape built and run (heads rewritten so each device gets whole heads)

    def state_shardings(self, state: nnx.State) -> nnx.State:
        """A ``jax.sharding.Sharding`` for every leaf of a ``model_config`` state, same tree structure."""
        ...

    def rewrite_param(self, path: tuple, value: Any, xp: Any = np) -> Any:
        """One parameter in model layout (``[in, out]`` kernels) of the ``config`` shape -> the same parameter of
        the ``model_config`` shape; ``xp`` is numpy (host) or jax.numpy (traced). Must depend on the parameter's
        role only, not on its layer index (one compiled initializer serves every layer)."""
        ...

    def wrap_attention(self, attention: AttentionFn) -> AttentionFn:
        """A single-device ``AttentionFn`` -> one running it on each device's heads and KV shard (an attention
        that already runs mesh-wide is returned as is)."""
        ...

    def gather_logits(self, logits: jax.Array) -> jax.Array:
        """``float32[N, V]`` logits of the vocabulary-split LM head -> the same, whole on every device."""
        ...

    # Optional: ``moe_experts``, what sparse layers run their experts through (``SparseMoeBlock.expert_parallel``,
    # e.g. experts split over devices); absent or None: ``models.moe.moe_experts`` on the parameters' shardings.


class TensorParallelLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` of ``plan.model_config`` that knows its ``TensorParallelPlan``.

    Same parameters, same call signature; the differences are what make callers mesh-agnostic:
      * ``__call__`` runs the given ``AttentionFn`` on each device's heads (``plan.wrap_attention``), unless it
        already is mesh-wide (e.g. built by ``ShardingPlan.shard_attention`` / ``paged_attention``, which dp > 1
        requires);
      * ``compute_logits`` returns logits gathered over tp (``plan.gather_logits``), so sampling sees the whole
        vocabulary and the LM head is never gathered;
      * its norms run the jnp RMSNorm (``rms_norm_impl="xla"``): a Pallas call is not partitioned over a mesh,
        while XLA fuses the norms into the sharded program as it does on one device; so do its experts, unless the
        plan splits them over devices (``moe_experts``: each device's grouped matmuls then run on its own arrays,
        ``moe_impl="auto"``).
    The plan is static module data (hashable), so it lives in the graphdef and survives ``nnx.split``/``merge``.
    """

    def __init__(self, plan: TensorParallelPlan, *, dtype=jnp.bfloat16, param_dtype=None, rngs: nnx.Rngs):
        super().__init__(plan.model_config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, rms_norm_impl="xla",
                         moe_impl="xla")
        self.sharding_plan = plan
        if getattr(plan, "moe_experts", None) is not None:  # experts split over devices: each runs its own
            set_expert_parallel(self, plan.moe_experts)
            set_moe_impl(self, "auto")  # grouped matmuls on local arrays: the kernel where it runs (GPU)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list | None,
                 attention: AttentionFn, lora=None, *, aux_hidden_layers: tuple[int, ...] = ()) -> tuple:
        return super().__call__(input_ids, positions, kv_caches, self.sharding_plan.wrap_attention(attention), lora,
                                aux_hidden_layers=aux_hidden_layers)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        return self.sharding_plan.gather_logits(super().compute_logits(hidden))


def abstract_model(plan: TensorParallelPlan, dtype) -> TensorParallelLlamaForCausalLM:
    """The tensor-parallel model of ``plan`` with shapes only (``nnx.eval_shape``): no memory, no weights."""
    return nnx.eval_shape(
        lambda: TensorParallelLlamaForCausalLM(plan, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))


def _abstract_model(plan: TensorParallelPlan, dtype) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    """(graphdef, abstract state, target shardings) of the tensor-parallel model: shapes only, no memory."""
    graphdef, abstract_state = nnx.split(abstract_model(plan, dtype))
    return graphdef, abstract_state, plan.state_shardings(abstract_state)


def shard_model(model: LlamaForCausalLM, plan: TensorParallelPlan) -> TensorParallelLlamaForCausalLM:
    """Rewrite heads and place an existing (e.g. single-device) model's weights onto the plan's mesh.

    ``model`` must have the checkpoint's shape (``plan.config``) and the HF projection layout (not fused); returns a
    new ``TensorParallelLlamaForCausalLM`` of ``plan.model_config`` whose parameters are placed in their shards.
    """
    if model.config != plan.config:
        raise ValueError("model.config does not match the plan's config")
    _, state = nnx.split(model)
    graphdef, _, shardings = _abstract_model(plan, model.dtype)
    targets = dict(nnx.to_flat_state(shardings))
    placed = []
    for path, variable in nnx.to_flat_state(state):
        value = plan.rewrite_param(path, variable.get_value(), jnp)
        placed.append((path, variable.replace(jax.device_put(value, targets[path].get_value()))))
    return nnx.merge(graphdef, nnx.from_flat_state(placed))


def load_sharded_model(path, plan: TensorParallelPlan, *, dtype: Any = "bfloat16", load_format: str = "auto",
                       seed: int = 0) -> TensorParallelLlamaForCausalLM:
    """``models.loader.load_model`` for a mesh: every weight goes straight into its shards.

    safetensors: each tensor is read on the host, transposed/head-rewritten/cast there, and ``jax.device_put`` with
    its sharding, which sends each device only its slice; no device ever holds a full copy of a split tensor
    and the host holds one tensor at a time. "dummy": the weights of ``init_dummy_model(plan.config, seed=seed)``,
    each generated inside one jit whose output is already sharded (then head-rewritten, so padding heads are
    exactly zero as with a checkpoint).

    Args:
      path: checkpoint directory (ignored for "dummy").
      plan: e.g. ``paged_jax.parallel.ShardingPlan.create(config, mesh)``; ``plan.config`` must be the
        checkpoint's config.
      dtype, load_format, seed: as in ``load_model``.
    Returns:
      a ``TensorParallelLlamaForCausalLM`` of ``plan.model_config``.
    Raises:
      ValueError / FileNotFoundError: as ``load_model``.
    """
    if load_format not in loader.LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is unsupported; use one of {', '.join(loader.LOAD_FORMATS)}")
    jnp_dtype = loader.resolve_dtype(dtype)
    graphdef, _, shardings = _abstract_model(plan, jnp_dtype)
    targets = dict(nnx.to_flat_state(shardings))
    # The checkpoint-shaped model: what is read (or generated) before the head rewrite.
    _, checkpoint_state = loader.abstract_flat_state(plan.config, jnp_dtype)

    if load_format == "dummy":
        created = _init_dummy_sharded(plan, checkpoint_state, targets, seed)
        return nnx.merge(graphdef, nnx.from_flat_state(created))

    if path is None:
        raise ValueError(f"load_format={load_format!r} needs a checkpoint path")
    tensor_files = loader.checkpoint_tensor_files(Path(path))
    expected_shapes = {p: tuple(v.get_value().shape) for p, v in checkpoint_state}
    dtypes = {p: v.get_value().dtype for p, v in checkpoint_state}
    loaded = []
    for param_path, array, transposed in loader.iter_checkpoint_params(tensor_files, expected_shapes, plan.config):
        # Host-side: transpose to model layout, cast to the parameter's dtype (the model dtype; float8 experts and
        # their float32 scales as stored), rewrite heads; then only each shard is sent.
        array = loader.to_model_layout(array, transposed).astype(dtypes[param_path])
        array = np.ascontiguousarray(plan.rewrite_param(param_path, array, np))
        target = targets[param_path]
        loaded.append((param_path, target.replace(jax.device_put(array, target.get_value()))))
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _init_dummy_sharded(plan: TensorParallelPlan, checkpoint_state: nnx.FlatState, targets: dict,
                        seed: int) -> list[tuple[tuple, nnx.Variable]]:
    """Random weights identical to ``loader.init_dummy_model(plan.config, seed=seed)`` (so every layout of a
    benchmark runs the same model), head-rewritten, each generated by a jit whose output is already sharded.

    Parameter ``i`` (flat order of the checkpoint-shaped model) is ``loader.dummy_param_value`` of
    ``fold_in(key(seed), i)``; with partitionable threefry (jax's default) the values do not depend on the sharding.
    Returns the (path, variable) pairs of the sharded model's flat state.
    """
    base_key = jax.random.key(seed)
    created = []
    for index, (path, variable) in enumerate(checkpoint_state):
        spec = variable.get_value()
        make = _dummy_param_fn(plan, _role_of(path), tuple(spec.shape), jnp.dtype(spec.dtype),
                               loader.dummy_fill(path, plan.config), targets[path].get_value())
        created.append((path, targets[path].replace(make(jax.random.fold_in(base_key, index)))))
    return created


def _role_of(path: tuple) -> tuple:
    """The parameter path with its layer index dropped (set to 0): the same role in every layer shares one
    compiled initializer."""
    return tuple(0 if isinstance(entry, int) else entry for entry in path)


@functools.lru_cache(maxsize=256)
def _dummy_param_fn(plan: TensorParallelPlan, role: tuple, shape: tuple[int, ...], dtype, fill: float | None,
                    sharding: jax.sharding.Sharding):
    """Jitted ``key -> head-rewritten parameter`` for one (role, shape, dtype, sharding), compiled once and reused
    by every layer."""

    def make(key):
        return plan.rewrite_param(role, loader.dummy_param_value(key, shape, dtype, fill), jnp)

    return jax.jit(make, out_shardings=sharding)
