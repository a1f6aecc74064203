"""Multi-head latent attention (DeepSeek-V2 / V3, ``models.config.MlaConfig``), run as MQA over a latent KV cache.

transformers' form (per token ``x``, per head ``h``; ``L = kv_lora_rank``, ``R = qk_rope_head_dim``)::

    q = q_proj(x)  or  q_b_proj(rmsnorm(q_a_proj(x)))            # [H, nope + R] -> q_nope [H, nope], q_pe [H, R]
    latent, k_pe = kv_a_proj_with_mqa(x)                         # [L], [R] (one RoPE key for every head)
    latent = kv_a_layernorm(latent); q_pe, k_pe = rope(q_pe), rope(k_pe)
    k_nope[h], v[h] = latent @ W_UK[h], latent @ W_UV[h]          # kv_b_proj = [W_UK | W_UV] per head
    out[h] = softmax(scale * (q_nope[h] . k_nope[h] + q_pe[h] . k_pe)) @ v[h]

The form run here (vLLM's and FlashMLA's) never expands the cache: ``q_nope[h] . (latent @ W_UK[h]) = (W_UK[h]
q_nope[h]) . latent``, so each head's query is absorbed into latent space, ``[W_UK[h] q_nope[h] | q_pe[h]]`` (``L +
R`` wide), and attends over the cached rows ``[latent | k_pe]`` with one shared KV head; the values are the rows'
latent part, and ``W_UV[h]`` maps each head's latent output back: ``out[h] = (softmax(...) @ latent) @ W_UV[h]``.
The ``AttentionFn`` gets ``q [T, H, L + R]``, ``k [T, 1, L + R]`` and ``v = k[..., :L]`` (``[T, 1, L]``); a paged
attention stores only ``k`` (``ModelConfig.kv_pool_head_dims``: the V pool has no width) and reads the values from
it (``paged_jax.ops.write_and_attend``).

RoPE touches the ``R`` rope dims only, rotating adjacent pairs (DeepSeek's layout, ``rope_interleave``) or halves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.attention_fn import AttentionFn, LayerAttention, needs_layer_attention
from models.config import ModelConfig
from models.dense import dense_linear
from models.norm import RMSNorm
from models.qk_transform import apply_rope


def apply_rope_interleaved(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x: [T, H, R]`` whose pairs ``(x[2i], x[2i + 1])`` each turn by frequency ``i`` (``rope_cos_sin``
    tables ``[T, 1, R/2]``), float32 math; the result holds the pairs' first elements, then their second ones
    (transformers' DeepSeek-V3 order: q and k are laid out alike, so ``q . k`` is DeepSeek's)."""
    x32 = x.astype(jnp.float32)
    even, odd = x32[..., 0::2], x32[..., 1::2]
    return jnp.concatenate([even * cos - odd * sin, odd * cos + even * sin], axis=-1).astype(x.dtype)


_PROJECTIONS = frozenset({"q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "k_proj",
                          "v_proj", "qkv_proj"})


def refuse_lora(lora) -> None:
    """ValueError naming the attention projections a layer's LoRA state (``models.llama.with_lora``) adapts: latent
    attention's projections have no LoRA form here."""
    targets = sorted(set(getattr(lora, "weights", None) or ()) & _PROJECTIONS)
    if targets:
        raise ValueError(f"LoRA target modules {targets} are unsupported on multi-head latent attention")


