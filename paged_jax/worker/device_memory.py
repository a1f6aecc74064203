"""How much accelerator memory the engine may use: ``gpu_memory_utilization`` as vLLM means it, a fraction of the
device's TOTAL memory, against JAX's allocator, which by default reserves only 75% of a GPU for itself.

JAX's GPU allocator is capped at ``XLA_CLIENT_MEM_FRACTION`` (formerly ``XLA_PYTHON_CLIENT_MEM_FRACTION``; default
0.75) of the device memory, read once when the backend starts. So:

* ``reserve_gpu_memory_fraction(u)``, called by ``LLMEngine`` before anything starts a JAX backend, sets that
  variable to ``u`` when the user has not set it: the engine's process then holds exactly the vLLM share;
* ``usable_device_bytes(stats, platform, u)`` turns a device's ``memory_stats()`` into ``(total, usable)`` bytes:
  total = ``bytes_limit`` / the allocator fraction on a GPU (``bytes_limit`` itself elsewhere), usable =
  ``u * total``, but never more than the allocator's limit (then a warning says which variable to set);
* ``place_contiguously(model)`` re-places weights quantized on the device at load, so that the free memory the KV
  sizing counts is not split by the buffers they replaced.
"""

from __future__ import annotations

import logging
import math
import os

import jax
import numpy as np

logger = logging.getLogger(__name__)

MEM_FRACTION_ENV = "XLA_CLIENT_MEM_FRACTION"
DEPRECATED_MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
JAX_DEFAULT_GPU_MEM_FRACTION = 0.75  # XLA's GPU client default when neither variable is set
GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def allocator_fraction() -> float:
    """The fraction of GPU memory JAX's allocator is (or will be) capped at, from the environment."""
    value = os.environ.get(MEM_FRACTION_ENV) or os.environ.get(DEPRECATED_MEM_FRACTION_ENV)
    return float(value) if value else JAX_DEFAULT_GPU_MEM_FRACTION


def reserve_gpu_memory_fraction(gpu_memory_utilization: float) -> bool:
    """Cap JAX's GPU allocator at ``gpu_memory_utilization`` of the device (instead of its default 75%), if no JAX
    backend has started yet and the user set neither variable. Returns whether it set the variable."""
    from jax._src import xla_bridge

    if os.environ.get(MEM_FRACTION_ENV) or os.environ.get(DEPRECATED_MEM_FRACTION_ENV):
        return False
    if xla_bridge.backends_are_initialized():
        return False  # too late: the allocator's cap is fixed; usable_device_bytes warns if it is too small
    os.environ[MEM_FRACTION_ENV] = repr(float(gpu_memory_utilization))
    return True


def usable_device_bytes(stats: dict, platform: str, gpu_memory_utilization: float) -> tuple[int, int]:
    """``(total, usable)`` bytes of one device from its ``memory_stats()`` (needs ``bytes_limit``).

    ``usable = gpu_memory_utilization * total``, capped at the allocator's ``bytes_limit`` with a warning naming
    the variable that would lift the cap.
    """
    limit = int(stats["bytes_limit"])
    fraction = allocator_fraction() if platform in GPU_PLATFORMS else 1.0
    total = int(limit / fraction)
    wanted = int(gpu_memory_utilization * total)
    if wanted <= limit:
        return total, wanted
    logger.warning(
        "gpu_memory_utilization=%s asks for %.2f GiB of the device's %.2f GiB, but JAX's allocator was started "
        "with a cap of %.2f GiB (%s=%s): using %.2f GiB. Set %s=%s before start-up (it must be set before JAX "
        "initializes its GPU backend) to use the requested share.", gpu_memory_utilization, wanted / 2**30,
        total / 2**30, limit / 2**30, MEM_FRACTION_ENV, fraction, limit / 2**30, MEM_FRACTION_ENV,
        gpu_memory_utilization)
    return total, limit


