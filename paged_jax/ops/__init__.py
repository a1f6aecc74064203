"""Paged-attention ops: the slot-mapped KV write and ragged paged attention.

KV pool layout (per layer): ``(k_pages, v_pages)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Block 0 is the reserved null block: padding tokens write there and padded block-table entries point there.
"""

from paged_jax.ops.kv_write import write_kv
from paged_jax.ops.ragged_paged_attention import ragged_paged_attention

__all__ = ["write_kv", "ragged_paged_attention"]
