"""Paged KV-cache bookkeeping: a device block pool with reference counts, automatic prefix caching, and a host
(swap) pool. Pure host-side Python; the model runner owns the actual K/V arrays
(``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer) and moves data when told to.

Block 0 is the reserved null block: it is never handed out (padding tokens write there, padded block-table entries
point there), so usable device blocks are ``1 .. num_blocks-1``.

Prefix caching
--------------
A *full* block (``block_size`` tokens) at index ``i`` of a sequence is identified by
``hash_i = sha256(hash_{i-1} || tokens of block i)`` (``hash_{-1}`` = ``root_hash(request.cache_salt)``), so equal hashes mean equal token *prefixes*, not just equal
block contents, and the block's K/V (which depends on the whole prefix through attention and on the positions) is
interchangeable. A block is registered in the cache only after its K/V has been computed (``cache_full_blocks``, called
after the step that wrote it). When its last owner frees it, the block keeps its hash and goes to the free queue; it can
be revived by a later hit until it is handed out as a new block, at which point its hash entry is dropped (eviction).

Free queue order (evicted from the head): un-hashed blocks are put at the head (their content is worthless), hashed
blocks at the tail, with each request's blocks appended last-block-first, so the least-recently-used prefixes and,
within one sequence, the deepest blocks are evicted first (a shorter shared prefix survives longer).

No-leak invariant
-----------------
A block handed to a new owner may still hold another request's K/V. This is harmless because attention for a sequence
only reads positions ``< kv_len`` (its ``num_computed_tokens`` plus the tokens of the current step), and each of those
positions was either written by this sequence itself (in this step, before attention reads it, or in an earlier step)
or lies in a block obtained through a prefix-cache hit, whose hash chain proves that it was computed for exactly the
same token prefix. Positions ``>= kv_len`` of the last block may hold stale data and are masked by kv_len.
``tests/test_kv_cache_manager.py`` checks this with a simulated pool.

Forking and copy-on-write
-------------------------
``fork(parent, child)`` gives a child (another sequence of an n > 1 / best_of request, a beam) the parent's block
table, taking one more reference on each block, so the computed tokens are shared, not recomputed. Full blocks are
never written again; only the block holding position ``num_computed_tokens`` (a partial last block) is. When
``allocate_slots`` is about to write into a block that others also hold (``ref_cnt > 1``), the writer gets a fresh
block instead and a ``(src, dst)`` copy is recorded; the scheduler hands the step's copies to the model runner
(``take_block_copies``), which applies them inside the jitted step before any K/V write of that step. A source freed
in the same scheduling pass stays out of the free queue until then (a swap-in of this pass could otherwise land in
it before the copy reads it); a copy whose destination is freed in the same pass (its request preempted) is
dropped, and a swap-out of such a request reads the source instead of the not-yet-filled destination.

KV-cache groups
---------------
``group_windows`` gives each group of layers (``paged_jax.core.kv_groups``) its span: a sliding window, an attention
chunk (Llama 4's chunked layers: a sliding group whose span starts at the chunk of the first uncomputed token), or
None (full attention). A
request's block table holds ``G = len(group_windows)`` entries per block of its sequence, interleaved (entry
``i * G + g`` is group ``g``'s block ``i``), all from the one pool, so the scheduler's diffs stay appends. In a
sliding group the entries of blocks no later query reads (``num_skipped_blocks``) point at the null block and their
blocks are released before each allocation, hashed ones staying revivable by the prefix cache: a request holds at
most ``max_blocks_per_request`` blocks there. Each group's blocks are cached under their own key
(``group_block_key``); a prefix-cache hit is the longest valid for every group (``groups_prefix_hit``: a sliding
group needs only the blocks in the window of the first uncomputed token); a swap-out copies only the blocks held. The
entries of one block are shared by forks together and copied together on write.

Host tier (``num_offload_blocks``; ``paged_jax.core.kv_offload``): an evicted hashed block's KV is stored in host memory,
a lookup that misses on the device goes on there, and ``allocate_slots`` loads those hits into fresh device blocks.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence

from models.config import AttentionChunk
from paged_jax.core.kv_groups import NULL_BLOCK_ID, max_blocks_per_request, num_skipped_blocks
from paged_jax.core.kv_offload import HostKVTier
from paged_jax.core.prefix_cache import PrefixCaching
from paged_jax.core.request import Request

NULL_HOST_BLOCK_ID = -1  # a swapped request's host table entry for a block that slid out of the window


class KVBlock:
    """One device block: its id, how many requests hold it, and its prefix-cache hash (None if not cached)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash is not None else None
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class KVCacheManager(PrefixCaching):
    """Device block pool + prefix cache + host swap pool, all as bookkeeping.

    Args:
      num_blocks: device blocks including the null block 0 (so ``num_blocks - 1`` are usable); >= 2.
      block_size: tokens per block; >= 1.
      enable_prefix_caching: register computed full blocks and reuse them across requests.
      num_host_blocks: size of the host swap pool (host block ids ``0 .. num_host_blocks-1``; no null block there).
      group_windows: each KV-cache group's span (``kv_groups.KVSpan``: a window, an ``AttentionChunk``, None: full
        attention), ``kv_groups.engine_kv_groups``' order;
        ``(None,)``: one table of every token's blocks (see the module docstring).
      num_offload_blocks: host blocks of the prefix cache's host tier (0: none), ids after the swap pool's.

    All methods are O(blocks touched); the free queue is an OrderedDict (O(1) pop-front / remove / push).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_host_blocks: int = 0, group_windows: Sequence[int | None] = (None,),
                 num_offload_blocks: int = 0) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is reserved), got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if not isinstance(num_host_blocks, int) or num_host_blocks < 0:
            raise ValueError(f"num_host_blocks must be an int >= 0, got {num_host_blocks!r}")
        if not group_windows or any(w is not None and not isinstance(w, AttentionChunk)
                                    and (not isinstance(w, int) or w < 1) for w in group_windows):
            raise ValueError(f"group_windows must list None, an int >= 1 or an AttentionChunk per group, got "
                             f"{group_windows!r}")
        self.group_windows = tuple(group_windows)
        self.num_groups = len(group_windows)
        self._sliding_groups = tuple((g, w) for g, w in enumerate(group_windows) if w is not None)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.num_host_blocks = num_host_blocks
        self.offload = (HostKVTier(num_offload_blocks, num_host_blocks, group_windows=self.group_windows,
                                   prefix_caching=self.enable_prefix_caching) if num_offload_blocks else None)

        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Keys are block ids with ref_cnt == 0, head = next to hand out. Values unused.
        self._free_queue: collections.OrderedDict[int, None] = collections.OrderedDict(
            (i, None) for i in range(1, num_blocks))
        self._cached_block_by_hash: dict[bytes, int] = {}
        # request_id -> number of leading entries of request.block_ids already registered in (or skipped by) the cache
        self.cached_block_counts: dict[str, int] = {}
        self._free_host_blocks: collections.deque[int] = collections.deque(range(num_host_blocks))
        # Copy-on-write copies of the current scheduling pass (dst block -> src block), how many of them read each
        # source, and sources freed meanwhile, kept out of the free queue until take_block_copies.
        self._pending_copies: dict[int, int] = {}
        self._copy_source_refs: collections.Counter[int] = collections.Counter()
        self._deferred_free: list[int] = []

        # Metrics (vLLM semantics: tokens, counted once per successful admission).
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evicted_blocks = 0

    # ------------------------------------------------------------------ pool state
    @property
    def num_free_blocks(self) -> int:
        """Device blocks that can be handed out now (ref_cnt 0, cached or not)."""
        return len(self._free_queue)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable device blocks held by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently registered in the prefix cache (in use or free)."""
        return len(self._cached_block_by_hash)

    @property
    def num_free_host_blocks(self) -> int:
        return len(self._free_host_blocks)

    def blocks_needed(self, num_tokens: int) -> int:
        """Block-table entries that cover ``num_tokens`` tokens: ceil(num_tokens / block_size) per group."""
        return -(-num_tokens // self.block_size) * self.num_groups

    def max_blocks_per_request(self, num_tokens: int, max_chunk_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens, computed ``max_chunk_tokens`` at a time, holds at
        once, all groups together (``kv_groups.max_blocks_per_request``)."""
        return sum(max_blocks_per_request(num_tokens, window, self.block_size, max_chunk_tokens)
                   for window in self.group_windows)

    # ------------------------------------------------------------------ low-level pool ops
    def _pop_free_block(self) -> int:
        block_id, _ = self._free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict: the content is about to be overwritten by the new owner
            if self._cached_block_by_hash.get(block.block_hash) == block_id:
                del self._cached_block_by_hash[block.block_hash]
                if self.offload is not None:  # its KV goes to host memory before the new owner writes
                    self.offload.store(block.block_hash, block_id)
            block.block_hash = None
            self.num_evicted_blocks += 1
        block.ref_cnt = 1
        return block_id

    def _touch(self, block_ids: Iterable[int]) -> None:
        for block_id in block_ids:
            if block_id <= NULL_BLOCK_ID:  # a table entry that slid out of the window, or a host-tier hit
                continue
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                if block_id in self._free_queue:
                    del self._free_queue[block_id]
                else:  # a copy source freed in this pass, revived by a prefix-cache hit
                    self._deferred_free.remove(block_id)
            block.ref_cnt += 1

    def _release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block; pass blocks in eviction-preference order (first = evict first)."""
        for block_id in block_ids:
            if block_id == NULL_BLOCK_ID:  # a table entry that slid out of the window
                continue
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                src = self._pending_copies.pop(block_id, None)  # a copy into a block nobody holds any more: moot
                if src is not None:
                    self._drop_copy_source(src)
                if self._copy_source_refs.get(block_id):
                    self._deferred_free.append(block_id)  # read by a copy of this step: free after the pass
                else:
                    self._enqueue_free(block_id)

    def _enqueue_free(self, block_id: int) -> None:
        self._free_queue[block_id] = None  # tail: evicted last
        if self.blocks[block_id].block_hash is None:
            self._free_queue.move_to_end(block_id, last=False)  # worthless content: reuse first

    def _drop_copy_source(self, src: int) -> None:
        self._copy_source_refs[src] -= 1
        if self._copy_source_refs[src] == 0:
            del self._copy_source_refs[src]
            if src in self._deferred_free:
                self._deferred_free.remove(src)
                self._enqueue_free(src)

    def stats(self) -> dict[str, float]:
        """The pool's share of the engine's stats (``Scheduler.stats``)."""
        return {"kv_cache_usage": self.usage, "prefix_cache_queries": self.prefix_cache_queries,
                "prefix_cache_hits": self.prefix_cache_hits, "num_gpu_blocks": self.num_blocks,
                "num_cpu_blocks": self.num_host_blocks, **(self.offload.stats() if self.offload else {})}

    def _out_of_window_entries(self, request: Request):
        """Per sliding group, its entries (indices into ``request.block_ids``) of blocks that slid out of the window
        and are still held, deepest first."""
        block_ids, groups = request.block_ids, self.num_groups
        for g, window in self._sliding_groups:
            skipped = min(len(block_ids) // groups,
                          num_skipped_blocks(request.num_computed_tokens, window, self.block_size))
            for index in range((skipped - 1) * groups + g, -1, -groups):
                if block_ids[index] == NULL_BLOCK_ID:  # released before, as is everything before it
                    break
                yield index

    def _release_out_of_window(self, request: Request) -> None:
        """Point the request's entries of blocks that slid out of a window at the null block and release those
        blocks."""
        block_ids = request.block_ids
        released = []
        for index in list(self._out_of_window_entries(request)):
            released.append(block_ids[index])
            block_ids[index] = NULL_BLOCK_ID
        self._release(released)

    def _num_releasable(self, request: Request) -> int:
        """Blocks ``_release_out_of_window`` would return to the free queue now."""
        return sum(1 for index in self._out_of_window_entries(request)
                   if self.blocks[request.block_ids[index]].ref_cnt == 1)

    # ------------------------------------------------------------------ allocation
    def can_allocate(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()) -> bool:
        """Whether ``allocate_slots(request, num_new_tokens, computed_blocks)`` would succeed."""
        return self._num_blocks_short(request, num_new_tokens, computed_blocks) <= 0

    def _num_blocks_short(self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int]) -> int:
        num_computed = (len(computed_blocks) // self.num_groups * self.block_size if computed_blocks
                        else request.num_computed_tokens)
        held = len(computed_blocks) if computed_blocks else len(request.block_ids)
        num_new_blocks = max(0, self.blocks_needed(num_computed + num_new_tokens) - held)
        num_new_blocks += sum(1 for b in computed_blocks if b < 0)  # host-tier hits load into new blocks
        if not computed_blocks:
            num_new_blocks += len(self._shared_write_entries(request))  # copy-on-write of the blocks written into
        # Touching a hit block with ref_cnt 0 takes it out of the free queue.
        revived = sum(1 for b in computed_blocks if b > NULL_BLOCK_ID and self.blocks[b].ref_cnt == 0)
        released = self._num_releasable(request) if self._sliding_groups and not computed_blocks else 0
        return num_new_blocks - (self.num_free_blocks + released - revived)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: Sequence[int] | None = None) -> bool:
        """Make ``request.block_ids`` cover ``num_computed_tokens + num_new_tokens`` tokens.

        With ``computed_blocks`` (a prefix-cache hit from ``get_computed_blocks``; only for a request holding no
        blocks), the hit blocks become the head of its block table and ``request.num_computed_tokens`` is set to
        ``len(computed_blocks) * block_size``; ``num_new_tokens`` counts tokens after the hit. Returns False and changes
        nothing if the pool is short of blocks.
        """
        block_ids = request.block_ids
        if self._sliding_groups and block_ids:
            self._release_out_of_window(request)  # never read again, whether or not the allocation succeeds
        if block_ids and not computed_blocks and num_new_tokens > 0:
            # A running request writing into its own blocks (every running request, every step): the general path
            # below reduces to appending the blocks past those it holds (``_shared_write_entries`` inlined: a
            # block's entries are shared together, so group 0's tells).
            block_size, groups = self.block_size, self.num_groups
            num_computed = request.num_computed_tokens
            index = num_computed // block_size * groups
            if index >= len(block_ids) or self.blocks[block_ids[index]].ref_cnt <= 1:
                num_new_blocks = -(-(num_computed + num_new_tokens) // block_size) * groups - len(block_ids)
                if num_new_blocks <= 0:
                    return True
                if num_new_blocks > len(self._free_queue):
                    return False
                for _ in range(num_new_blocks):
                    block_ids.append(self._pop_free_block())
                return True
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        computed_blocks = list(computed_blocks or ())
        if computed_blocks and (request.block_ids or request.num_computed_tokens):
            raise ValueError("computed_blocks may only be passed for a request that holds no blocks")
        if self._num_blocks_short(request, num_new_tokens, computed_blocks) > 0:
            return False
        is_admission = not request.block_ids
        num_loaded = 0
        if computed_blocks:
            self._touch(computed_blocks)  # before popping new blocks, so the hits cannot be evicted below
            if self.offload is not None:
                num_loaded = self.offload.load_hits(computed_blocks, request.block_hashes, self._pop_registered)
            request.block_ids = computed_blocks
            request.num_computed_tokens = len(computed_blocks) // self.num_groups * self.block_size
            # Hit blocks are already hashed; cache_full_blocks starts after them.
            self.cached_block_counts[request.request_id] = len(computed_blocks) // self.num_groups
        if is_admission and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += (len(computed_blocks) // self.num_groups - num_loaded) * self.block_size
            if self.offload is not None:
                self.offload.count_admission(request.num_tokens, num_loaded * self.block_size)
        if not is_admission:
            self._copy_on_write(request)
        num_new_blocks = self.blocks_needed(request.num_computed_tokens + num_new_tokens) - len(request.block_ids)
        for _ in range(num_new_blocks):
            request.block_ids.append(self._pop_free_block())
        return True

    def append_new_blocks(self, requests: Sequence[Request]) -> list[int]:
        """One new block at the end of each of ``requests``' block tables, in order (``allocate_slots(request, 1)``
        of a request of one KV-cache group, no sliding window, whose next token starts a block: a steady decode's
        rows entering their next block); returns the blocks. RuntimeError, changing nothing, when fewer are free."""
        if len(requests) > len(self._free_queue):
            raise RuntimeError(f"{len(requests)} new blocks asked of a pool with {len(self._free_queue)} free")
        pop = self._pop_free_block
        new_blocks = [pop() for _ in requests]
        for request, block_id in zip(requests, new_blocks):
            request.block_ids.append(block_id)
        return new_blocks

    def _pop_registered(self, block_hash: bytes) -> int:
        """A fresh block, registered in the prefix cache under ``block_hash`` (a host-tier hit: its KV is loaded
        before the step that reads it)."""
        block_id = self._pop_free_block()
        self.blocks[block_id].block_hash = block_hash
        self._cached_block_by_hash[block_hash] = block_id
        return block_id

    @property
    def has_sliding_window(self) -> bool:
        """Whether some KV-cache group keeps a sliding window (``allocate_slots`` then releases blocks)."""
        return bool(self._sliding_groups)

    # ------------------------------------------------------------------ forking / copy-on-write
    @property
    def num_pending_copies(self) -> int:
        """Copy-on-write copies recorded in this scheduling pass."""
        return len(self._pending_copies)

    def needs_copy(self, request: Request) -> bool:
        """Whether the request's next write goes into a block others hold (allocating would record a copy)."""
        return bool(self._shared_write_entries(request)) and request.num_computed_tokens % self.block_size != 0

    def _shared_write_entries(self, request: Request) -> list[int]:
        """Indices in ``request.block_ids`` of the block its next token is written into (one entry per group), when
        other requests hold it too (a fork's shared partial last block); else empty."""
        start = request.num_computed_tokens // self.block_size * self.num_groups
        block_ids, blocks = request.block_ids, self.blocks
        return [index for index in range(start, min(start + self.num_groups, len(block_ids)))
                if blocks[block_ids[index]].ref_cnt > 1]

    def _copy_on_write(self, request: Request) -> None:
        """Give ``request`` its own copy of the shared block it is about to write into (see the module docstring)."""
        for index in self._shared_write_entries(request):
            src = request.block_ids[index]
            dst = self._pop_free_block()
            request.block_ids[index] = dst
            request.runner_num_blocks = min(request.runner_num_blocks, index)  # the runner's copy changes from here
            if request.num_computed_tokens % self.block_size:  # positions before the write hold the shared prefix
                self._pending_copies[dst] = src
                self._copy_source_refs[src] += 1
            self._release([src])

    def fork(self, parent: Request, child: Request) -> None:
        """Share ``parent``'s device blocks with ``child`` (one more reference each): the child's computed tokens
        are the parent's first ``num_computed_tokens`` (the caller guarantees its token ids agree there).

        The child must hold nothing; its prefix-cache bookkeeping follows the parent's. A later write into a shared
        partial block is copied first (``allocate_slots``).
        """
        if child.block_ids or child.host_block_ids or child.num_computed_tokens:
            raise ValueError(f"fork target {child.request_id!r} must hold no blocks")
        self._touch(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = parent.block_hashes[:parent.num_computed_tokens // self.block_size]
        num_cached = self.cached_block_counts.get(parent.request_id)
        if num_cached is not None:
            self.cached_block_counts[child.request_id] = num_cached

    def take_offload_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The host tier's copies of this pass (``HostKVTier.take_copies``), with its saves of computed blocks ahead
        of their eviction (``save_ahead``); empty without the tier. Call once per pass, after allocation."""
        if self.offload is None:
            return [], []
        self.offload.save_ahead(lambda block_id: self.blocks[block_id].block_hash)
        return self.offload.take_copies()

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The copy-on-write copies of this scheduling pass, ``[(src_block, dst_block), ...]``, for the model runner to
        apply before the step's K/V writes; sources freed during the pass go to the free queue now. Call once per
        pass, after allocation."""
        copies = [(src, dst) for dst, src in self._pending_copies.items()]
        self._pending_copies.clear()
        self._copy_source_refs.clear()
        deferred, self._deferred_free = self._deferred_free, []
        for block_id in deferred:
            self._enqueue_free(block_id)
        return copies

    def free(self, request: Request) -> None:
        """Release the request's device blocks (last block first into the queue) and its host blocks.

        Leaves ``request.num_computed_tokens`` alone: the scheduler resets it when it means to recompute.
        """
        self._release(request.block_ids[::-1])
        request.block_ids = []
        self._free_host_blocks.extend(h for h in request.host_block_ids if h != NULL_HOST_BLOCK_ID)
        request.host_block_ids = []
        self.cached_block_counts.pop(request.request_id, None)

    # ------------------------------------------------------------------ swap (host pool)
    def _num_held(self, block_ids: list[int], null_id: int) -> int:
        """Entries of a block table that are not ``null_id`` (blocks that slid out of a window)."""
        return len(block_ids) - block_ids.count(null_id) if self._sliding_groups else len(block_ids)

    def can_swap_out(self, request: Request) -> bool:
        num_keep = self.blocks_needed(request.num_computed_tokens)
        return self._num_held(request.block_ids[:num_keep], NULL_BLOCK_ID) <= self.num_free_host_blocks

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's computed blocks to the host pool (bookkeeping only).

        Returns ``[(device_block, host_block), ...]`` that the runner must copy device -> host *before* this step's
        forward pass (the device blocks are free again and may be handed to another request in the same step).
        Blocks past ``num_computed_tokens`` hold nothing and are simply released; entries that slid out of the window
        stay null (``NULL_HOST_BLOCK_ID`` in the host table). Raises RuntimeError if the host pool is too small (check
        ``can_swap_out``).
        """
        kept = request.block_ids[:self.blocks_needed(request.num_computed_tokens)]
        num_keep = self._num_held(kept, NULL_BLOCK_ID)
        if num_keep > self.num_free_host_blocks:
            raise RuntimeError(f"host pool has {self.num_free_host_blocks} free blocks, {num_keep} needed")
        if request.host_block_ids:
            raise RuntimeError(f"request {request.request_id} is already swapped out")
        host_ids = [NULL_HOST_BLOCK_ID if b == NULL_BLOCK_ID else self._free_host_blocks.popleft() for b in kept]
        # A block still waiting for its copy-on-write copy is read from the copy's source (same computed prefix).
        copies = [(self._pending_copies.get(b, b), h) for b, h in zip(kept, host_ids) if b != NULL_BLOCK_ID]
        self._release(request.block_ids[::-1])  # device content stays valid for prefix hits until evicted
        request.block_ids = []
        request.host_block_ids = host_ids
        self.cached_block_counts.pop(request.request_id, None)
        return copies

    def can_swap_in(self, request: Request, num_new_tokens: int = 0) -> bool:
        """Whether the swapped request's blocks plus room for ``num_new_tokens`` more tokens fit on device now."""
        host_ids = request.host_block_ids
        num_null = len(host_ids) - self._num_held(host_ids, NULL_HOST_BLOCK_ID)
        needed = max(len(host_ids), self.blocks_needed(request.num_computed_tokens + num_new_tokens)) - num_null
        return needed <= self.num_free_blocks

    def swap_in(self, request: Request) -> list[tuple[int, int]]:
        """Bring a swapped request's blocks back to fresh device blocks (bookkeeping only).

        Returns ``[(host_block, device_block), ...]`` for the runner to copy host -> device after this step's
        swap-out copies and before its forward pass. The new device blocks are re-registered in the prefix cache by
        the next ``cache_full_blocks``. Raises RuntimeError if the device pool is short (check ``can_swap_in``).
        """
        host_ids = request.host_block_ids
        num_needed = self._num_held(host_ids, NULL_HOST_BLOCK_ID)
        if num_needed > self.num_free_blocks:
            raise RuntimeError(f"device pool has {self.num_free_blocks} free blocks, {num_needed} needed")
        device_ids = [NULL_BLOCK_ID if h == NULL_HOST_BLOCK_ID else self._pop_free_block() for h in host_ids]
        request.block_ids = device_ids
        request.host_block_ids = []
        self._free_host_blocks.extend(h for h in host_ids if h != NULL_HOST_BLOCK_ID)
        self.cached_block_counts[request.request_id] = 0
        return [(h, d) for h, d in zip(host_ids, device_ids) if h != NULL_HOST_BLOCK_ID]
