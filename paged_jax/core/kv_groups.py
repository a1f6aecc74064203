"""KV-cache groups: which layers keep which tokens' K/V (vLLM's hybrid KV-cache manager, design doc
"hybrid_kv_cache_manager").

A full-attention layer reads every earlier token's K/V; a layer with a sliding window of ``W`` tokens reads, for a
query at position ``p``, only keys ``p - W < j <= p``; a chunked layer (``models.config.AttentionChunk`` of ``C``
tokens, Llama 4) only keys ``p // C * C <= j <= p``, those of its own chunk. A group's span is its window (int), its
``AttentionChunk`` or None (full). Layers that keep the same tokens form a group, and each group has its own block
table per request. A sliding or chunked group's table keeps its length but points the entries of blocks no later
query reads at the null block 0, and their blocks go back to the pool (still hashed: the prefix cache may hand them
to a later request until they are evicted). The kernel's indexing and shapes stay fixed.

Group layout (``kv_cache_groups``, vLLM's ``KVCacheGroupSpec``): layers are split by window; when the kinds differ in
count, every kind is cut into groups of the smallest kind's count, so one block of the shared pool is that many
layers' pages whatever group holds it (Gemma 3 12B: 8 full layers, 40 sliding ones -> 1 full group and 5 sliding
groups of 8 layers).

Pure host-side arithmetic: ``paged_jax.core.kv_cache_manager`` applies the sliding-window rules to its block tables,
``kv_pool_capacity`` sizes a pool with and without groups.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from models.config import AttentionChunk

KVSpan = int | AttentionChunk | None  # a group's window in tokens, its attention chunk, or None (full attention)
NULL_BLOCK_ID = 0  # the pool's reserved block: padding writes there, entries that slid out of a window point there


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True)
class KVCacheGroupSpec:
    """One group: its layers' common span (``KVSpan``: a window, an ``AttentionChunk``, None: full attention) and
    their indices."""

    sliding_window: KVSpan
    layers: tuple[int, ...]


def _span_order(span: KVSpan) -> tuple[int, int]:
    return (0, 0) if span is None else (2, span.size) if isinstance(span, AttentionChunk) else (1, span)


def span_tokens(span: KVSpan) -> int | None:
    """The most tokens a query of a group reads: its window, its chunk, or None (full attention)."""
    return span.size if isinstance(span, AttentionChunk) else span


def kv_cache_groups(layer_windows: Sequence[KVSpan]) -> tuple[KVCacheGroupSpec, ...]:
    """The groups of a model whose layer ``i`` attends with span ``layer_windows[i]`` (``KVSpan``; None: full
    attention; ``ModelConfig.layer_kv_spans``).

    One group per span when every layer has the same; else each span's layers (in layer order) are cut into
    groups of the smallest span's layer count (the last group of a kind may be short). Full-attention groups
    first, then windows ascending, then chunks ascending."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    if not by_window:
        raise ValueError("layer_windows must name at least one layer")
    size = min(len(layers) for layers in by_window.values())
    groups = []
    for window in sorted(by_window, key=_span_order):
        layers = by_window[window]
        step = len(layers) if len(by_window) == 1 else size
        groups.extend(KVCacheGroupSpec(window, tuple(layers[i:i + step])) for i in range(0, len(layers), step))
    return tuple(groups)


def engine_kv_groups(layer_windows: Sequence[KVSpan], *, mixed_groups: bool = True
                     ) -> tuple[KVCacheGroupSpec, ...]:
    """The engine's groups (``layer_windows``: each layer's ``KVSpan``): one group of every layer when no layer or
    every layer slides (then by the widest window, which bounds what any layer reads) or every layer has the same
    span, else ``kv_cache_groups``. A model without windows or chunks gets ``(KVCacheGroupSpec(None, all
    layers),)``: groups off, the layout of a plain paged pool.

    ``mixed_groups`` False (pipeline stages: their attention takes one block table per sequence): a mix of kinds is
    one full-attention group, every layer keeping every token's K/V."""
    all_layers = tuple(range(len(layer_windows)))
    spans = set(layer_windows)
    if len(spans) == 1:
        return (KVCacheGroupSpec(next(iter(spans)), all_layers),)
    if None in spans or any(isinstance(span, AttentionChunk) for span in spans):
        return kv_cache_groups(layer_windows) if mixed_groups else (KVCacheGroupSpec(None, all_layers),)
    return (KVCacheGroupSpec(max(spans), all_layers),)


