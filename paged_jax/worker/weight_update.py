"""Replacing a running engine's weights in place (an RL rollout worker taking a trainer's new parameters).

``WeightUpdater`` takes parameters in the model's own layout (the ``nnx.State`` of ``model_class(config)`` as
``models.loader`` builds it, ``nnx.to_pure_dict`` of it, or a flat dict keyed by dotted model paths such as
``model.layers.0.self_attn.q_proj.kernel``) or under HF names (``model.layers.0.self_attn.q_proj.weight``, ``[out,
in]``), checks every name, shape and dtype against the engine's model before touching anything (a ValueError naming
the parameter; the engine keeps its weights), moves each array onto the engine's devices (device to device from any
device or sharding; host arrays are uploaded) and re-applies the engine's weight transforms in one jitted program,
exactly as the engine's loader applied them:

* one device: online quantization (``--quantization fp8`` / ``int8``), then fused q/k/v and gate/up projections;
* tensor parallel (``tensor_parallel_size`` > 1, a ``ShardingPlan``; with ``data_parallel_size`` > 1 each replica
  updates its own): each array goes straight into the shards of its parameter (``ShardingPlan.param_spec``: a
  device receives only its slice), then online quantization and the head rewrite (``ShardingPlan.rewrite_param``,
  heads that do not divide tp); projections stay unfused, experts split over their width or, with expert
  parallelism, whole;
* pipeline parallel (a ``PipelinePlan``): each parameter into its stage's shards, one program per stage (the
  stages' devices form no one mesh) applying the head rewrite, then ``PipelineForward.param_leaves_replaced``
  points the stages at the new leaves (a tied LM head's copy on the last stage made again).

Its outputs have the shardings of the runner's parameter leaves, so the step executables run them unchanged (no
compile); the old leaves are donated to it, so it writes the new weights into their buffers (no second copy of the
engine's weights; an engine array given back as input is copied first), and the engine never shares a buffer with
the caller's arrays. LoRA adapters live in their own slots and are untouched; a drafter sharing the target's
embedding or LM head (EAGLE, MTP) is handed the new leaves (``DraftRunner.target_params_replaced``). Refused
(ValueError at construction, naming the setting): an engine spanning several processes (``nnodes`` > 1: the other
hosts' followers would keep the old weights) and pre-quantized checkpoints (``quantization``).

``read_checkpoint`` reads an HF safetensors directory or an orbax checkpoint of the model's state (as
``nnx.to_pure_dict(nnx.state(model))``) into the flat dict ``update`` takes, cast to the engine's dtype.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from models import weight_cache
from models.llama import fuse_projections
from models.loader import (abstract_flat_state, checkpoint_tensor_files, hf_name_for, iter_checkpoint_params,
                           to_model_layout)
from models.moe import checkpoint_prefix
from models.quantization.load import quantize_model
from paged_jax.parallel import ShardingPlan
from paged_jax.parallel.pipeline import PipelinePlan


def dotted_name(key_path: tuple) -> str:
    """A pytree key path (``DictKey`` / ``SequenceKey`` / ``GetAttrKey`` entries, or plain keys) -> ``a.b.0.c``."""
    parts = []
    for key in key_path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                key = getattr(key, attr)
                break
        parts.append(str(key))
    return ".".join(parts)


def flatten_named(params: Any) -> dict[str, Any]:
    """Parameters as given to ``update`` -> ``{dotted name: array}`` (an ``nnx.Variable`` leaf gives its value)."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params)
    leaves, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return {dotted_name(path): (leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf)
            for path, leaf in leaves}


