"""Fitting a model's q / kv attention heads onto tensor-parallel devices: the head rewrite.

With ``Hq`` q heads, ``Hkv`` kv heads, group ``g = Hq / Hkv`` and ``tp`` devices the model is rewritten into an
*equivalent* one with ``Hkv' = lcm(Hkv, tp)`` kv heads (each original kv head replicated ``r = Hkv' / Hkv`` times, so
every device holds exactly the kv heads its q heads need) and ``g' = ceil(g / r)`` q heads per kv head
(``Hq' = Hkv' * g'``). The ``g`` q heads of an original group are dealt out ``g'`` at a time to its ``r`` replicas;
when ``r * g' > g`` the leftover q heads are zero padding: zero columns in q_proj (and its bias), zero rows in
o_proj, so they contribute exactly nothing to the output. Examples: Hq=4, Hkv=2, tp=4 -> Hkv'=4 (each kv head
twice), no padding; SmolLM2 (Hq=9, Hkv=3): tp=3 is natural, tp=2 -> Hkv'=6, Hq'=12 (3 zero heads), tp=4 or 8 ->
Hkv'=Hq'=12 or 24. ``pad_heads=False`` refuses padding with a ValueError instead.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """How the attention heads of one model are laid out over ``tensor_parallel_size`` devices.

    ``kv_replication`` (r) copies of each kv head and ``q_heads_per_kv`` (g') q-head slots per (replicated) kv head;
    see the module docstring. The identity layout has r = 1 and g' = the model's group size.
    """

    tensor_parallel_size: int
    num_q_heads: int
    num_kv_heads: int
    kv_replication: int
    q_heads_per_kv: int

    @property
    def group_size(self) -> int:
        """Original q heads per kv head (g)."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def padded_group_size(self) -> int:
        """q-head slots per *original* kv head after the rewrite (r * g' >= g)."""
        return self.kv_replication * self.q_heads_per_kv

    @property
    def num_q_heads_padded(self) -> int:
        return self.num_kv_heads_padded * self.q_heads_per_kv

    @property
    def num_kv_heads_padded(self) -> int:
        return self.num_kv_heads * self.kv_replication

    @property
    def num_padding_q_heads(self) -> int:
        return self.num_q_heads_padded - self.num_q_heads

    @property
    def is_identity(self) -> bool:
        return self.kv_replication == 1 and self.q_heads_per_kv == self.group_size

    @classmethod
    def for_heads(cls, num_q_heads: int, num_kv_heads: int, tensor_parallel_size: int, *,
                  pad_heads: bool = True) -> "HeadLayout":
        """The smallest layout in which every device gets the same number of whole q and kv heads.

        Raises:
          ValueError: ``pad_heads=False`` and the q heads would need padding (names tensor_parallel_size and the
            head counts).
        """
        if num_q_heads % num_kv_heads != 0:
            raise ValueError(f"num_attention_heads ({num_q_heads}) must be a multiple of num_key_value_heads "
                             f"({num_kv_heads})")
        tp = tensor_parallel_size
        group = num_q_heads // num_kv_heads
        num_kv_padded = num_kv_heads * tp // math.gcd(num_kv_heads, tp)  # lcm
        replication = num_kv_padded // num_kv_heads
        q_per_kv = -(-group // replication)
        layout = cls(tp, num_q_heads, num_kv_heads, replication, q_per_kv)
        if layout.num_padding_q_heads and not pad_heads:
            raise ValueError(
                f"tensor_parallel_size={tp} does not divide the heads evenly (num_attention_heads={num_q_heads}, "
                f"num_key_value_heads={num_kv_heads}): it would need {layout.num_padding_q_heads} zero q heads; "
                f"use a tensor_parallel_size dividing both head counts or allow head padding"
            )
        return layout

    # -- weight rewrites; xp is numpy (host, while loading) or jax.numpy (on device) ---------------------------------

    def expand_q_columns(self, w, head_dim: int, xp=np):
        """q_proj kernel ``[H, Hq*D]`` (or bias ``[Hq*D]``) -> ``[..., Hq'*D]`` with zero padding q heads."""
        lead = w.shape[:-1]
        grouped = w.reshape(*lead, self.num_kv_heads, self.group_size, head_dim)
        pad = self.padded_group_size - self.group_size
        if pad:
            zeros = xp.zeros((*lead, self.num_kv_heads, pad, head_dim), dtype=w.dtype)
            grouped = xp.concatenate([grouped, zeros], axis=-2)
        return grouped.reshape(*lead, self.num_q_heads_padded * head_dim)

    def expand_q_rows(self, w, head_dim: int, xp=np):
        """o_proj kernel ``[Hq*D, H]`` -> ``[Hq'*D, H]`` with zero rows for padding q heads."""
        grouped = w.reshape(self.num_kv_heads, self.group_size, head_dim, w.shape[-1])
        pad = self.padded_group_size - self.group_size
        if pad:
            zeros = xp.zeros((self.num_kv_heads, pad, head_dim, w.shape[-1]), dtype=w.dtype)
            grouped = xp.concatenate([grouped, zeros], axis=1)
        return grouped.reshape(self.num_q_heads_padded * head_dim, w.shape[-1])

    def expand_kv_columns(self, w, head_dim: int, xp=np):
        """k/v_proj kernel ``[H, Hkv*D]`` (or bias ``[Hkv*D]``) -> ``[..., Hkv'*D]``, each kv head repeated r times
        in place (kv head h becomes heads h*r .. h*r + r - 1)."""
        if self.kv_replication == 1:
            return w
        lead = w.shape[:-1]
        heads = w.reshape(*lead, self.num_kv_heads, 1, head_dim)
        repeated = xp.broadcast_to(heads, (*lead, self.num_kv_heads, self.kv_replication, head_dim))
        return repeated.reshape(*lead, self.num_kv_heads_padded * head_dim)
