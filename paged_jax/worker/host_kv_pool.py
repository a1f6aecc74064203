"""The host side of the KV pool: swap preemption's host pool and the prefix cache's host tier
(``paged_jax.core.kv_offload``), one preallocated host array, and the copies between it and the device pool.

A step's ``swap_out = [(device_block, host_block)]`` and ``swap_in = [(host_block, device_block)]`` are applied
before its forward (``HostKVPool.swap``): the device -> host copies are gathered on the device first (dispatched
before anything of the step writes the pool), then the host -> device copies read the host array and are scattered
into the donated pool, then the gathered blocks go to host memory without the step waiting for them: each chunk's
device -> host transfer starts at once and a copy thread lands it in the host array. A later swap-in of a block not
landed yet waits for it (copies land in order), so a step reads what earlier steps stored and never what it stores
itself. At most ``MAX_IN_FLIGHT_BLOCKS`` gathered blocks wait on the device; the KV pool's sizing leaves room for
them (``paged_jax.worker.kv_pool_sizing``).

Copies go in chunks of at most ``MAX_SWAP_CHUNK`` blocks padded to a power of two with the null block: the sizes
``buckets.swap_sizes_for`` lists, compiled at warm-up (one gather and one scatter each), so no copy compiles.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from paged_jax.worker.buckets import MAX_SWAP_CHUNK

NULL_BLOCK_ID = 0
MAX_IN_FLIGHT_BLOCKS = 2 * MAX_SWAP_CHUNK  # gathered blocks on their way to host memory, at most


def gather_blocks(kv_pool, block_ids):
    """The pool's blocks ``block_ids`` i32[n] -> ``[n, slots, 2 (k|v), block_size, Hkv, D]`` (block-major, as the
    host array)."""
    return jnp.stack([jnp.stack([k[block_ids], v[block_ids]], axis=1) for k, v in kv_pool], axis=1)


def scatter_blocks(kv_pool, block_ids, data):
    """Write ``data`` ``[n, slots, 2, block_size, Hkv, D]`` into the pool's blocks ``block_ids`` i32[n]."""
    return [(k.at[block_ids].set(data[:, i, 0]), v.at[block_ids].set(data[:, i, 1]))
            for i, (k, v) in enumerate(kv_pool)]


def chunks(items: list, size: int = MAX_SWAP_CHUNK) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def padded_size(num_blocks: int) -> int:
    """The compiled copy size of a chunk of ``num_blocks`` blocks: the next power of two."""
    return 1 << max(num_blocks - 1, 0).bit_length()


class HostKVPool:
    """The host array ``[num_blocks, slots, 2, block_size, Hkv, D]`` (``np.zeros``: the OS backs it as it is written)
    and the step's copies.

    Args:
      num_blocks: host blocks (the swap pool's, then the host tier's).
      block_shape: ``(slots, 2, block_size, Hkv, D)`` of one block (slots: the device pool's layers or slots).
      dtype: the KV pool's element type.
      gather / scatter: the runner's compiled ``gather_blocks`` / ``scatter_blocks`` (``AheadOfTimeFunction`` s, or
        jitted functions).
      device: where block ids and swapped-in data go (a device or sharding).
    """

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...], dtype, *, gather: Callable,
                 scatter: Callable, device) -> None:
        self.array = np.zeros((num_blocks,) + tuple(block_shape), dtype=dtype)
        self._bytes = self.array.view(np.uint8)  # copies of raw bytes (numpy releases the GIL for those)
        self._gather, self._scatter, self._device = gather, scatter, device
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="paged-jax-kv-host")
        # Stores not known to have landed, oldest first: (future, host blocks, number of blocks).
        self._pending: collections.deque[tuple[concurrent.futures.Future, frozenset[int], int]] = collections.deque()
        self._in_flight = 0

    @property
    def num_blocks(self) -> int:
        return self.array.shape[0]

    def swap(self, kv_pool: list, swap_out: Sequence[tuple[int, int]],
             swap_in: Sequence[tuple[int, int]]) -> list:
        """Apply one step's copies (see the module docstring); returns the pool (the scatters donate it)."""
        gathered = [(chunk, self._gather(kv_pool, self._padded_ids([d for d, _ in chunk])))
                    for chunk in chunks(list(swap_out))]
        for chunk in chunks(list(swap_in)):
            host_ids = [h for h, _ in chunk]
            self._wait_for(host_ids)
            data = np.empty((padded_size(len(chunk)),) + self.array.shape[1:], self.array.dtype)
            np.take(self.array, host_ids, axis=0, out=data[:len(chunk)])
            data[len(chunk):] = 0  # padding entries write zeros into the null block, which no valid token reads
            device_ids = self._padded_ids([d for _, d in chunk])
            kv_pool = self._scatter(kv_pool, device_ids, jax.device_put(data, self._data_sharding(kv_pool, device_ids,
                                                                                                data)))
        for chunk, device_data in gathered:
            self._store([h for _, h in chunk], device_data)
        return kv_pool

    def _data_sharding(self, kv_pool: list, device_ids: jax.Array, data: np.ndarray) -> jax.sharding.Sharding:
        """Where swapped-in ``data`` goes: as the scatter executable warm-up made takes it (on a mesh, split as the
        gather's output: the pool's kv heads over tp), else ``device``."""
        executables = getattr(self._scatter, "executables", None)  # a plain jitted function has none
        executable = None if executables is None else executables.get(self._scatter.key((kv_pool, device_ids, data),
                                                                                         {}))
        return self._device if executable is None else executable.input_shardings[0][2]

    def _store(self, host_ids: list[int], device_data: jax.Array) -> None:
        """Start ``device_data``'s transfer to host memory and have the copy thread land it in ``host_ids``."""
        device_data.copy_to_host_async()
        future = self._copier.submit(self._land, host_ids, device_data)
        self._pending.append((future, frozenset(host_ids), len(host_ids)))
        self._in_flight += len(host_ids)
        while self._pending and (self._pending[0][0].done() or self._in_flight > MAX_IN_FLIGHT_BLOCKS):
            self._retire_oldest()

    def _land(self, host_ids: list[int], device_data: jax.Array) -> None:
        host = np.asarray(device_data)  # waits for the transfer started by _store
        self._bytes[host_ids] = host.view(np.uint8)[:len(host_ids)]

    def _retire_oldest(self) -> None:
        future, _, num_blocks = self._pending.popleft()
        future.result()  # waits when not landed yet; raises what the copy raised
        self._in_flight -= num_blocks

    def _wait_for(self, host_ids: list[int]) -> None:
        """Wait until every pending store into ``host_ids`` has landed (with every store before it)."""
        wanted = set(host_ids)
        last = max((i for i, (_, blocks, _) in enumerate(self._pending) if not blocks.isdisjoint(wanted)), default=-1)
        for _ in range(last + 1):
            self._retire_oldest()

    def flush(self) -> None:
        """Wait until every store has landed in the host array."""
        while self._pending:
            self._retire_oldest()

    def close(self) -> None:
        self.flush()
        self._copier.shutdown()

    def _padded_ids(self, ids: list[int]) -> jax.Array:
        padded = np.full((padded_size(len(ids)),), NULL_BLOCK_ID, np.int32)
        padded[:len(ids)] = ids
        return jax.device_put(padded, self._device)