def describe_allocator(device) -> str:
    """One line of ``device``'s allocator statistics (in use, limit, largest free region, allocations), or "" without
    them (the CPU). ``device``: a ``jax.Device``, or a sharding (its first device's statistics)."""
    if isinstance(device, jax.sharding.Sharding):
        device = min(device.device_set, key=lambda d: d.id)
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return ""
    gib = lambda key: f"{int(stats.get(key, 0)) / 2**30:.2f} GiB"  # noqa: E731
    return (f"JAX's allocator: {gib('bytes_in_use')} in use of its {gib('bytes_limit')} limit, largest free region "
            f"{gib('largest_free_block_bytes')}, {stats.get('num_allocs', '?')} allocations")


def free_bytes(device) -> int | None:
    """The bytes ``device``'s allocator has free (its limit less the bytes in use), or None without memory statistics
    (the CPU)."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats["bytes_in_use"])


def _bytes(array) -> int:
    """Bytes of ``array`` (a ``jax.Array`` or ``ShapeDtypeStruct``; across all its devices)."""
    return math.prod(array.shape) * np.dtype(array.dtype).itemsize


def check_pool_fits(device, pool_arrays: list) -> None:
    """Before the KV pool (``pool_arrays``: its arrays' ``ShapeDtypeStruct``s) is allocated on ``device``: a
    ``RuntimeError`` saying what holds the memory when the allocator has less free (its limit less the bytes in use),
    or when its largest free region is smaller than one array (the free memory is split), instead of the allocator's
    own out-of-memory error part way through. No check without memory statistics (the CPU)."""
    stats = device.memory_stats() if device.platform != "cpu" else None
    if not stats or "bytes_limit" not in stats:
        return
    pool_bytes, array_bytes = sum(map(_bytes, pool_arrays)), max(map(_bytes, pool_arrays))
    free = int(stats["bytes_limit"]) - int(stats["bytes_in_use"])
    largest = int(stats.get("largest_free_block_bytes", free))
    if pool_bytes > free or array_bytes > largest:
        raise RuntimeError(
            f"The KV pool needs {pool_bytes / 2**30:.2f} GiB in arrays of {array_bytes / 2**30:.2f} GiB; "
            f"{describe_allocator(device)}: lower --gpu-memory-utilization or set --num-gpu-blocks-override")


def pool_allocation_error(device, pool_arrays: list, error: Exception) -> RuntimeError:
    """The ``RuntimeError`` for an allocator out-of-memory ``error`` while the KV pool (``pool_arrays``: its arrays or
    their ``ShapeDtypeStruct``s) is being allocated: the allocator's statistics and the flags that size the pool."""
    return RuntimeError(f"Allocating the KV pool ({sum(map(_bytes, pool_arrays)) / 2**30:.2f} GiB) ran out of device "
                        f"memory; {describe_allocator(device)}: lower --gpu-memory-utilization or set "
                        f"--num-gpu-blocks-override ({error})")


def place_contiguously(model) -> None:
    """Copy ``model``'s (an NNX module) device arrays to the host, free them, and put them back, in order.

    Quantizing weights on the device at load (online ``int8`` / ``fp8``, dummy weights in a checkpoint method's
    layout) frees each full-precision weight after its quantized copy is made: the freed buffers lie between the
    quantized ones, and the allocator cannot join them into one region. Placed again from the host, the weights
    sit side by side and the free memory the KV sizing counts is one region."""
    import jax
    import numpy as np
    from flax import nnx

    state = nnx.state(model)
    on_host = jax.tree.map(lambda x: (np.asarray(x), x.sharding) if isinstance(x, jax.Array) else x, state)
    for x in jax.tree.leaves(state):
        if isinstance(x, jax.Array):
            x.delete()
    nnx.update(model, jax.tree.map(lambda leaf: jax.device_put(*leaf) if isinstance(leaf, tuple) else leaf, on_host,
                                   is_leaf=lambda leaf: isinstance(leaf, tuple)))
