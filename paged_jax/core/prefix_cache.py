"""The KV-cache manager's prefix cache (``KVCacheManager`` inherits it; the scheme is in its module docstring):
the chained hashes of a request's full blocks, registering computed full blocks, the longest cached prefix of a
request's tokens, and a steady decode's registration of the blocks its rows just filled (``cache_filled_blocks``).

The state it reads is the manager's: ``blocks`` (``KVBlock``), ``block_size``, ``num_groups``, ``group_windows``,
``_sliding_groups``, ``enable_prefix_caching``, ``_cached_block_by_hash`` (hash -> block id),
``cached_block_counts`` (request id -> leading entries registered) and ``offload`` (the host tier, or None)."""

from __future__ import annotations

import array
import hashlib
from collections.abc import Sequence

import numpy as np

from paged_jax.core.block_hash import hash_block_tokens, root_hash
from paged_jax.core.kv_groups import NULL_BLOCK_ID, group_block_key, groups_prefix_hit, num_skipped_blocks
from paged_jax.core.request import Request


class PrefixCaching:
    """The prefix-cache half of ``KVCacheManager`` (see the module docstring)."""

    def is_cached(self, block_hash: bytes) -> bool:
        """Read-only prefix-cache query (a data-parallel router's): whether a block with this chained hash
        (``hash_block_tokens``) is in the cache now. Changes nothing: no reference, no LRU touch."""
        return self.enable_prefix_caching and block_hash in self._cached_block_by_hash


    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to every full block of its known tokens."""
        bs = self.block_size
        num_full = request.num_tokens // bs
        hashes = request.block_hashes
        if len(hashes) >= num_full:
            return
        parent = hashes[-1] if hashes else root_hash(request.cache_salt,
                                                     None if request.lora is None else request.lora.cache_key)
        for i in range(len(hashes), num_full):
            parent = hash_block_tokens(parent, request.token_ids_slice(i * bs, (i + 1) * bs))
            hashes.append(parent)

    def invalidate_block_hashes(self, request: Request, token_index: int) -> None:
        """The token at ``token_index`` of ``request.all_token_ids`` has changed (async scheduling replaces a
        placeholder by the sampled token): drop the hashes of its block and of every later one, computed from the
        old token; they are recomputed on demand. Only for tokens whose K/V is not computed yet, so that no block
        holding them has been registered in the cache."""
        del request.block_hashes[token_index // self.block_size:]


    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks of ``request.all_token_ids``.

        Returns ``(block_ids, num_computed_tokens)`` with ``num_computed_tokens = len(block_ids) * block_size``. At
        least one known token is always left to compute (the hit is capped at ``num_tokens - 1`` rounded down to a
        block boundary) so that the step produces logits. Does not take references: pass the result to
        ``allocate_slots`` in the same scheduling pass. Only meaningful for a request holding no blocks. A request
        with ``skip_prefix_cache`` gets no hit. A block missing on the device may be a host-tier hit (an entry < 0).
        """
        if not self.enable_prefix_caching or request.block_ids or request.skip_prefix_cache:
            return [], 0
        self._update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        lookup = self._cached_block_by_hash.get
        if self.num_groups > 1 or self._sliding_groups:
            return self._groups_hit(request.block_hashes[:max_hit_blocks])
        hit_ids: list[int] = []
        host_entry = self.offload.entry if self.offload is not None else lambda block_hash: None
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block_id = lookup(block_hash)
            if block_id is None:
                block_id = host_entry(block_hash)
                if block_id is None:
                    break
            hit_ids.append(block_id)
        return hit_ids, len(hit_ids) * self.block_size

    def _groups_hit(self, block_hashes: list[bytes]) -> tuple[list[int], int]:
        """``get_computed_blocks`` with groups: the longest hit valid for every group, as interleaved entries (a
        sliding group's entries before the window of the first uncomputed token point at the null block)."""
        lookup = self._cached_block_by_hash.get
        hits = [[lookup(group_block_key(h, g)) for h in block_hashes] for g in range(self.num_groups)]
        num_hit = groups_prefix_hit(hits, self.group_windows, self.block_size)
        entries = [NULL_BLOCK_ID] * (num_hit * self.num_groups)
        for g, window in enumerate(self.group_windows):
            skipped = 0 if window is None else num_skipped_blocks(num_hit * self.block_size, window, self.block_size)
            entries[skipped * self.num_groups + g::self.num_groups] = hits[g][skipped:num_hit]
        return entries, num_hit * self.block_size


    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose K/V is computed (``num_computed_tokens // block_size`` of them).

        Call after the step that computed them. If another block already holds the same hash (the same prefix was
        computed twice concurrently), this one stays un-hashed and is recycled as a plain block when freed.
        """
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self.cached_block_counts.get(request.request_id, 0)
        if num_full <= start:  # every step of every running request, mostly: nothing new is full
            return
        groups = self.num_groups
        num_full = min(num_full, len(request.block_ids) // groups)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for entry in range(start * groups, num_full * groups):
            if request.block_ids[entry] == NULL_BLOCK_ID:  # slid out of the window (after a swap-in)
                continue
            block = self.blocks[request.block_ids[entry]]
            if block.block_hash is not None:  # came from a cache hit, or shared with the request that cached it
                continue
            block_hash = group_block_key(request.block_hashes[entry // groups], entry % groups)
            if block_hash not in self._cached_block_by_hash:
                block.block_hash = block_hash
                self._cached_block_by_hash[block_hash] = block.block_id
                if self.offload is not None:
                    self.offload.computed(block_hash, block.block_id)
        self.cached_block_counts[request.request_id] = num_full

    def cache_filled_blocks(self, requests: Sequence[Request], block_tokens: np.ndarray | None = None) -> None:
        """``cache_full_blocks`` of running requests (one KV-cache group) each of whose last step filled its newest
        full block, every earlier one registered: that block's hash (from the previous one's) and its registration
        only; a request in any other state takes the general path. ``block_tokens`` int64[len(requests),
        block_size]: the filled blocks' tokens, when the caller has them (else read from the outputs)."""
        if not self.enable_prefix_caching:
            return
        block_size, counts, blocks = self.block_size, self.cached_block_counts, self.blocks
        by_hash, offload, sha256 = self._cached_block_by_hash, self.offload, hashlib.sha256
        data, width = (None, 0) if block_tokens is None else (block_tokens.tobytes(), 8 * block_size)
        for k, request in enumerate(requests):
            num_full = request.num_computed_tokens // block_size
            hashes, request_id = request.block_hashes, request.request_id
            start = num_full * block_size - len(request.prompt_token_ids) - block_size  # the block's first output
            if not hashes or len(hashes) != num_full - 1 or counts.get(request_id) != num_full - 1 or start < 0 \
                    or len(request.block_ids) < num_full:
                self.cache_full_blocks(request)
                continue
            # ``hash_block_tokens``, inlined: one call over the same bytes (int64, native order)
            block_hash = sha256(hashes[-1] + (data[k * width:(k + 1) * width] if data is not None else array.array(
                "q", request.output_token_ids[start:start + block_size]).tobytes())).digest()
            hashes.append(block_hash)
            block = blocks[request.block_ids[num_full - 1]]
            if block.block_hash is None and block_hash not in by_hash:
                block.block_hash = block_hash
                by_hash[block_hash] = block.block_id
                if offload is not None:
                    offload.computed(block_hash, block.block_id)
            counts[request_id] = num_full

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after weights change), the host tier's too. Blocks in use stay allocated,
        just un-hashed."""
        for block_id in self._cached_block_by_hash.values():
            self.blocks[block_id].block_hash = None
        self._cached_block_by_hash.clear()
        if self.offload is not None:
            self.offload.clear()
        # Free blocks are all worthless now; their relative order no longer matters.
