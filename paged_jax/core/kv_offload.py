"""The host-memory tier of the prefix cache (vLLM's ``--kv-offloading-size``, backend ``native``): bookkeeping only.

When the device prefix cache evicts a full, hashed block (``KVCacheManager`` hands the block to a new owner), the
tier keeps its KV in a host block: a ``(device_block, host_block)`` copy joins the step's ``swap_out`` list, which the
runner gathers before the step's forward overwrites the block and lands in host memory after the step, without
waiting for it (``paged_jax.worker.host_kv_pool``). A later prefix-cache lookup that misses on the device continues
here: a hit is loaded into a fresh device block by a ``(host_block, device_block)`` copy in the step's ``swap_in``
list (before the forward that reads it) instead of being recomputed, and the block is registered in the device
cache again.

Evictions come in bursts (an admission takes many blocks at once, each load's destination one more): saving every
evicted block in the step that evicts it would hold as many gathered blocks in device memory at once, and the link,
in the steps that admit, which then wait for the copies in flight past the host pool's cap. So the tier also saves
ahead, write-through: the blocks the device cache registers (``computed``) are stored a few per pass
(``save_ahead``: up to ``SAVE_AHEAD_BLOCKS``) in the steps after the one that computed them; their eviction then
copies nothing.

Host blocks are ids ``first_host_id .. first_host_id + num_blocks - 1`` of the runner's host pool (after the swap
pool's), indexed by the blocks' chained hashes and evicted least recently used first (a store or a load uses a
block). A block stored in the current scheduling pass is not loadable before the next pass: the runner reads a
step's loads before that step's stores land.

Entries of ``KVCacheManager.get_computed_blocks`` that are host hits are ``host_entry(host_block)`` (negative, so
never a device block id); ``load_hits`` replaces them by device blocks.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

from paged_jax.worker.buckets import MAX_SWAP_CHUNK

SAVE_AHEAD_BLOCKS = 2 * MAX_SWAP_CHUNK  # blocks saved ahead of their eviction per scheduling pass, at most
SAVE_AHEAD_QUEUE = 8 * SAVE_AHEAD_BLOCKS  # computed blocks waiting to be saved ahead, at most (the oldest dropped)


def host_entry(host_block: int) -> int:
    """A host hit in a list of computed blocks: ``-1 - host_block`` (< 0, never a device block id)."""
    return -1 - host_block


class HostKVTier:
    """LRU host-memory tier of the prefix cache, over block hashes.

    Args:
      num_blocks: host blocks of the tier (>= 1).
      first_host_id: the first one's id in the runner's host pool (the swap pool's blocks come before).
      group_windows: the KV-cache manager's groups' windows; only ``(None,)`` (one group of full-attention layers) is
        supported.
      prefix_caching: whether the manager caches prefixes (the tier holds what its prefix cache evicts).
    """

    def __init__(self, num_blocks: int, first_host_id: int, *, group_windows: Sequence[int | None] = (None,),
                 prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"kv_offloading_size leaves {num_blocks!r} host blocks; it must hold at least one "
                             "KV block")
        if tuple(group_windows) != (None,):
            raise ValueError("kv_offloading_size is not supported with KV-cache groups (a model with sliding-window "
                             "or chunked layers, e.g. Gemma 2/3, Mistral or Qwen2 with sliding_window, Llama 4): "
                             "unset it")
        if not prefix_caching:
            raise ValueError("kv_offloading_size needs prefix caching (the host tier holds the blocks the prefix "
                             "cache evicts): enable_prefix_caching is off (or a pooler reads every prompt token)")
        self.num_blocks = num_blocks
        self.first_host_id = first_host_id
        self._block_by_hash: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # LRU first
        self._free: collections.deque[int] = collections.deque(range(first_host_id, first_host_id + num_blocks))
        self._stores: list[tuple[int, int]] = []  # this pass's (device block, host block) copies
        self._loads: list[tuple[int, int]] = []  # this pass's (host block, device block) copies
        self._stored_in_pass: set[bytes] = set()
        # Blocks the device cache registered, (hash, device block), to save ahead; within a quarter of the tier, as
        # what it saves ahead takes the place of blocks it holds.
        self._computed: collections.deque[tuple[bytes, int]] = collections.deque(
            maxlen=min(SAVE_AHEAD_QUEUE, num_blocks // 4))
        # vLLM's external prefix cache counters (tokens, once per admission) and the blocks copied each way.
        self.queries = 0
        self.hits = 0
        self.num_stored_blocks = 0
        self.num_loaded_blocks = 0

    @property
    def num_cached_blocks(self) -> int:
        """Host blocks holding a block's KV now."""
        return len(self._block_by_hash)

    def store(self, block_hash: bytes, device_block: int) -> None:
        """The device prefix cache evicts ``device_block`` (hash ``block_hash``) before its new owner writes it:
        keep its KV in a host block (the least recently used one when none is free), unless the tier has it."""
        if block_hash in self._block_by_hash:
            self._block_by_hash.move_to_end(block_hash)
            return
        host_block = self._free.popleft() if self._free else self._block_by_hash.popitem(last=False)[1]
        self._block_by_hash[block_hash] = host_block
        self._stores.append((device_block, host_block))
        self._stored_in_pass.add(block_hash)
        self.num_stored_blocks += 1

    def computed(self, block_hash: bytes, device_block: int) -> None:
        """The device prefix cache registered ``device_block`` (its KV computed) under ``block_hash``: queue it for
        ``save_ahead``."""
        self._computed.append((block_hash, device_block))

    def save_ahead(self, block_hash_of: Callable[[int], bytes | None]) -> int:
        """Store up to ``SAVE_AHEAD_BLOCKS`` of the blocks queued by ``computed``, oldest first, that still hold their
        KV (``block_hash_of(device_block)`` is still their hash) and that the tier does not hold yet, so that their
        eviction copies nothing; returns how many."""
        num_saved = 0
        while self._computed and num_saved < SAVE_AHEAD_BLOCKS:
            block_hash, device_block = self._computed.popleft()
            if block_hash_of(device_block) == block_hash and block_hash not in self._block_by_hash:
                self.store(block_hash, device_block)
                num_saved += 1
        return num_saved

    def entry(self, block_hash: bytes) -> int | None:
        """``host_entry`` of the host block holding ``block_hash``'s KV, or None (not held, or stored in this pass:
        its data lands after this step's loads are read)."""
        host_block = self._block_by_hash.get(block_hash)
        if host_block is None or block_hash in self._stored_in_pass:
            return None
        return host_entry(host_block)

    def load_hits(self, entries: list[int], block_hashes: Sequence[bytes],
                  pop_registered: Callable[[bytes], int]) -> int:
        """Replace the host entries of ``entries`` (a request's computed blocks, aligned with ``block_hashes``) in
        place by fresh device blocks from ``pop_registered(block_hash)`` (registered in the device cache under that
        hash), and queue their host -> device copies; returns how many. The hits become the most recently used
        first, so that the blocks popped here (whose evictions may store into the tier) cannot take them."""
        hits = [index for index, entry in enumerate(entries) if entry < 0]
        for index in hits:
            self._block_by_hash.move_to_end(block_hashes[index])
        for index in hits:
            device_block = pop_registered(block_hashes[index])
            self._loads.append((-1 - entries[index], device_block))
            entries[index] = device_block
        self.num_loaded_blocks += len(hits)
        return len(hits)

    def count_admission(self, num_tokens: int, num_hit_tokens: int) -> None:
        """vLLM's external prefix cache counters: an admitted request's tokens, and those loaded from this tier."""
        self.queries += num_tokens
        self.hits += num_hit_tokens

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This pass's ``(stores, loads)``: ``[(device_block, host_block)]`` for the step's ``swap_out`` and
        ``[(host_block, device_block)]`` for its ``swap_in``. Call once per scheduling pass."""
        stores, loads = self._stores, self._loads
        self._stores, self._loads = [], []
        self._stored_in_pass.clear()
        return stores, loads

    def clear(self) -> None:
        """Forget every block (the weights changed: no cached KV is valid). Copies already queued still run."""
        self._free.extend(self._block_by_hash.values())
        self._block_by_hash.clear()
        self._stored_in_pass.clear()
        self._computed.clear()

    def stats(self) -> dict[str, float]:
        return {"external_prefix_cache_queries": self.queries, "external_prefix_cache_hits": self.hits,
                "num_offload_blocks": self.num_blocks, "kv_offload_usage": self.num_cached_blocks / self.num_blocks,
                "num_offloaded_blocks": self.num_stored_blocks, "num_onloaded_blocks": self.num_loaded_blocks}
