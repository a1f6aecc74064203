"""Device meshes and multi-host start-up for tensor / data parallelism.

``make_mesh`` builds the ``("dp", "tp")`` mesh every ``ShardingPlan`` runs on. Multi-host: call
``initialize_distributed()`` first in every process (see its docstring); the mesh then spans all processes' devices
and everything else works unchanged.
"""

from __future__ import annotations

import os
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

DP_AXIS = "dp"
TP_AXIS = "tp"

# Environment variables read by initialize_distributed().
ENV_COORDINATOR = "PAGED_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "PAGED_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "PAGED_JAX_PROCESS_ID"
# JAX's own variables: when set, jax.distributed.initialize() needs no arguments.
_JAX_DISTRIBUTED_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


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
                           initialization_timeout: int = 300, heartbeat_timeout_seconds: int | None = None) -> bool:
    """Join a multi-process (multi-host) JAX job; call once per process before any other JAX call.

    Settings come from the arguments, else from ``PAGED_JAX_COORDINATOR`` ("host:port" of process 0),
    ``PAGED_JAX_NUM_PROCESSES`` and ``PAGED_JAX_PROCESS_ID``; else, if JAX's own ``JAX_COORDINATOR_ADDRESS`` (etc.)
    or a cluster JAX auto-detects (SLURM, Cloud TPU, ...) is present, ``jax.distributed.initialize()`` is called
    without arguments. With none of these it is a single-process run and nothing happens.

    On CPU the cross-process collectives use gloo (set before the backend starts).

    ``heartbeat_timeout_seconds`` (None: JAX's default, 100 s): when a process stops sending heartbeats for that
    long, JAX's coordination service reports it dead to every other process, which then terminates with "Terminating
    process because the JAX distributed service detected fatal errors" (so no rank hangs in a collective forever).

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
    if heartbeat_timeout_seconds is not None:
        kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout_seconds)
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
