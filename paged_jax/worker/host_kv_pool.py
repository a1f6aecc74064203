"""The host side of the KV pool: swap preemption's host pool and the prefix cache's host tier
(``paged_jax.core.kv_offload``), one JAX array per host block in host memory (``pinned_host`` where the platform
offers it: copies to and from it are DMA transfers that run beside the device's compute), and the copies between it
and the device pool.

A step's ``swap_out = [(device_block, host_block)]`` and ``swap_in = [(host_block, device_block)]`` are applied
before its forward (``HostKVPool.swap``), all dispatched without waiting for the device:

- saves: a chunk of the device -> host copies' blocks is gathered on the device (before anything of the step writes
  the pool), one output array per block. Their transfers to host memory (one ``jax.device_put`` to the host memory
  kind for all of the step's blocks: asynchronous) are dispatched by ``finish_saves``, which the runner calls once
  the step's forward is dispatched: dispatching them costs the host time per block, and the gathered copies already
  hold the data, so that time is spent while the device runs the forward instead of before it. Each transferred
  array becomes its host block's array at once. Nothing reads it back on the host.
- loads: the host -> device copies start the transfers of their host blocks' arrays to the device (asynchronous, on
  the runtime's transfer streams: they overlap the step still running on the device), and a compiled scatter writes
  them into the donated pool. A load reads the host block's array as it was before this step's saves: a step's loads
  see what earlier steps saved, never what it saves itself. A load of a block whose save has not finished yet is
  ordered after that save by the runtime (the array is not defined before its copy is done), never by the host.

Copies hold device memory until they are done: a save its gathered blocks until they are in host memory, a load
its transferred blocks until its scatter has run. At most ``MAX_IN_FLIGHT_BLOCKS`` blocks of saves, and as many of
loads, are under way: before a chunk would pass that, the oldest copies are waited for (the only wait on the step
path). The KV pool's sizing leaves room for them and the copies' own scratch (``DEVICE_COPY_BLOCKS``,
``paged_jax.worker.kv_pool_sizing``): a few chunks, so that the device pool keeps its blocks (the prefix cache's
tier saves most blocks a few at a time ahead of their eviction, ``paged_jax.core.kv_offload``).

Copies go in chunks of at most ``MAX_SWAP_CHUNK`` blocks padded to a power of two with the null block: the sizes
``buckets.swap_sizes_for`` lists, compiled at warm-up (one gather and one scatter each), so no copy compiles.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.worker.buckets import MAX_SWAP_CHUNK

logger = logging.getLogger(__name__)

NULL_BLOCK_ID = 0
MAX_IN_FLIGHT_BLOCKS = 2 * MAX_SWAP_CHUNK  # blocks of saves, and of loads, under way at most
DEVICE_COPY_BLOCKS = 2 * MAX_IN_FLIGHT_BLOCKS + MAX_SWAP_CHUNK  # device blocks the copies hold at most (pool sizing)
# The host memory kinds a host block may live in, preferred first: pinned memory is what DMA engines copy from and to
# without a staging copy; unpinned host memory still works, through the runtime's staging.
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")
# XLA's pinned host allocator on the GPU is capped (GiB; this variable, read when the GPU backend starts; a smaller
# default when the allocator preallocates its whole cap).
GPU_PINNED_LIMIT_ENV = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
GPU_PINNED_PREALLOCATE_ENV = "XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE"
GPU_PINNED_LIMIT_DEFAULT_GIB = {False: 64, True: 16}
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
RESERVE_CHUNK_BYTES = 1 << 30  # host memory reserved per allocation at start-up


def gather_blocks(kv_pool, block_ids):
    """The pool's blocks ``block_ids`` i32[n] -> a tuple of n arrays ``[slots, 2 (k|v), block_size, Hkv, D]``, one
    per block (each its own host block once copied)."""
    stacked = jnp.stack([jnp.stack([k[block_ids], v[block_ids]], axis=1) for k, v in kv_pool], axis=1)
    return tuple(stacked[i] for i in range(block_ids.shape[0]))


def scatter_blocks(kv_pool, block_ids, blocks):
    """Write ``blocks`` (a tuple of n ``[slots, 2, block_size, Hkv, D]``) into the pool's blocks ``block_ids``
    i32[n]; -> (the pool, i32[] ready once the scatter has run: the pool itself is donated to the next program)."""
    data = jnp.stack(blocks)
    return ([(k.at[block_ids].set(data[:, i, 0]), v.at[block_ids].set(data[:, i, 1]))
             for i, (k, v) in enumerate(kv_pool)], block_ids.sum())


def chunks(items: list, size: int = MAX_SWAP_CHUNK) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def padded_size(num_blocks: int) -> int:
    """The compiled copy size of a chunk of ``num_blocks`` blocks: the next power of two."""
    return 1 << max(num_blocks - 1, 0).bit_length()


def host_memory_kind(device: jax.Device) -> str:
    """The memory kind host blocks live in on ``device``'s platform: the first of ``HOST_MEMORY_KINDS`` it offers.
    ValueError when it offers none."""
    kinds = {memory.kind for memory in device.addressable_memories()}
    for kind in HOST_MEMORY_KINDS:
        if kind in kinds:
            return kind
    raise ValueError(f"swap_space / kv_offloading_size: the {device.platform} device offers no host memory kind "
                     f"(it has {sorted(kinds)}; the host KV pool needs one of {list(HOST_MEMORY_KINDS)})")


def check_pinned_host_limit(num_bytes: int, platform: str, environ=os.environ) -> None:
    """ValueError naming the flags when ``num_bytes`` of pinned host blocks exceed what XLA's pinned host allocator
    holds on a GPU (``GPU_PINNED_LIMIT_ENV``); other platforms have no such cap."""
    if platform not in GPU_PLATFORMS:
        return
    preallocate = environ.get(GPU_PINNED_PREALLOCATE_ENV, "").lower() in ("1", "true")
    limit_gib = int(environ.get(GPU_PINNED_LIMIT_ENV, GPU_PINNED_LIMIT_DEFAULT_GIB[preallocate]))
    if num_bytes > limit_gib * 2**30:
        raise ValueError(f"swap_space / kv_offloading_size: the host KV pool needs {num_bytes / 2**30:.1f} GiB of "
                         f"pinned host memory, more than XLA's pinned host allocator holds ({limit_gib} GiB): lower "
                         f"them, or raise the cap with {GPU_PINNED_LIMIT_ENV} in the environment before JAX starts")


def _first_device(device) -> jax.Device:
    return min(device.device_set, key=lambda d: d.id) if isinstance(device, jax.sharding.Sharding) else device


def _ready(arrays: list[jax.Array]) -> bool:
    return all(array.is_ready() for array in arrays)


class _InFlight:
    """Copies under way, oldest first, each with the arrays that are ready once it is done and its block count; at
    most ``cap`` blocks: past it the oldest is waited for."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.num_blocks = 0
        self._queue: collections.deque[tuple[list[jax.Array], int]] = collections.deque()
        self.waits, self.wait_seconds = 0, 0.0

    def make_room(self, num_blocks: int) -> None:
        """Before a copy of ``num_blocks`` allocates its device arrays: wait for the oldest copies until it fits
        under the cap (or nothing is under way)."""
        while self._queue and _ready(self._queue[0][0]):
            self._pop()
        while self._queue and self.num_blocks + num_blocks > self.cap:
            start = time.perf_counter()
            jax.block_until_ready(self._queue[0][0])
            self.waits += 1
            self.wait_seconds += time.perf_counter() - start
            self._pop()

    def add(self, markers: list[jax.Array], num_blocks: int) -> None:
        self._queue.append((markers, num_blocks))
        self.num_blocks += num_blocks

    def _pop(self) -> None:
        self.num_blocks -= self._queue.popleft()[1]

    def wait_all(self) -> None:
        jax.block_until_ready([markers for markers, _ in self._queue])
        self._queue.clear()
        self.num_blocks = 0