def group_block_key(block_hash: bytes, group: int) -> bytes:
    """Prefix-cache key of group ``group``'s block with chained hash ``block_hash`` (group 0: the hash itself)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


def num_skipped_blocks(num_computed_tokens: int, sliding_window: int | AttentionChunk, block_size: int) -> int:
    """Leading blocks of a sequence that no query at a position ``>= num_computed_tokens`` reads: those wholly
    before position ``num_computed_tokens - sliding_window + 1`` (a window), or before the chunk of position
    ``num_computed_tokens`` (an ``AttentionChunk``)."""
    if isinstance(sliding_window, AttentionChunk):
        return num_computed_tokens // sliding_window.size * sliding_window.size // block_size
    return max(0, num_computed_tokens - sliding_window + 1) // block_size


def max_blocks_per_request(num_tokens: int, sliding_window: KVSpan, block_size: int,
                           max_chunk_tokens: int) -> int:
    """The most blocks one request of ``num_tokens`` tokens holds in a group at once, steps of at most
    ``max_chunk_tokens`` new tokens: ``ceil(num_tokens / block_size)`` with full attention, else at most
    ``ceil((W - 1 + max_chunk_tokens) / block_size) + 1`` with ``W`` the window or the chunk (``ceil(W / bs) + 1``
    while decoding: the step's first query reads at most ``W - 1`` earlier tokens)."""
    full = cdiv(num_tokens, block_size)
    if sliding_window is None:
        return full
    return min(full, cdiv(span_tokens(sliding_window) - 1 + max_chunk_tokens, block_size) + 1)


def longest_window_hit(hit_ids: Sequence[int | None], sliding_window: int | AttentionChunk, block_size: int) -> int:
    """Prefix-cache hit of a sliding or chunked group: the largest ``n <= len(hit_ids)`` whose blocks a query at position
    ``n * block_size`` reads (``num_skipped_blocks(n * block_size, ...)`` up to ``n``) are all cached.

    ``hit_ids[i]``: the cached block of the sequence's block ``i``, or None (a miss). Blocks before the window may
    be missing (evicted after they slid out)."""
    best = run = 0
    for i, block_id in enumerate(hit_ids):
        run = run + 1 if block_id is not None else 0
        n = i + 1
        if run >= n - num_skipped_blocks(n * block_size, sliding_window, block_size):
            best = n
    return best


def groups_prefix_hit(hit_ids: Sequence[Sequence[int | None]], windows: Sequence[KVSpan],
                      block_size: int) -> int:
    """Blocks of the longest prefix-cache hit valid for every group: ``hit_ids[g][i]`` is group ``g``'s cached block
    of the sequence's block ``i`` or None. A full group needs every block of the hit, a sliding group those in the
    window of the first uncomputed token (``longest_window_hit``); a shorter hit stays valid for a full group but not
    always for a sliding one, so the groups are asked again until all agree."""
    num_hit = len(hit_ids[0]) if hit_ids else 0
    for ids, window in zip(hit_ids, windows):
        if window is None:
            num_hit = next((i for i, block_id in enumerate(ids[:num_hit]) if block_id is None), num_hit)
    sliding = [(ids, window) for ids, window in zip(hit_ids, windows) if window is not None]
    while True:
        agreed = num_hit
        for ids, window in sliding:
            num_hit = longest_window_hit(ids[:num_hit], window, block_size)
        if num_hit == agreed:
            return num_hit


@dataclasses.dataclass(frozen=True)
class PoolCapacity:
    """A KV pool's capacity under one layout.

    Fields:
      num_groups: block tables per request (1 without groups).
      layers_per_block: layers whose pages one block holds.
      block_bytes: bytes of one block (K and V).
      num_blocks: blocks in the budget.
      tokens: tokens every group can hold at once, ``num_blocks // num_groups * block_size`` (vLLM's figure).
      blocks_per_request: blocks one request of ``context_len`` tokens holds, all groups together.
      max_requests: requests of ``context_len`` tokens that fit at once.
    """

    num_groups: int
    layers_per_block: int
    block_bytes: int
    num_blocks: int
    tokens: int
    blocks_per_request: int
    max_requests: int


def kv_pool_capacity(layer_windows: Sequence[KVSpan], *, kv_budget_bytes: int, page_bytes: int,
                     block_size: int, context_len: int, max_chunk_tokens: int, grouped: bool) -> PoolCapacity:
    """Capacity of ``kv_budget_bytes`` of KV pool for requests of ``context_len`` tokens.

    ``page_bytes``: one layer's K and V of one block (``2 * block_size * num_kv_heads * head_dim * itemsize``).
    ``grouped``: the layout of ``kv_cache_groups`` (a block holds one group's layers; sliding groups hold
    ``max_blocks_per_request`` blocks per request); else every layer keeps every token in one table."""
    if grouped:
        groups = kv_cache_groups(layer_windows)
    else:
        groups = (KVCacheGroupSpec(None, tuple(range(len(layer_windows)))),)
    layers_per_block = max(len(group.layers) for group in groups)
    block_bytes = layers_per_block * page_bytes
    num_blocks = max(0, kv_budget_bytes // block_bytes)
    per_request = sum(max_blocks_per_request(context_len, group.sliding_window, block_size, max_chunk_tokens)
                      for group in groups)
    return PoolCapacity(num_groups=len(groups), layers_per_block=layers_per_block, block_bytes=block_bytes,
                        num_blocks=num_blocks, tokens=num_blocks // len(groups) * block_size,
                        blocks_per_request=per_request, max_requests=num_blocks // per_request)
