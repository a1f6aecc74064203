"""The device side of KV-cache groups (``paged_jax.core.kv_groups``).

With one group (no windows, or every layer sliding) the pool is one ``(k_pages, v_pages)`` per layer and a step
carries one block table per sequence, as without groups. With ``G > 1`` groups of at most ``N`` layers the pool holds
``N`` slots of ``(k_pages, v_pages)`` ``[num_blocks, block_size, Hkv, D]``: layer ``l`` lives in slot ``l``'s index in
its group, so one block of the pool is ``N`` layers' pages whatever group holds it. A step's metadata carries every
group's block table (``int32[S, B * G]``, a request's entries interleaved as the KV-cache manager keeps them) and slot
mapping (``int32[G, T]``), in the one step buffer; each layer attends through its group's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np

from models.config import ModelConfig
from paged_jax.core.kv_groups import engine_kv_groups


@dataclasses.dataclass(frozen=True)
class KVPoolLayout:
    """Where each layer's K/V lives.

    Fields:
      num_groups: G, the block tables per request.
      num_slots: ``(k_pages, v_pages)`` pairs in the pool (layers per block).
      group_of_layer / slot_of_layer: per layer, its group and its slot.
    """

    num_groups: int
    num_slots: int
    group_of_layer: tuple[int, ...]
    slot_of_layer: tuple[int, ...]

    @classmethod
    def for_config(cls, config: ModelConfig, *, mixed_groups: bool = True) -> "KVPoolLayout":
        """``mixed_groups``: see ``kv_groups.engine_kv_groups``."""
        groups = engine_kv_groups(config.layer_kv_spans, mixed_groups=mixed_groups)
        group_of_layer = [0] * config.num_hidden_layers
        slot_of_layer = [0] * config.num_hidden_layers
        for g, group in enumerate(groups):
            for slot, layer in enumerate(group.layers):
                group_of_layer[layer], slot_of_layer[layer] = g, slot
        return cls(len(groups), max(len(group.layers) for group in groups), tuple(group_of_layer),
                   tuple(slot_of_layer))


def kv_page_shapes(config: ModelConfig, num_blocks: int, block_size: int, *, host_pool: bool = False
                   ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One slot's K and V pool shapes, ``[num_blocks, block_size, Hkv, D]`` with ``D`` each of
    ``ModelConfig.kv_pool_head_dims`` (a latent cache's V pool has width 0). ``host_pool``: a host KV pool mirrors
    the pool, stacking K and V (``paged_jax.worker.host_kv_pool``): ValueError naming its flags for a latent cache."""
    shapes = tuple((num_blocks, block_size, config.num_key_value_heads, dim) for dim in config.kv_pool_head_dims)
    if host_pool and shapes[0] != shapes[1]:
        raise ValueError("swap_space / kv_offloading_size: the host KV pool does not hold a latent KV cache "
                         f"({config.architecture}'s multi-head latent attention); use preemption_mode 'recompute' "
                         "and no host tier")
    return shapes


def mixes_kv_groups(sharding_plan) -> bool:
    """Whether an engine running with ``sharding_plan`` (None: one device) keeps a model's sliding-window and full
    layers in their own KV-cache groups (``kv_groups.engine_kv_groups``' ``mixed_groups``): one device and tensor
    parallelism do; a plan whose attention takes one block table per sequence says so (``mixes_kv_groups``)."""
    return sharding_plan is None or sharding_plan.mixes_kv_groups


def pack_group_slots(block_tables: np.ndarray, token_rows: np.ndarray, positions: np.ndarray, block_size: int,
                     num_groups: int, slot_mapping: np.ndarray) -> None:
    """Write each token's KV slot in every group into ``slot_mapping`` (int32[G * T], group-major) from the packed
    ``block_tables`` (int32[S, B * G], interleaved entries), the tokens' rows and positions (int64[num_tokens]);
    ``G = 1``: the plain slot mapping."""
    num_tokens = len(positions)
    bucket_tokens = len(slot_mapping) // num_groups
    slots = slot_mapping.reshape(num_groups, bucket_tokens)
    entries = positions // block_size * num_groups
    offsets = positions % block_size
    for g in range(num_groups):
        slots[g, :num_tokens] = block_tables[token_rows, entries + g] * block_size + offsets


class GroupedKVCaches:
    """What the model sees as its per-layer KV state when ``G > 1``: ``caches[l]`` is ``(k_pages, v_pages,
    group_meta)`` of layer ``l``'s slot and group (``paged_jax.ops.write_and_attend`` attends through the group's
    ``block_tables`` / ``slot_mapping``); assigning a layer's returned ``(k_pages, v_pages)`` updates its slot, so
    the next layer on that slot reads it (``models.llama.run_decoder_layers``). Lives only while a step is traced.

    Args:
      pool: the slots' ``(k_pages, v_pages)`` pairs.
      layout: the model's ``KVPoolLayout``.
      group_meta: per group ``{"block_tables": int32[S, B], "slot_mapping": int32[T]}``.
    """

    def __init__(self, pool: Sequence, layout: KVPoolLayout, group_meta: Sequence[dict[str, jax.Array]]):
        self.pool = list(pool)
        self.layout = layout
        self.group_meta = group_meta

    def __len__(self) -> int:
        return len(self.layout.slot_of_layer)

    def __getitem__(self, layer: int):
        k_pages, v_pages = self.pool[self.layout.slot_of_layer[layer]]
        return k_pages, v_pages, self.group_meta[self.layout.group_of_layer[layer]]

    def __setitem__(self, layer: int, kv_layer) -> None:
        self.pool[self.layout.slot_of_layer[layer]] = (kv_layer[0], kv_layer[1])

    def copy(self) -> "GroupedKVCaches":
        return GroupedKVCaches(self.pool, self.layout, self.group_meta)


def group_metadata(num_groups: int, block_tables: jax.Array, slot_mapping: jax.Array) -> list[dict[str, jax.Array]]:
    """Inside the jitted step: per group ``{"block_tables": int32[S, B], "slot_mapping": int32[T]}`` from the
    step's ``block_tables`` int32[S, B * G] (interleaved entries) and ``slot_mapping`` int32[G * T]."""
    num_seqs, width = block_tables.shape
    tables = block_tables.reshape(num_seqs, width // num_groups, num_groups)
    slots = slot_mapping.reshape(num_groups, -1)
    return [dict(block_tables=tables[:, :, g], slot_mapping=slots[g]) for g in range(num_groups)]