class HostKVPool:
    """``num_blocks`` host blocks, each an array ``[slots, 2, block_size, Hkv, D]`` in host memory once saved (None
    before), and the step's copies.

    Args:
      num_blocks: host blocks (the swap pool's, then the host tier's).
      block_shape: ``(slots, 2, block_size, Hkv, D)`` of one block (slots: the device pool's layers or slots).
      dtype: the KV pool's element type.
      gather / scatter: the runner's compiled ``gather_blocks`` / ``scatter_blocks`` (``AheadOfTimeFunction`` s, or
        jitted functions).
      device: where block ids go (a device or sharding); its platform picks the host memory kind.
      max_in_flight: blocks of saves, and of loads, allowed under way before the oldest is waited for.

    ``bytes_loaded`` / ``bytes_saved`` count the bytes copied each way, ``swap_seconds`` the host time spent
    dispatching them. On a GPU the pool's pinned host memory is reserved at construction (``reserve_host_memory``).
    """

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype, *, gather: Callable,
                 scatter: Callable, device, max_in_flight: int = MAX_IN_FLIGHT_BLOCKS) -> None:
        self.num_blocks = num_blocks
        self.block_shape = tuple(block_shape)
        self.dtype = np.dtype(dtype)
        self._first_device = first = _first_device(device)
        self.memory_kind = host_memory_kind(first)
        if self.memory_kind == "pinned_host":
            check_pinned_host_limit((num_blocks + max_in_flight) * self.block_bytes, first.platform)
        self._blocks: list[jax.Array | None] = [None] * num_blocks
        self._gather, self._scatter, self._device = gather, scatter, device
        # The gathered blocks' sharding (what the scatter takes back), from the first save.
        self._block_sharding: jax.sharding.Sharding | None = None
        self._saves, self._loads = _InFlight(max_in_flight), _InFlight(max_in_flight)
        self.bytes_loaded = self.bytes_saved = 0
        self.swap_seconds = 0.0
        # What the copies cost the host: steps with copies, compiled gathers / scatters called, device_put calls
        # (each moves a list of blocks), blocks each way, waits for copies in flight past the cap and their seconds,
        # seconds in ``swap`` (before the forward) and in ``finish_saves`` (after it).
        self.counts: collections.Counter = collections.Counter()
        self._pending_saves: list[tuple[list[int], list[jax.Array]]] = []  # gathered, not yet sent to host memory
        if self.memory_kind == "pinned_host" and first.platform in GPU_PLATFORMS:
            seconds = self.reserve_host_memory()
            logger.info("Reserved %.1f GiB of pinned host memory for %d host KV blocks in %.1f s",
                        num_blocks * self.block_bytes / 2**30, num_blocks, seconds)

    @property
    def block_bytes(self) -> int:
        return int(np.prod(self.block_shape)) * self.dtype.itemsize

    def reserve_host_memory(self) -> float:
        """Allocate the pool's bytes in its host memory kind at once, then free them; -> seconds taken. XLA's pinned
        host allocator on a GPU grows by regions it pins when first needed (a driver call that takes seconds for the
        larger ones, in doubling sizes) and keeps them: reserving them here moves those stalls out of the steps that
        first fill the pool."""
        start = time.perf_counter()
        per_chunk = max(1, RESERVE_CHUNK_BYTES // self.block_bytes)
        zeros = np.zeros((per_chunk,) + self.block_shape, self.dtype)
        sharding = jax.sharding.SingleDeviceSharding(self._first_device, memory_kind=self.memory_kind)
        held = [jax.device_put(zeros[:min(per_chunk, self.num_blocks - first)], sharding)
                for first in range(0, self.num_blocks, per_chunk)]
        jax.block_until_ready(held)
        return time.perf_counter() - start

    def swap(self, kv_pool: list, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]], *,
             defer_saves: bool = False) -> list:
        """Apply one step's copies before its forward (see the module docstring): the saves' gathers, the loads,
        then the saves' transfers to host memory, or with ``defer_saves`` not before ``finish_saves`` (the runner's
        call once the forward is dispatched). Returns the pool (the scatters donate it)."""
        start = time.perf_counter()
        self.finish_saves()  # an earlier step's, when nothing dispatched a forward since
        sources = self._sources([h for h, _ in swap_in])  # before this step's saves replace any of them
        # The gathers first: they read the pool before the loads' scatters (donating it) write into it.
        for chunk in chunks(list(swap_out)):
            if self._saves.num_blocks + self._num_pending_saves + len(chunk) > self._saves.cap:
                self.finish_saves()  # the oldest copies must be under way before they can be waited for
            self._saves.make_room(len(chunk))
            blocks = self._call(self._gather, kv_pool, self._padded_ids([d for d, _ in chunk]))
            self._pending_saves.append(([h for _, h in chunk], blocks[:len(chunk)]))
        for chunk in chunks(list(zip(sources, [d for _, d in swap_in]))):
            self._loads.make_room(len(chunk))
            blocks = self._transfer([source for source, _ in chunk])
            # Padding entries write a copy of the last block into the null block, which no valid token reads.
            blocks += [blocks[-1]] * (padded_size(len(chunk)) - len(chunk))
            kv_pool, done = self._call(self._scatter, kv_pool, self._padded_ids([d for _, d in chunk]),
                                       tuple(blocks))
            self._loads.add([done], len(chunk))
        self._count_step(start)
        if not defer_saves:
            self.finish_saves()
        return kv_pool

    def finish_saves(self) -> None:
        """Start the transfers to host memory of the blocks the last ``swap`` gathered, in one ``device_put``: they
        become their host blocks' arrays at once. The runner calls it once the step's forward is dispatched, so that
        dispatching them is off the forward's path (the gathers already hold the blocks' data)."""
        if not self._pending_saves:
            return
        start = time.perf_counter()
        pending, self._pending_saves = self._pending_saves, []
        gathered = [block for _, blocks in pending for block in blocks]
        self._block_sharding = gathered[0].sharding
        host = jax.device_put(gathered, self._block_sharding.with_memory_kind(self.memory_kind))
        self.counts["transfers"] += 1
        self.counts["blocks_saved"] += len(host)
        first = 0
        for host_ids, blocks in pending:
            arrays = host[first:first + len(blocks)]
            self._blocks_by_id(host_ids, arrays)
            self._saves.add(arrays, len(arrays))
            first += len(blocks)
        self.bytes_saved += len(host) * self.block_bytes
        elapsed = time.perf_counter() - start
        self.swap_seconds += elapsed
        self.counts["save_dispatch_s"] += elapsed

    def _sources(self, host_ids: Sequence[int]) -> list[jax.Array]:
        """``host_ids``' arrays; RuntimeError naming those never saved."""
        sources = [self._blocks[h] for h in host_ids]
        missing = [h for h, source in zip(host_ids, sources) if source is None]
        if missing:
            raise RuntimeError(f"swap_in of host blocks never saved: {missing}")
        return sources

    def _transfer(self, sources: list[jax.Array]) -> list[jax.Array]:
        self.bytes_loaded += len(sources) * self.block_bytes
        self.counts["transfers"] += 1
        self.counts["blocks_loaded"] += len(sources)
        return jax.device_put(sources, self._block_sharding)

    def fetch(self, host_ids: Sequence[int]) -> list[jax.Array]:
        """Start the host -> device transfers of ``host_ids``' blocks; -> their device arrays (not waited for)."""
        self.finish_saves()
        return self._transfer(self._sources(host_ids))

    @property
    def _num_pending_saves(self) -> int:
        return sum(len(blocks) for _, blocks in self._pending_saves)

    def _blocks_by_id(self, host_ids: list[int], arrays: list[jax.Array]) -> None:
        for host_id, array in zip(host_ids, arrays):
            self._blocks[host_id] = array

    def _call(self, program: Callable, *args):
        self.counts["programs"] += 1
        return program(*args)

    def _count_step(self, start: float) -> None:
        elapsed = time.perf_counter() - start
        self.swap_seconds += elapsed
        self.counts["steps"] += 1
        self.counts["swap_dispatch_s"] += elapsed
        self.counts["waits"], self.counts["wait_s"] = (self._saves.waits + self._loads.waits,
                                                       self._saves.wait_seconds + self._loads.wait_seconds)

    @property
    def num_in_flight(self) -> tuple[int, int]:
        """(blocks of saves not known to be in host memory yet, blocks of loads not known to be scattered yet)."""
        return self._saves.num_blocks + self._num_pending_saves, self._loads.num_blocks

    def block_array(self, host_id: int) -> jax.Array | None:
        """Host block ``host_id``'s array (in ``memory_kind``; None: never saved)."""
        self.finish_saves()
        return self._blocks[host_id]

    def read_block(self, host_id: int) -> np.ndarray:
        """Host block ``host_id``'s contents ``[slots, 2, block_size, Hkv, D]`` (waits for its save)."""
        self.finish_saves()
        return np.asarray(jax.device_get(self._blocks[host_id]))

    def flush(self) -> None:
        """Wait until every save has landed in host memory and every load is in the pool."""
        self.finish_saves()
        self._saves.wait_all()
        self._loads.wait_all()

    def close(self) -> None:
        self.flush()

    def _padded_ids(self, ids: list[int]) -> jax.Array:
        padded = np.full((padded_size(len(ids)),), NULL_BLOCK_ID, np.int32)
        padded[:len(ids)] = ids
        return jax.device_put(padded, self._device)
