"""Tensor (and data) parallelism on ``jax.sharding`` meshes: meshes, parameter PartitionSpecs, sharded loading,
head-parallel attention under ``shard_map`` and multi-host initialization.

Layout (Megatron-style, over the mesh axis ``"tp"``):

* q/k/v projections and the MLP gate/up projections are column-parallel (output features split over tp), o_proj and
  down_proj are row-parallel (input features split), so each attention block and each MLP ends in exactly one
  all-reduce, which XLA's SPMD partitioner inserts from the shardings alone.
* The embedding table is vocabulary-parallel (``[V/tp, H]`` per device) and so is the LM head (``[H, V/tp]``);
  logits come out vocabulary-sharded and are gathered (``ShardingPlan.logits_sharding``) before sampling.
* Norm scales and the o_proj bias are replicated.
* The paged KV pool ``[num_blocks, block_size, Hkv, D]`` is sharded over its KV-head axis; attention runs under
  ``shard_map`` so each device runs the kernel (or the jnp reference) on its own q heads and its own KV shard.

Heads that do not divide tp. With ``Hq`` q heads, ``Hkv`` kv heads, group ``g = Hq / Hkv`` and ``tp`` devices the
model is rewritten into an *equivalent* one with ``Hkv' = lcm(Hkv, tp)`` kv heads (each original kv head replicated
``r = Hkv' / Hkv`` times, so every device holds exactly the kv heads its q heads need) and ``g' = ceil(g / r)`` q heads
per kv head (``Hq' = Hkv' * g'``). The ``g`` q heads of an original group are dealt out ``g'`` at a time to its ``r``
replicas; when ``r * g' > g`` the leftover q heads are zero padding: zero columns in q_proj (and its bias), zero rows
in o_proj, so they contribute exactly nothing to the output. Examples: Hq=4, Hkv=2, tp=4 -> Hkv'=4 (each kv head
twice), no padding; SmolLM2 (Hq=9, Hkv=3): tp=3 is natural, tp=2 -> Hkv'=6, Hq'=12 (3 zero heads), tp=4 or 8 ->
Hkv'=Hq'=12 or 24. ``pad_heads=False`` refuses padding with a ValueError instead. The rewritten shape is
``ShardingPlan.model_config``: build the model and the KV pool from it (``plan.model_config.num_key_value_heads``).

Data parallelism (mesh axis ``"dp"``): weights are replicated over dp; the flat token batch, the attention metadata and
the KV pool's block axis are split over dp, so each dp group owns ``num_blocks / dp`` blocks addressed by *local*
block ids (local block 0 is that group's null block) and its own sequences. This is a model-level layout (used by
``benchmarks/sharding.py``); the engine runs dp = 1.

Multi-host: call ``initialize_distributed()`` first in every process (see its docstring); the mesh then spans all
processes' devices and everything above works unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
from pathlib import Path
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.config import ModelConfig
from models.llama import AttentionFn, LlamaForCausalLM

DP_AXIS = "dp"
TP_AXIS = "tp"
KV_LAYOUTS = ("sharded", "replicated")

# Environment variables read by initialize_distributed().
ENV_COORDINATOR = "PAGED_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "PAGED_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "PAGED_JAX_PROCESS_ID"
# JAX's own variables: when set, jax.distributed.initialize() needs no arguments.
_JAX_DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


# --------------------------------------------------------------------------------------------------------------------
# Meshes and multi-host start-up
# --------------------------------------------------------------------------------------------------------------------

def make_mesh(tensor_parallel_size: int, data_parallel_size: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``(dp, tp)`` mesh with axis names ``("dp", "tp")``.

    tp is the minor (fastest-varying) axis, so the devices of one tp group are neighbours (same host, NVLink).
    The axes are ``AxisType.Auto`` so XLA's sharding propagation places the collectives (jax 0.10 defaults
    ``jax.make_mesh`` to Explicit axes, which would require sharding annotations on every op).

    Args:
      tensor_parallel_size: devices per model replica (>= 1).
      data_parallel_size: model replicas (>= 1).
      devices: the devices to use, ``dp * tp`` of them; default the first ``dp * tp`` of ``jax.devices()``.
    Raises:
      ValueError: a size < 1, or not enough / the wrong number of devices.
    """
    for name, value in (("tensor_parallel_size", tensor_parallel_size), ("data_parallel_size", data_parallel_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    num_devices = tensor_parallel_size * data_parallel_size
    if devices is None:
        available = jax.devices()
        if len(available) < num_devices:
            raise ValueError(
                f"data_parallel_size * tensor_parallel_size = {data_parallel_size} * {tensor_parallel_size} = "
                f"{num_devices} devices needed, only {len(available)} available ({available[0].platform})"
            )
        devices = available[:num_devices]
    else:
        devices = list(devices)
        if len(devices) != num_devices:
            raise ValueError(
                f"devices has {len(devices)} entries but data_parallel_size * tensor_parallel_size = "
                f"{data_parallel_size} * {tensor_parallel_size} = {num_devices}"
            )
    shape, names = (data_parallel_size, tensor_parallel_size), (DP_AXIS, TP_AXIS)
    axis_type = getattr(jax.sharding, "AxisType", None)
    try:
        kwargs = {"axis_types": (axis_type.Auto,) * 2} if axis_type is not None else {}
        return jax.make_mesh(shape, names, devices=devices, **kwargs)
    except (TypeError, ValueError, AttributeError):
        # Older jax without devices=/axis_types=, or a device list make_mesh cannot lay out: plain reshape.
        return Mesh(np.asarray(devices, dtype=object).reshape(shape), names)


def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, *, local_device_ids: Sequence[int] | None = None,
                           initialization_timeout: int = 300) -> bool:
    """Join a multi-process (multi-host) JAX job; call once per process before any other JAX call.

    Settings come from the arguments, else from ``PAGED_JAX_COORDINATOR`` ("host:port" of process 0),
    ``PAGED_JAX_NUM_PROCESSES`` and ``PAGED_JAX_PROCESS_ID``; else, if JAX's own ``JAX_COORDINATOR_ADDRESS`` (etc.)
    or a cluster JAX auto-detects (SLURM, Cloud TPU, ...) is present, ``jax.distributed.initialize()`` is called
    without arguments. With none of these it is a single-process run and nothing happens.

    On CPU the cross-process collectives use gloo (set before the backend starts).

    Example (two hosts): on each host ``PAGED_JAX_COORDINATOR=host0:1234 PAGED_JAX_NUM_PROCESSES=2
    PAGED_JAX_PROCESS_ID=<0|1> python serve.py``; then ``make_mesh(tp)`` sees all processes' devices.

    Returns:
      True if this process is part of an initialized multi-process job, False for a single-process run.
    Raises:
      ValueError: only some of coordinator/num_processes/process_id are given, or they are malformed.
    """
    if jax.distributed.is_initialized():
        return True
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    if num_processes is None and os.environ.get(ENV_NUM_PROCESSES):
        num_processes = _env_int(ENV_NUM_PROCESSES)
    if process_id is None and os.environ.get(ENV_PROCESS_ID):
        process_id = _env_int(ENV_PROCESS_ID)
    explicit = {"coordinator_address": coordinator_address, "num_processes": num_processes,
                "process_id": process_id}
    given = {name for name, value in explicit.items() if value is not None}
    if given and len(given) != 3:
        missing = sorted(set(explicit) - given)
        raise ValueError(
            f"initialize_distributed needs coordinator_address, num_processes and process_id together "
            f"(args or {ENV_COORDINATOR}/{ENV_NUM_PROCESSES}/{ENV_PROCESS_ID}); missing {missing}"
        )
    if given:
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(f"process_id must be in [0, num_processes={num_processes}), got {process_id}")
        if ":" not in coordinator_address:
            raise ValueError(f"coordinator_address must be 'host:port', got {coordinator_address!r}")
    elif not any(os.environ.get(name) for name in _JAX_DISTRIBUTED_ENV) and not _cluster_detected():
        return False
    _use_gloo_on_cpu()
    kwargs: dict[str, Any] = {"initialization_timeout": initialization_timeout}
    if local_device_ids is not None:
        kwargs["local_device_ids"] = list(local_device_ids)
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
    return True


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError as exc:
        raise ValueError(f"environment variable {name} must be an int, got {os.environ[name]!r}") from exc


def _cluster_detected() -> bool:
    # Environments jax.distributed.initialize() auto-detects; checked by their well-known variables.
    return bool(os.environ.get("SLURM_JOB_ID") and int(os.environ.get("SLURM_NTASKS", "1")) > 1) or bool(
        os.environ.get("OMPI_COMM_WORLD_SIZE") and int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    ) or bool(os.environ.get("TPU_WORKER_HOSTNAMES") and "," in os.environ.get("TPU_WORKER_HOSTNAMES", ""))


def _use_gloo_on_cpu() -> None:
    platforms = os.environ.get("JAX_PLATFORMS", "") or str(jax.config.jax_platforms or "")
    if platforms.startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


# --------------------------------------------------------------------------------------------------------------------
# Head layout: fitting q/kv heads onto tp devices
# --------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How the attention heads of one model are laid out over ``tensor_parallel_size`` devices.

    ``kv_replication`` (r) copies of each kv head and ``q_heads_per_kv`` (g') q-head slots per (replicated) kv head;
    see the module docstring. The identity layout has r = 1 and g' = the model's group size.
    """

    tensor_parallel_size: int
    num_q_heads: int
    num_kv_heads: int
    kv_replication: int
    q_heads_per_kv: int

    @property
    def group_size(self) -> int:
        """Original q heads per kv head (g)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def padded_group_size(self) -> int:
        """q-head slots per *original* kv head after the rewrite (r * g' >= g)."""
        return self.kv_replication * self.q_heads_per_kv

    @property
    def num_q_heads_padded(self) -> int:
        return self.num_kv_heads_padded * self.q_heads_per_kv

    @property
    def num_kv_heads_padded(self) -> int:
        return self.num_kv_heads * self.kv_replication

    @property
    def num_padding_q_heads(self) -> int:
        return self.num_q_heads_padded - self.num_q_heads

    @property
    def is_identity(self) -> bool:
        return self.kv_replication == 1 and self.q_heads_per_kv == self.group_size

    @classmethod
    def for_heads(cls, num_q_heads: int, num_kv_heads: int, tensor_parallel_size: int, *,
                  pad_heads: bool = True) -> "HeadLayout":
        """The smallest layout in which every device gets the same number of whole q and kv heads.

        Raises:
          ValueError: ``pad_heads=False`` and the q heads would need padding (names tensor_parallel_size and the
            head counts).
        """
        if num_q_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads ({num_q_heads}) must be a multiple of num_key_value_heads "
                             f"({num_kv_heads})")
        tp = tensor_parallel_size
        group = num_q_heads // num_kv_heads
        num_kv_padded = num_kv_heads * tp // math.gcd(num_kv_heads, tp)  # lcm
        replication = num_kv_padded // num_kv_heads
        q_per_kv = -(-group // replication)
        layout = cls(tp, num_q_heads, num_kv_heads, replication, q_per_kv)
        if layout.num_padding_q_heads and not pad_heads:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the heads evenly (num_attention_heads={num_q_heads}, "
                f"num_key_value_heads={num_kv_heads}): it would need {layout.num_padding_q_heads} zero q heads; "
                f"use a tensor_parallel_size dividing both head counts or allow head padding"
            )
        return layout

    # -- weight rewrites; xp is numpy (host, while loading) or jax.numpy (on device) ---------------------------------

    def expand_q_columns(self, w, head_dim: int, xp=np):
        """q_proj kernel ``[H, Hq*D]`` (or bias ``[Hq*D]``) -> ``[..., Hq'*D]`` with zero padding q heads."""
        lead = w.shape[:-1]
        grouped = w.reshape(*lead, self.num_kv_heads, self.group_size, head_dim)
        pad = self.padded_group_size - self.group_size
        if pad:
            zeros = xp.zeros((*lead, self.num_kv_heads, pad, head_dim), dtype=w.dtype)
            grouped = xp.concatenate([grouped, zeros], axis=-2)
        return grouped.reshape(*lead, self.num_q_heads_padded * head_dim)

    def expand_q_rows(self, w, head_dim: int, xp=np):
        """o_proj kernel ``[Hq*D, H]`` -> ``[Hq'*D, H]`` with zero rows for padding q heads."""
        grouped = w.reshape(self.num_kv_heads, self.group_size, head_dim, w.shape[-1])
        pad = self.padded_group_size - self.group_size
        if pad:
            zeros = xp.zeros((self.num_kv_heads, pad, head_dim, w.shape[-1]), dtype=w.dtype)
            grouped = xp.concatenate([grouped, zeros], axis=1)
        return grouped.reshape(self.num_q_heads_padded * head_dim, w.shape[-1])

    def expand_kv_columns(self, w, head_dim: int, xp=np):
        """k/v_proj kernel ``[H, Hkv*D]`` (or bias ``[Hkv*D]``) -> ``[..., Hkv'*D]``, each kv head repeated r times
        in place (kv head h becomes heads h*r .. h*r + r - 1)."""
        if self.kv_replication == 1:
            return w
        lead = w.shape[:-1]
        heads = w.reshape(*lead, self.num_kv_heads, 1, head_dim)
        repeated = xp.broadcast_to(heads, (*lead, self.num_kv_heads, self.kv_replication, head_dim))
        return repeated.reshape(*lead, self.num_kv_heads_padded * head_dim)


def _param_kind(path: tuple) -> str:
    """Classify a model parameter by its nnx path, e.g. ('model', 'layers', 0, 'self_attn', 'q_proj', 'kernel')."""
    names = [str(p) for p in path]
    leaf = names[-1]
    if names[-2:] == ["embed_tokens", "embedding"]:
        return "embedding"
    if names[0] == "lm_head" and leaf == "kernel":
        return "lm_head"
    if leaf == "scale":
        return "norm"
    if len(names) >= 3 and names[-3] in ("self_attn", "mlp") and leaf in ("kernel", "bias"):
        return f"{names[-2]}.{leaf}"
    raise ValueError(f"no sharding rule for model parameter {'.'.join(names)}")


# Megatron rules: which tensor dim of each parameter kind is split over tp (None = replicated).
_ATTENTION_KINDS = {"q_proj.kernel": 1, "k_proj.kernel": 1, "v_proj.kernel": 1, "q_proj.bias": 0,
                    "k_proj.bias": 0, "v_proj.bias": 0, "o_proj.kernel": 0, "o_proj.bias": None}
_MLP_KINDS = {"gate_proj.kernel": 1, "up_proj.kernel": 1, "down_proj.kernel": 0}
_OTHER_KINDS = {"embedding": 0, "lm_head": 1, "norm": None}


# --------------------------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Everything needed to run one model on a ``(dp, tp)`` mesh.

    Build with ``ShardingPlan.create(config, mesh)``. Fields:
      mesh: the ``("dp", "tp")`` mesh.
      config: the checkpoint's model shape.
      model_config: the shape actually built and run (``config`` with heads rewritten by ``head_layout``); the KV
        pool has ``model_config.num_key_value_heads`` heads.
      head_layout: see ``HeadLayout``.
      kv_layout: "sharded" (attention weights and the KV pool split over kv heads; attention under shard_map) or
        "replicated" (the whole attention block and the KV pool replicated on every tp device; only the MLP,
        embedding and LM head are split).
    """

    mesh: Mesh
    config: ModelConfig
    model_config: ModelConfig
    head_layout: HeadLayout
    kv_layout: str = "sharded"

    @classmethod
    def create(cls, config: ModelConfig, mesh: Mesh, *, kv_layout: str = "sharded",
               pad_heads: bool = True) -> "ShardingPlan":
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"kv_layout must be one of {KV_LAYOUTS}, got {kv_layout!r}")
        if tuple(mesh.axis_names) != (DP_AXIS, TP_AXIS):
            raise ValueError(f"mesh axes must be {(DP_AXIS, TP_AXIS)} (use make_mesh), got {mesh.axis_names}")
        tp = mesh.shape[TP_AXIS]
        if kv_layout == "sharded":
            layout = HeadLayout.for_heads(config.num_attention_heads, config.num_key_value_heads, tp,
                                          pad_heads=pad_heads)
        else:  # attention is not split, the heads stay as they are
            group = config.num_attention_heads // config.num_key_value_heads
            layout = HeadLayout(tp, config.num_attention_heads, config.num_key_value_heads, 1, group)
        model_config = dataclasses.replace(
            config, num_attention_heads=layout.num_q_heads_padded, num_key_value_heads=layout.num_kv_heads_padded
        )
        return cls(mesh, config, model_config, layout, kv_layout)

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh.shape[TP_AXIS]

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.shape[DP_AXIS]

    # -- parameters --------------------------------------------------------------------------------------------------

    def param_spec(self, path: tuple, shape: tuple[int, ...]) -> P:
        """PartitionSpec of one parameter of the (rewritten) model, by its nnx path and shape.

        A dimension that tp does not divide (e.g. an odd vocabulary) is replicated instead of split.
        Raises ValueError for a parameter no rule covers, so a new parameter is never silently replicated.
        """
        kind = _param_kind(path)
        if kind in _ATTENTION_KINDS:
            split_dim = _ATTENTION_KINDS[kind] if self.kv_layout == "sharded" else None
        elif kind in _MLP_KINDS:
            split_dim = _MLP_KINDS[kind]
        elif kind in _OTHER_KINDS:
            split_dim = _OTHER_KINDS[kind]
        else:
            raise ValueError(f"no sharding rule for model parameter {'.'.join(map(str, path))} ({kind})")
        if split_dim is None or shape[split_dim] % self.tensor_parallel_size != 0:
            return P()
        return P(*[TP_AXIS if dim == split_dim else None for dim in range(len(shape))])

    def state_shardings(self, state: nnx.State) -> nnx.State:
        """NamedSharding for every leaf of a model state (concrete or abstract), same tree structure."""
        flat = nnx.to_flat_state(state)
        shardings = []
        for path, leaf in flat:
            value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
            sharding = NamedSharding(self.mesh, self.param_spec(path, tuple(value.shape)))
            shardings.append((path, leaf.replace(sharding) if isinstance(leaf, nnx.Variable) else sharding))
        return nnx.from_flat_state(shardings)

    def rewrite_param(self, path: tuple, value, xp=np):
        """Apply the head rewrite to one parameter in model layout (``[in, out]`` kernels), host or device."""
        return self._rewrite_kind(_param_kind(path), value, xp)

    def _rewrite_kind(self, kind: str, value, xp):
        if self.head_layout.is_identity:
            return value
        head_dim = self.config.head_dim
        if kind in ("q_proj.kernel", "q_proj.bias"):
            return self.head_layout.expand_q_columns(value, head_dim, xp)
        if kind in ("k_proj.kernel", "k_proj.bias", "v_proj.kernel", "v_proj.bias"):
            return self.head_layout.expand_kv_columns(value, head_dim, xp)
        if kind == "o_proj.kernel":
            return self.head_layout.expand_q_rows(value, head_dim, xp)
        return value

    def abstract_model(self, dtype=jnp.float32) -> LlamaForCausalLM:
        """The rewritten (``TensorParallelLlamaForCausalLM``) model with shapes only (no memory)."""
        return nnx.eval_shape(
            lambda: TensorParallelLlamaForCausalLM(self, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
        )

    def shard_model(self, model: LlamaForCausalLM) -> LlamaForCausalLM:
        """Rewrite heads and place an existing (e.g. single-device) model's weights onto the mesh.

        The input model must have the checkpoint's shape (``self.config``); returns a new
        ``TensorParallelLlamaForCausalLM`` of ``self.model_config`` whose parameters are NamedSharding-placed.
        """
        if model.config != self.config:
            raise ValueError("model.config does not match the plan's config")
        _, state = nnx.split(model)
        graphdef, abstract_state = nnx.split(self.abstract_model(model.dtype))
        targets = dict(nnx.to_flat_state(self.state_shardings(abstract_state)))
        placed = []
        for path, variable in nnx.to_flat_state(state):
            value = self.rewrite_param(path, variable.get_value(), jnp)
            placed.append((path, variable.replace(jax.device_put(value, targets[path].get_value()))))
        return nnx.merge(graphdef, nnx.from_flat_state(placed))

    # -- KV pool, activations ----------------------------------------------------------------------------------------

    @property
    def kv_cache_spec(self) -> P:
        """Spec of one ``[num_blocks, block_size, Hkv', D]`` page array: blocks over dp, kv heads over tp."""
        return P(DP_AXIS, None, TP_AXIS if self.kv_layout == "sharded" else None, None)

    @property
    def kv_cache_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.kv_cache_spec)

    @property
    def num_kv_heads_per_device(self) -> int:
        """KV heads each device stores (the KV pool's per-device head count)."""
        heads = self.model_config.num_key_value_heads
        return heads // self.tensor_parallel_size if self.kv_layout == "sharded" else heads

    @property
    def per_device_model_config(self) -> ModelConfig:
        """``model_config`` with the per-device head counts and MLP width: what one device stores and computes, for
        memory accounting (e.g. ``determine_num_blocks(plan.per_device_model_config, ...)`` sizes the KV pool
        by the bytes each device holds)."""
        tp = self.tensor_parallel_size
        if self.kv_layout == "replicated":
            heads = {}
        else:
            heads = {"num_attention_heads": self.model_config.num_attention_heads // tp,
                     "num_key_value_heads": self.model_config.num_key_value_heads // tp}
        inter = self.model_config.intermediate_size
        return dataclasses.replace(self.model_config, intermediate_size=inter // tp if inter % tp == 0 else inter,
                                   **heads)

    @property
    def token_sharding(self) -> NamedSharding:
        """Flat per-token inputs (``input_ids``, ``positions``, metadata with a leading token/sequence axis)."""
        return NamedSharding(self.mesh, P(DP_AXIS))

    @property
    def logits_sharding(self) -> NamedSharding:
        """Logits ``[N, V]`` gathered over tp (rows stay split over dp) so sampling sees the whole vocabulary."""
        return NamedSharding(self.mesh, P(DP_AXIS, None))

    def gather_logits(self, logits: jax.Array) -> jax.Array:
        """Call on ``model.compute_logits(hidden)`` inside jit: ``float32[N, V]`` -> the same, gathered over tp.

        The first constraint pins the LM-head matmul's output to vocabulary shards (so each device multiplies by
        its own ``[H, V/tp]`` slice); the second gathers the ``[N, V]`` logits. Without it XLA may gather the whole
        ``[H, V]`` LM head instead when N is small.
        """
        rows = DP_AXIS if logits.shape[0] % self.data_parallel_size == 0 else None
        if logits.shape[-1] % self.tensor_parallel_size == 0:  # else the LM head is replicated (param_spec)
            logits = jax.lax.with_sharding_constraint(logits, NamedSharding(self.mesh, P(rows, TP_AXIS)))
        return jax.lax.with_sharding_constraint(logits, NamedSharding(self.mesh, P(rows, None)))

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype=jnp.bfloat16) -> list[tuple[jax.Array, jax.Array]]:
        """Zeroed paged KV pool, one ``(k_pages, v_pages)`` per layer, created directly in its shards.

        ``num_blocks`` is the total over dp groups (each group gets ``num_blocks / dp``, its local block 0 null).
        """
        if num_blocks % self.data_parallel_size != 0:
            raise ValueError(f"num_blocks ({num_blocks}) must be divisible by data_parallel_size "
                             f"({self.data_parallel_size})")
        local_shape = (num_blocks // self.data_parallel_size, block_size, self.num_kv_heads_per_device,
                       self.model_config.head_dim)
        # Created by a shard_map inside jit, exactly as the attention's shard_map returns the pages, so the pool
        # has the very sharding a step returns (jax normalizes specs, e.g. drops size-1 axes): feeding a step's
        # output back never looks like a new input sharding to jit (no recompile).
        spec = self.kv_cache_spec
        create = jax.jit(jax.shard_map(lambda: (jnp.zeros(local_shape, dtype), jnp.zeros(local_shape, dtype)),
                                       mesh=self.mesh, in_specs=(), out_specs=(spec, spec), check_vma=False))
        return [create() for _ in range(self.model_config.num_hidden_layers)]

    # -- attention ---------------------------------------------------------------------------------------------------

    def shard_attention(self, local_attention: Callable[..., tuple[jax.Array, Any]], metadata: Any = (),
                        metadata_specs: Any = None) -> AttentionFn:
        """Wrap a per-device attention into a mesh-wide ``AttentionFn`` (``shard_map`` over dp and tp).

        Args:
          local_attention: ``(layer_idx, q[T/dp, Hq'/tp, D], k[T/dp, Hkv'/tp, D], v, kv_layer_shard, metadata_shard)
            -> (out[T/dp, Hq'/tp, D], kv_layer_shard)``: the kernel or reference on one device's heads, tokens and
            KV shard (with the "replicated" layout, all heads). It sees ordinary local arrays.
          metadata: pytree of arrays passed to every call (block tables, lengths, slot mapping, segment ids, ...).
          metadata_specs: their PartitionSpecs; default ``P("dp")`` for every leaf (leading axis split over dp, i.e.
            each dp group gets its own sequences' metadata; with dp = 1 that is plain replication).
        Returns:
          ``attention(layer_idx, q, k, v, kv_layer) -> (out, kv_layer)`` for ``LlamaForCausalLM.__call__``;
          ``kv_layer`` is None or a pytree of page arrays sharded as ``kv_cache_spec``.
        """
        heads = TP_AXIS if self.kv_layout == "sharded" else None
        token_spec = P(DP_AXIS, heads, None)
        if metadata_specs is None:
            metadata_specs = jax.tree.map(lambda _: P(DP_AXIS), metadata)
        mesh = self.mesh
        kv_spec = self.kv_cache_spec

        def attention(layer_idx: int, q: jax.Array, k: jax.Array, v: jax.Array, kv_layer):
            kv_specs = jax.tree.map(lambda _: kv_spec, kv_layer)

            def per_device(q, k, v, kv_layer, metadata):
                return local_attention(layer_idx, q, k, v, kv_layer, metadata)

            # check_vma off: kernels (Pallas/Triton) carry no varying-axis annotations; the specs are exact anyway.
            sharded = jax.shard_map(
                per_device, mesh=mesh, in_specs=(token_spec, token_spec, token_spec, kv_specs, metadata_specs),
                out_specs=(token_spec, kv_specs), check_vma=False,
            )
            return sharded(q, k, v, kv_layer, metadata)

        attention.runs_on_mesh = mesh  # TensorParallelLlamaForCausalLM passes it through unwrapped
        return attention

    def wrap_attention(self, attention: AttentionFn) -> AttentionFn:
        """Run an ordinary single-device ``AttentionFn`` on each device's heads (tp only, dp = 1).

        ``attention`` is written for one device (e.g. ``write_kv`` + ``ragged_paged_attention`` closing over its
        metadata); inside ``shard_map`` it sees ``q[T, Hq'/tp, D]``, ``k, v[T, Hkv'/tp, D]`` and the local KV shard
        ``[num_blocks, block_size, Hkv'/tp, D]``, and what it closes over (block tables, lengths, slot mapping) is
        read as replicated. ``TensorParallelLlamaForCausalLM`` applies this automatically, so ``generate`` and other
        callers need no attention changes.

        Limitation (jax's): the arrays the closure captures must not descend from jit inputs committed to the mesh
        (``jax.device_put(x, NamedSharding(...))``): jax refuses to index such an array inside ``shard_map``.
        Pass host metadata uncommitted (numpy, or computed inside the jit), or build the attention with
        ``paged_attention`` / ``shard_attention``, which take the metadata as explicit ``shard_map`` inputs (the
        engine's runner does that).
        Raises ValueError for dp > 1 (the metadata would have to be split; use ``shard_attention``).
        """
        if getattr(attention, "runs_on_mesh", None) is not None:
            return attention
        if self.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size={self.data_parallel_size}: a single-device attention cannot be split over dp; "
                f"build it with ShardingPlan.shard_attention / paged_attention"
            )
        return self.shard_attention(lambda layer_idx, q, k, v, kv_layer, _: attention(layer_idx, q, k, v, kv_layer))

    def paged_attention(self, *, slot_mapping: jax.Array, kv_lens: jax.Array, block_tables: jax.Array,
                        cu_q_lens: jax.Array, sm_scale: float, sliding_window: int | None = None,
                        impl: str = "auto") -> AttentionFn:
        """Mesh-wide paged attention: ``write_kv`` then ``ragged_paged_attention`` on each device's heads.

        Metadata shapes are the global ones with the dp groups stacked: ``slot_mapping int32[T]`` (local slots),
        ``kv_lens int32[dp*S]``, ``block_tables int32[dp*S, max_blocks]`` (local block ids), ``cu_q_lens
        int32[dp*(S+1)]`` (each group's offsets start at 0). With dp = 1 these are exactly the ops' arguments.
        """
        from paged_jax.ops import write_and_attend

        def local(layer_idx, q, k, v, kv_layer, meta):
            return write_and_attend(meta, q, k, v, kv_layer, sm_scale=sm_scale, sliding_window=sliding_window,
                                    impl=impl)

        return self.shard_attention(local, dict(slot_mapping=slot_mapping, kv_lens=kv_lens,
                                                block_tables=block_tables, cu_q_lens=cu_q_lens))


# --------------------------------------------------------------------------------------------------------------------
# The tensor-parallel model
# --------------------------------------------------------------------------------------------------------------------

class TensorParallelLlamaForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` of ``plan.model_config`` that knows its ``ShardingPlan``.

    Same parameters, same call signature; the differences are what make callers mesh-agnostic:
      * ``__call__`` runs the given ``AttentionFn`` under ``shard_map`` on each device's heads
        (``plan.wrap_attention``), unless it already is mesh-wide (built by ``plan.shard_attention`` /
        ``plan.paged_attention``, which dp > 1 requires);
      * ``compute_logits`` returns logits gathered over tp (``plan.gather_logits``), so sampling sees the whole
        vocabulary and the LM head is never gathered.
    The plan is static module data (hashable), so it lives in the graphdef and survives ``nnx.split``/``merge``.
    """

    def __init__(self, plan: "ShardingPlan", *, dtype=jnp.bfloat16, param_dtype=None, rngs: nnx.Rngs):
        super().__init__(plan.model_config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.sharding_plan = plan

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list | None,
                 attention: AttentionFn) -> tuple[jax.Array, list | None]:
        return super().__call__(input_ids, positions, kv_caches, self.sharding_plan.wrap_attention(attention))

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        return self.sharding_plan.gather_logits(super().compute_logits(hidden))


# --------------------------------------------------------------------------------------------------------------------
# Loading straight into shards
# --------------------------------------------------------------------------------------------------------------------

def load_sharded_model(path, plan: ShardingPlan, *, dtype: Any = "bfloat16", load_format: str = "auto",
                       seed: int = 0) -> LlamaForCausalLM:
    """``models.loader.load_model`` for a mesh: every weight goes straight into its shards.

    safetensors: each tensor is read on the host, transposed/head-rewritten/cast there, and ``jax.device_put`` with
    its NamedSharding, which sends each device only its slice; no device ever holds a full copy of a split tensor
    and the host holds one tensor at a time. "dummy": N(0, 0.02) weights generated inside one jit whose outputs
    are already sharded (then head-rewritten, so padding heads are exactly zero as with a checkpoint).

    Args:
      path: checkpoint directory (ignored for "dummy").
      plan: from ``ShardingPlan.create(config, mesh)``; ``plan.config`` must be the checkpoint's config.
      dtype, load_format, seed: as in ``load_model``.
    Returns:
      a ``TensorParallelLlamaForCausalLM`` of ``plan.model_config``.
    """
    from models import loader

    if load_format not in loader.LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is unsupported; use one of {', '.join(loader.LOAD_FORMATS)}")
    jnp_dtype = loader.resolve_dtype(dtype)
    graphdef, abstract_state = nnx.split(plan.abstract_model(jnp_dtype))
    shardings = plan.state_shardings(abstract_state)

    if load_format == "dummy":
        return _init_dummy_sharded(plan, graphdef, shardings, jnp_dtype, seed)

    if path is None:
        raise ValueError(f"load_format={load_format!r} needs a checkpoint path")
    tensor_files = loader._checkpoint_tensor_files(Path(path))
    original_state = nnx.state(nnx.eval_shape(
        lambda: LlamaForCausalLM(plan.config, dtype=jnp_dtype, param_dtype=jnp_dtype, rngs=nnx.Rngs(0))
    ))
    expected_shapes = {p: tuple(v.get_value().shape) for p, v in nnx.to_flat_state(original_state)}
    target_shardings = dict(nnx.to_flat_state(shardings))
    wanted = {}  # hf name -> (param path, transposed)
    for param_path in expected_shapes:
        hf_name, transposed = loader.hf_name_for(param_path)
        wanted[hf_name] = (param_path, transposed)
    missing = sorted(name for name in wanted if name not in tensor_files)
    if missing:
        raise ValueError(f"checkpoint is missing tensor(s) {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    unexpected = sorted(
        name for name in tensor_files
        if name not in wanted and not loader._IGNORABLE_TENSOR.search(name)
        and not (plan.config.tie_word_embeddings and name == "lm_head.weight")  # a redundant copy of the embedding
    )
    if unexpected:
        raise ValueError(f"checkpoint has unexpected tensor(s) {unexpected[:8]}"
                         f"{' ...' if len(unexpected) > 8 else ''} for {plan.config.architecture}")

    names_by_file: dict[Path, list[str]] = {}
    for hf_name in wanted:
        names_by_file.setdefault(tensor_files[hf_name], []).append(hf_name)
    loaded = []
    np_dtype = np.dtype(jnp_dtype)
    for file_path, names in names_by_file.items():
        with loader._open_safetensors(file_path) as handle:
            for hf_name in names:
                param_path, transposed = wanted[hf_name]
                array = loader._read_tensor(handle, hf_name, file_path)
                model_shape = expected_shapes[param_path]
                expected_hf_shape = model_shape[::-1] if transposed else model_shape
                if tuple(array.shape) != expected_hf_shape:
                    raise ValueError(f"tensor {hf_name!r} in {file_path} has shape {tuple(array.shape)} but the "
                                     f"model expects {expected_hf_shape}")
                # Host-side: transpose to model layout, cast, rewrite heads; then only each shard is sent.
                array = array.T if transposed else array
                array = np.ascontiguousarray(plan.rewrite_param(param_path, array.astype(np_dtype), np))
                target = target_shardings[param_path]
                loaded.append((param_path, target.replace(jax.device_put(array, target.get_value()))))
    return nnx.merge(graphdef, nnx.from_flat_state(loaded))


def _init_dummy_sharded(plan: ShardingPlan, graphdef, shardings: nnx.State, dtype, seed: int):
    """Random weights identical to ``models.loader.init_dummy_model(plan.config, seed=seed)`` (so every layout of a
    benchmark runs the same model), each generated by a jit whose output is already sharded.

    Matches the loader's scheme: parameter ``i`` (flat order of the checkpoint-shaped model) is
    ``N(0, INIT_STD)`` drawn in float32 from ``fold_in(key(seed), i)``, norms 1, biases 0; the head rewrite runs
    inside the same jit. With partitionable threefry (jax's default) the values do not depend on the sharding.
    """
    original_state = nnx.state(nnx.eval_shape(
        lambda: LlamaForCausalLM(plan.config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
    ))
    targets = dict(nnx.to_flat_state(shardings))
    base_key = jax.random.key(seed)
    created = []
    for index, (path, variable) in enumerate(nnx.to_flat_state(original_state)):
        spec = variable.get_value()
        leaf = str(path[-1])
        fill = 1.0 if leaf == "scale" else 0.0 if leaf == "bias" else None
        make = _dummy_param_fn(plan, _param_kind(path), tuple(spec.shape), jnp.dtype(spec.dtype), fill,
                               targets[path].get_value())
        created.append((path, targets[path].replace(make(jax.random.fold_in(base_key, index)))))
    return nnx.merge(graphdef, nnx.from_flat_state(created))


@functools.lru_cache(maxsize=256)
def _dummy_param_fn(plan: ShardingPlan, kind: str, shape: tuple[int, ...], dtype, fill: float | None,
                    sharding: NamedSharding):
    """Jitted ``key -> parameter`` for one (kind, shape, dtype, sharding), compiled once and reused per layer."""
    from models.llama import INIT_STD

    def make(key):
        if fill is not None:
            value = jnp.full(shape, fill, dtype)
        else:
            value = (jax.random.normal(key, shape, jnp.float32) * INIT_STD).astype(dtype)
        return plan._rewrite_kind(kind, value, jnp)

    return jax.jit(make, out_shardings=sharding)


# --------------------------------------------------------------------------------------------------------------------
# Inspection helpers (tests, benchmarks)
# --------------------------------------------------------------------------------------------------------------------

def bytes_per_device(tree: Any) -> dict[jax.Device, int]:
    """Bytes of every jax Array leaf of ``tree`` held on each (addressable) device."""
    totals: dict[jax.Device, int] = {}
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, nnx.Variable):
            leaf = leaf.get_value()
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            totals[shard.device] = totals.get(shard.device, 0) + shard.data.size * shard.data.dtype.itemsize
    return totals


def count_collectives(hlo_text: str) -> dict[str, int]:
    """Count collective ops (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute) in HLO text.

    Counts instruction definitions (``= f32[..] all-reduce(``), async starts once (``all-reduce-start``).
    """
    counts = {}
    for op in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"):
        counts[op] = len(re.findall(rf"\s{op}(?:-start)?\(", hlo_text))
    return counts