class WeightUpdater:
    """Swaps a ``ModelRunner``'s parameter leaves for new values (see the module docstring).

    Args:
      runner: the engine's ``ModelRunner`` (its ``param_leaves`` are replaced; its ``sharding_plan``, a
        ``ShardingPlan`` or ``PipelinePlan`` or None, is the layout rebuilt).
      config: the model's ``ModelConfig`` (the layout checked against).
      quantization: the engine's ``QuantConfig`` or None.
    Raises (at construction): ValueError naming what the update cannot serve: ``nnodes`` > 1 and pre-quantized
    checkpoints (``quantization``).
    """

    def __init__(self, runner, config, quantization=None):
        self.plan = _check_plan(runner.sharding_plan)
        if quantization is not None and quantization.serialized:
            raise ValueError(f"quantization={quantization.method!r}: weight updates take full-precision weights and "
                             "re-quantize them online (fp8, int8); a pre-quantized format cannot be rebuilt")
        self.runner = runner
        self.config = config
        self.quantization = quantization
        self.dtype = runner.dtype
        self._graphdef, self._abstract = abstract_flat_state(config, self.dtype)
        self._specs = [variable.get_value() for _, variable in self._abstract]
        # dotted model path or HF name -> (leaf index, stored transposed)
        self._names: dict[str, tuple[int, bool]] = {}
        for index, (path, _) in enumerate(self._abstract):
            self._names[".".join(map(str, path))] = (index, False)
            try:
                hf_name, transposed = hf_name_for(path)
            except ValueError:
                continue  # stacked experts: model-layout names only
            self._names[checkpoint_prefix(config, hf_name)] = (index, transposed)
        self._out_shardings = [leaf.sharding for leaf in runner.param_leaves]
        self._out_specs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in runner.param_leaves]
        self._device = runner.input_sharding()
        self._input_shardings = [self._param_shardings(path, tuple(spec.shape))
                                 for (path, _), spec in zip(self._abstract, self._specs)]
        self._jitted: dict[tuple[bool, ...], Any] = {}
        self._checked_layout = False

    # ------------------------------------------------------------------ the update
    def update(self, params: Any, *, cast: bool = False) -> None:
        """Replace every weight with ``params`` (see the module docstring). ``cast``: convert other float dtypes
        to the engine's (checkpoints on disk); else a dtype mismatch is an error. Raises ValueError naming the
        first parameter that is missing, unexpected, or of the wrong shape or dtype; nothing changes then."""
        leaves, transposed = self._match(flatten_named(params), cast)
        placed = [jax.device_put(leaf, shardings[flip]) for leaf, shardings, flip
                  in zip(leaves, self._input_shardings, transposed)]
        if cast:
            placed = [leaf.astype(spec.dtype) for leaf, spec in zip(placed, self._specs)]
        old_leaves = self.runner.param_leaves
        engine_buffers = _buffers(old_leaves)  # an engine array given back is copied first: they are donated
        placed = [jnp.copy(leaf) if _buffers([leaf]) & engine_buffers else leaf for leaf in placed]
        new_leaves = self._transform(transposed)(placed, old_leaves)
        self.runner.param_leaves = list(new_leaves)
        if isinstance(self.plan, PipelinePlan):  # its stages hold their own lists of the leaves
            self.runner.forward_strategy.param_leaves_replaced(self.runner)
        if getattr(self.runner, "drafter", None) is not None:  # an EAGLE / MTP head shares the target's embedding
            self.runner.drafter.target_params_replaced(self.runner)
        for leaf in old_leaves:
            if leaf is not None and not leaf.is_deleted():
                leaf.delete()

    def input_sharding(self, name: str, transposed: bool = False) -> jax.sharding.Sharding:
        """Where the value of model parameter ``name`` (dotted model path) goes before the transform: the engine's
        device, or under tensor parallelism its parameter's shards (``transposed``: for the ``[..., out, in]``
        array of an HF weight)."""
        return self._input_shardings[self._names[name][0]][transposed]

    def _param_shardings(self, path: tuple, shape: tuple[int, ...]) -> tuple:
        """(model layout's sharding, the transposed array's) of one checkpoint-shaped parameter."""
        if self.plan is None:
            return self._device, self._device
        plan = self.plan  # a pipeline's parameter: its stage's tensor-parallel plan
        if isinstance(plan, PipelinePlan):
            plan = plan.stage_plans[plan.stage_of(path)]
        spec = tuple(plan.param_spec(path, shape))
        spec = spec + (None,) * (len(shape) - len(spec))
        swapped = spec[:-2] + spec[:-3:-1] if len(spec) >= 2 else spec
        return NamedSharding(plan.mesh, P(*spec)), NamedSharding(plan.mesh, P(*swapped))

    def check(self, named: dict[str, Any]) -> None:
        """``update``'s checks of names, shapes and dtypes alone, on ``{name: array or jax.ShapeDtypeStruct}``
        (before a transfer); ValueError as ``update``'s."""
        self._match(named, cast=False)

    def _match(self, named: dict[str, Any], cast: bool) -> tuple[list, tuple[bool, ...]]:
        """Each expected leaf's value (in ``self._abstract`` order) and whether it is given transposed."""
        leaves: list[Any] = [None] * len(self._specs)
        transposed = [False] * len(self._specs)
        for name, value in named.items():
            entry = self._names.get(name)
            if entry is None:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue  # a tied model's redundant copy
                raise ValueError(f"update_weights: unexpected parameter {name!r}: the model has no such parameter")
            index, is_transposed = entry
            spec = self._specs[index]
            shape = tuple(spec.shape[::-1]) if is_transposed else tuple(spec.shape)
            if tuple(value.shape) != shape:
                raise ValueError(f"update_weights: parameter {name!r} has shape {tuple(value.shape)}, the "
                                 f"engine's is {shape}")
            dtype = np.dtype(value.dtype)
            if dtype != spec.dtype and not (cast and jnp.issubdtype(dtype, jnp.floating)):
                raise ValueError(f"update_weights: parameter {name!r} has dtype {dtype}, the engine's is "
                                 f"{np.dtype(spec.dtype)} (cast it first)")
            if leaves[index] is not None:
                raise ValueError(f"update_weights: parameter {name!r} is given twice (model and HF names)")
            leaves[index], transposed[index] = value, is_transposed
        missing = [".".join(map(str, path)) for (path, _), leaf in zip(self._abstract, leaves) if leaf is None]
        if missing:
            raise ValueError(f"update_weights: missing parameter {missing[0]!r}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return leaves, tuple(transposed)

    def _transform(self, transposed: tuple[bool, ...]):
        """The jitted model-layout leaves -> engine leaves program for one transposition pattern (a pipeline: one
        program per stage)."""
        jitted = self._jitted.get(transposed)
        if jitted is None:
            to_engine_layout = functools.partial(self._to_engine_layout, transposed)
            if not self._checked_layout:
                given = [jax.ShapeDtypeStruct(spec.shape[::-1] if flip else spec.shape, spec.dtype)
                         for spec, flip in zip(self._specs, transposed)]
                self._check_layout(jax.eval_shape(to_engine_layout, given))
            jitted = self._jitted[transposed] = (
                self._staged_transform(transposed) if isinstance(self.plan, PipelinePlan)
                else _donating_jit(to_engine_layout, self._out_shardings))
        return jitted

    def _to_engine_layout(self, transposed: tuple[bool, ...], leaves: list) -> list:
        """Model-layout leaves (``self._abstract`` order, ``transposed`` ones as given) -> the runner's leaves, as
        the engine's loader built them."""
        flat = [(path, variable.replace(to_model_layout(leaf, flip)))
                for (path, variable), leaf, flip in zip(self._abstract, leaves, transposed)]
        model = nnx.merge(self._graphdef, nnx.from_flat_state(flat))
        if self.quantization is not None:
            model = quantize_model(model, self.quantization)
        if self.plan is None:
            return jax.tree.leaves(nnx.state(fuse_projections(model)))
        # The sharded loaders' layout (load_sharded_model, shard_quantized_model): unfused, heads rewritten.
        return jax.tree.leaves(nnx.from_flat_state(
            [(path, variable.replace(self.plan.rewrite_param(path, variable.get_value(), jnp)))
             for path, variable in nnx.to_flat_state(nnx.state(model))]))

    def _staged_transform(self, transposed: tuple[bool, ...]):
        """A pipeline's transform: its stages' devices form no one mesh, so one jitted program per stage rewrites
        that stage's parameters (the pipeline's loader applies the head rewrite alone: one runner leaf per
        parameter, in sorted path order)."""
        order = jax.tree.leaves(nnx.from_flat_state([(path, variable.replace(index))
                                                     for index, (path, variable) in enumerate(self._abstract)]))
        position = {index: pos for pos, index in enumerate(order)}
        programs = []
        for stage in range(self.plan.pipeline_parallel_size):
            indices = [i for i, (path, _) in enumerate(self._abstract) if self.plan.stage_of(path) == stage]
            paths = [self._abstract[i][0] for i in indices]
            flips = [transposed[i] for i in indices]

            def rewrite(leaves, paths=paths, flips=flips):
                return [self.plan.rewrite_param(path, to_model_layout(leaf, flip), jnp)
                        for path, leaf, flip in zip(paths, leaves, flips)]

            out_shardings = [self._out_shardings[position[i]] for i in indices]
            positions = [position[i] for i in indices]
            programs.append((indices, positions, _donating_jit(rewrite, out_shardings)))

        def run(placed: list, old_leaves: list) -> list:
            new_leaves: list = [None] * len(old_leaves)
            for indices, positions, program in programs:
                new = program([placed[i] for i in indices], [old_leaves[pos] for pos in positions])
                for pos, leaf in zip(positions, new):
                    new_leaves[pos] = leaf
            return new_leaves

        return run

    def _check_layout(self, produced: list) -> None:
        """The transform must rebuild exactly the runner's leaves (else the engine has a transform this module does
        not re-apply): a ValueError saying which."""
        if len(produced) != len(self._out_specs):
            raise ValueError(f"update_weights: the engine's model has {len(self._out_specs)} parameter arrays, the "
                             f"re-applied transforms give {len(produced)}; its layout is not supported")
        for index, (got, want) in enumerate(zip(produced, self._out_specs)):
            if got.shape != want.shape or got.dtype != want.dtype:
                raise ValueError(f"update_weights: engine parameter {index} is {want.dtype}{list(want.shape)}, the "
                                 f"re-applied transforms give {got.dtype}{list(got.shape)}")
        self._checked_layout = True


def _buffers(arrays: list) -> set:
    """The device buffers (device id, address) of ``arrays``' shards here (None entries: none)."""
    return {(shard.device.id, shard.data.unsafe_buffer_pointer()) for array in arrays if array is not None
            for shard in array.addressable_shards}


def _donating_jit(transform, out_shardings: list):
    """``transform(leaves) -> new leaves`` jitted as ``(leaves, old leaves) -> new leaves`` with the old leaves
    donated: each new leaf is written into the buffer of an old one of its shape, dtype and sharding, so an update
    needs no second copy of the engine's weights. A leaf the transform passes through is copied too, so the engine
    never shares a buffer with the caller (a trainer that donates or deletes its arrays)."""
    def write_over(leaves, old_leaves):
        return [jnp.copy(leaf) for leaf in transform(leaves)]

    return jax.jit(write_over, out_shardings=out_shardings, donate_argnums=(1,), keep_unused=True)


def _check_plan(plan) -> ShardingPlan | PipelinePlan | None:
    """The runner's plan (None on one device); ValueError naming what weight updates cannot serve."""
    if plan is None:
        return None
    if not isinstance(plan, (ShardingPlan, PipelinePlan)):
        raise ValueError(f"weight updates: the engine's layout {type(plan).__name__} is not supported")
    if any(device.process_index != jax.process_index() for device in plan.mesh.devices.flat):
        raise ValueError("nnodes > 1: weight updates need every device of the engine in this process (the other "
                         "hosts' followers would keep the old weights)")
    return plan


def read_checkpoint(path: str | os.PathLike, updater: WeightUpdater) -> dict[str, Any]:
    """The weights of a checkpoint directory as ``{dotted model path: array}`` for ``updater.update(cast=True)``:
    an HF safetensors checkpoint (``model.safetensors`` or an index + shards; names and shapes checked, one tensor
    on the host at a time) or an orbax checkpoint of ``nnx.to_pure_dict(nnx.state(model))`` restored straight onto
    the device. ValueError naming ``path`` when it holds neither or cannot be read (a ValueError: the caller's
    error, which a core process answers rather than dies of)."""
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"update_weights_from_disk: {path} is not a directory")
    if any(directory.glob("*.safetensors")) or (directory / "model.safetensors.index.json").is_file():
        expected = {p: tuple(spec.shape) for (p, _), spec in zip(updater._abstract, updater._specs)}
        dtypes = {p: spec.dtype for (p, _), spec in zip(updater._abstract, updater._specs)}
        named = {}
        for param_path, array, transposed in iter_checkpoint_params(checkpoint_tensor_files(directory), expected,
                                                                    updater.config):
            # Each parameter's own dtype: float8 experts and their float32 scales stay as stored. Under tensor
            # parallelism each device receives its slice only.
            name = ".".join(map(str, param_path))
            value = jax.device_put(array, updater.input_sharding(name, transposed)).astype(dtypes[param_path])
            named[name] = to_model_layout(value, transposed)
        return named
    if any(directory.glob("*METADATA*")) or (directory / "manifest.ocdbt").is_file():
        target: dict = {}  # the pure dict's nesting, leaves restored straight into their input shardings
        for (param_path, _), spec in zip(updater._abstract, updater._specs):
            node = target
            for key in param_path[:-1]:
                node = node.setdefault(key, {})
            sharding = updater.input_sharding(".".join(map(str, param_path)))
            node[param_path[-1]] = jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)
        return flatten_named(weight_cache.restore_pytree(directory, target))
    raise ValueError(f"update_weights_from_disk: {path} holds neither safetensors files nor an orbax "
                            "checkpoint")