class MlaAttention(nnx.Module):
    """One layer's latent attention: HF's parameters (``q_proj`` or ``q_a_proj`` / ``q_a_layernorm`` /
    ``q_b_proj``; ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``) around an ``AttentionFn``.
    ``project`` and ``attend`` split the work as ``models.llama.Attention``'s do (the decoder layer fuses the input
    norm with the projection's input)."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0, *, dtype, param_dtype, rngs: nnx.Rngs):
        mla, hidden = config.mla, config.hidden_size
        self.num_heads = config.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.latent_dim = mla.kv_lora_rank
        self.rope_interleave = mla.rope_interleave
        linear = functools.partial(dense_linear, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = functools.partial(RMSNorm, eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        q_width = self.num_heads * mla.qk_head_dim
        if mla.q_lora_rank is None:
            self.q_proj, self.q_a_proj, self.q_a_layernorm, self.q_b_proj = linear(hidden, q_width), None, None, None
        else:
            self.q_proj = None
            self.q_a_proj = linear(hidden, mla.q_lora_rank)
            self.q_a_layernorm = norm(mla.q_lora_rank)
            self.q_b_proj = linear(mla.q_lora_rank, q_width)
        self.kv_a_proj_with_mqa = linear(hidden, mla.latent_dim)
        self.kv_a_layernorm = norm(mla.kv_lora_rank)
        self.kv_b_proj = linear(mla.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim))
        self.o_proj = linear(self.num_heads * self.v_dim, hidden)
        self.qkv_proj = None  # the decoder layer's fused-projection slot: latent attention keeps its projections
        self.layer_attention = LayerAttention.for_layer(config, layer_idx) if needs_layer_attention(config) else None

    def __call__(self, layer_idx: int, x: jax.Array, rope: tuple, kv_layer, attention: AttentionFn, lora=None):
        """x: [T, hidden], rope: the forward's ``rope_tables`` -> ([T, hidden], kv_layer)."""
        return self.attend(layer_idx, *self.project(x, lora), rope, kv_layer, attention, lora)

    def project(self, x: jax.Array, lora=None) -> tuple[jax.Array, jax.Array, None]:
        """x: [T, hidden] -> (q [T, H * (nope + R)], the compressed KV ``[latent | k_pe]`` [T, L + R], None)."""
        refuse_lora(lora)
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q, self.kv_a_proj_with_mqa(x), None

    def attend(self, layer_idx: int, q: jax.Array, compressed_kv: jax.Array, _unused, rope: tuple, kv_layer,
               attention: AttentionFn, lora=None):
        """``project``'s outputs -> ([T, hidden], kv_layer): RoPE on the rope parts, the absorbed query, the
        attention over ``[latent | k_pe]`` rows (one KV head), ``W_UV`` and ``o_proj``."""
        num_tokens, dtype = q.shape[0], q.dtype
        q = q.reshape(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q[..., :self.nope_dim], q[..., self.nope_dim:]
        latent = self.kv_a_layernorm(compressed_kv[:, :self.latent_dim])  # [T, L]
        k_pe = compressed_kv[:, None, self.latent_dim:]  # [T, 1, R]
        cos, sin = rope[0]
        rotate = apply_rope_interleaved if self.rope_interleave else apply_rope
        q_pe, k_pe = rotate(q_pe, cos, sin), rotate(k_pe, cos, sin)
        # kv_b_proj's kernel [L, H * (nope + v)]: per head, W_UK [L, nope] then W_UV [L, v].
        w_kv_b = self.kv_b_proj.kernel[...].astype(dtype).reshape(self.latent_dim, self.num_heads, -1)
        q_latent = jnp.einsum("thn,lhn->thl", q_nope, w_kv_b[..., :self.nope_dim],
                              preferred_element_type=jnp.float32).astype(dtype)
        q_full = jnp.concatenate([q_latent, q_pe], axis=-1)  # [T, H, L + R]
        k_full = jnp.concatenate([latent[:, None, :], k_pe], axis=-1)  # [T, 1, L + R]
        options = {} if self.layer_attention is None else self.layer_attention.as_kwargs()
        out, kv_layer = attention(layer_idx, q_full, k_full, k_full[..., :self.latent_dim], kv_layer, **options)
        out = jnp.einsum("thl,lhv->thv", out.astype(dtype), w_kv_b[..., self.nope_dim:],
                         preferred_element_type=jnp.float32).astype(dtype)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim)), kv_layer
