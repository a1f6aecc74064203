"""Llama 4's sparse MLP (``Llama4ForCausalLM``, the text model of meta-llama/Llama-4-Scout-17B-16E and -Maverick):
a bias-free router whose top-k logits go through a sigmoid and scale each chosen expert's *input*, experts with a
fused gate/up projection (gate columns first, then up, as published), and a shared expert on every token. The rest
of the model is the one decoder of ``models.llama``: chunked local attention on the RoPE layers, NoPE layers with
the attention temperature, the weightless q/k norm and interleaved RoPE are ``ModelConfig`` fields it reads.

For ``x: dtype[T, H]`` (transformers' ``Llama4TextMoe``):

    top, ids = top_k(x @ router, k); scores = dtype(sigmoid(float32(top)))       # [T, k]
    gate_up = (x[t] * scores[t, j]) @ gate_up_proj[e]                            # [2I], e = ids[t, j]
    out[t] = shared_expert(x[t]) + sum_j (silu(gate_up[:I]) * gate_up[I:]) @ down_proj[e]

Expert weights in model layout, as the checkpoint stores them (``feed_forward.experts.gate_up_proj`` ``[E, H, 2I]``,
``down_proj`` ``[E, I, H]``); the grouped matmuls are ``models.moe``'s, over the (token, slot) pairs sorted by
expert.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.dense import dense_linear
from models.moe import (ROUTED_EXPERTS, SparseMoeBlock, check_moe_impl, grouped_matmul_for, in_pair_order,
                        refuse_mlp_lora, sort_by_expert)

# Expert parameters stored under their own names and layout in the checkpoint (the loader reads them as they are).
EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def route_top_k_sigmoid(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """``logits [T, E]`` -> ``(scores float32[T, k], ids int32[T, k])``: the sigmoid of the k largest logits."""
    top, ids = jax.lax.top_k(logits, top_k)
    return jax.nn.sigmoid(top.astype(jnp.float32)), ids.astype(jnp.int32)


class Llama4Experts(nnx.Module):
    """The experts' stacked weights: ``gate_up_proj`` ``[E, H, 2I]`` (gate then up columns), ``down_proj``
    ``[E, I, H]``."""

    def __init__(self, num_experts: int, hidden: int, inter: int, *, param_dtype, rngs: nnx.Rngs, init_std: float):
        init = nnx.initializers.normal(stddev=init_std)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, 2 * inter), param_dtype))
        self.down_proj = nnx.Param(init(rngs.params(), (num_experts, inter, hidden), param_dtype))


class Llama4MoeBlock(SparseMoeBlock):
    """Llama 4's MLP of a sparse layer (HF ``feed_forward``): ``router`` (an ``nnx.Linear`` ``[H, E]``), ``experts``
    (``Llama4Experts``) and ``shared_expert`` (the dense MLP module the decoder builds, ``shared_expert_intermediate_size``
    wide). ``impl``: the grouped matmul (``models.moe.MOE_IMPLS``); routing capture as ``SparseMoeBlock``'s;
    ``expert_parallel``: None, or what runs each device's share of the experts and sums them over the devices
    (``partial_sums``, ``paged_jax.parallel.expert_parallel.ExpertParallel``'s contract)."""

    def __init__(self, config: ModelConfig, shared_expert: nnx.Module, *, dtype, param_dtype, rngs: nnx.Rngs,
                 init_std: float, impl: str = "auto"):
        moe = config.moe
        self.num_experts_per_tok = moe.num_experts_per_tok
        self.norm_topk_prob = False
        self.dtype = dtype
        self.impl = check_moe_impl(impl)
        self.capture_routing = False  # SparseMoeBlock's static hooks (models.moe_routing)
        self.expert_parallel = None  # or experts over devices: paged_jax.parallel.ExpertParallel
        self.router = dense_linear(config.hidden_size, moe.num_experts, use_bias=False, dtype=dtype,
                                   param_dtype=param_dtype, init_std=init_std, rngs=rngs)
        self.experts = Llama4Experts(moe.num_experts, config.hidden_size, moe.moe_intermediate_size,
                                     param_dtype=param_dtype, rngs=rngs, init_std=init_std)
        self.shared_expert = shared_expert

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [T, H]`` -> ``(scores float32[T, k], ids int32[T, k])``."""
        return route_top_k_sigmoid(self.router(x), self.num_experts_per_tok)

    def __call__(self, x: jax.Array, lora=None) -> jax.Array:
        """``x: [T, H]`` -> ``[T, H]``; LoRA adapters of the MLP projections are refused as ``SparseMoeBlock``
        does."""
        refuse_mlp_lora(lora)
        scores, ids = self.route(x)
        if self.capture_routing:
            self.sow(nnx.Intermediate, ROUTED_EXPERTS, ids)
        num_tokens, hidden = x.shape
        # Each (token, slot) pair's expert input: the token scaled by its score, rounded to the compute dtype.
        pairs = (x[:, None, :] * scores.astype(x.dtype)[:, :, None]).reshape(-1, hidden)  # [T * k, H]
        routed = self._experts(pairs, ids.reshape(-1, 1)).reshape(num_tokens, -1, hidden)
        out = self.shared_expert(x).astype(jnp.float32) + jnp.sum(routed.astype(jnp.float32), axis=1)
        return out.astype(x.dtype)

    def _experts(self, rows: jax.Array, ids: jax.Array) -> jax.Array:
        """Each row's expert SwiGLU: ``rows dtype[N, H]``, ``ids int32[N, 1]`` -> ``dtype[N, H]`` in row order
        (``llama4_experts``); with ``expert_parallel`` each device's share of the experts, summed over devices."""
        weights = (self.experts.gate_up_proj[...], self.experts.down_proj[...])
        if self.expert_parallel is None:
            return llama4_experts(self.impl, rows, ids, *weights)
        local = functools.partial(llama4_experts, self.impl)
        return self.expert_parallel.partial_sums(local, (rows, ids), weights, (2, 1)).astype(rows.dtype)


def llama4_experts(impl: str, rows: jax.Array, ids: jax.Array, gate_up, down, first_expert=None) -> jax.Array:
    """Each row's expert SwiGLU by grouped matmuls over the rows sorted by expert.

    Args:
      impl: the grouped matmul (``models.moe.MOE_IMPLS``).
      rows: ``dtype[N, H]``; ids: ``int32[N, 1]`` global expert ids.
      gate_up: ``[E_local, H, 2I']`` (gate then up columns), down: ``[E_local, I', H]``: every expert
        (``first_expert`` None), or one device's part: experts ``first_expert + e`` whole, or a width slice ``I'`` of
        every expert (``first_expert`` 0; the columns laid out as ``[gate slice | up slice]``).
    Returns:
      ``dtype[N, H]`` in row order; with ``first_expert``: ``float32[N, H]``, zero on the rows of other devices'
      experts, whose sum over the devices is the whole result (``ExpertParallel.partial_sums``).
    """
    dtype = rows.dtype
    num_local = gate_up.shape[0]
    if first_expert is not None:  # other devices' experts sort past every group (an out-of-range id)
        ids = ids - first_expert
        is_local = (ids >= 0) & (ids < num_local)
        ids = jnp.where(is_local, ids, num_local)
    order, group_sizes = sort_by_expert(ids, num_local)
    matmul = grouped_matmul_for(impl, rows.shape[0], rows.shape[1], dtype)
    gate_up = matmul(rows, gate_up.astype(dtype), group_sizes, row_index=order)
    gate, up = jnp.split(gate_up.astype(jnp.float32), 2, axis=-1)
    act = (jax.nn.silu(gate) * up).astype(dtype)
    out = matmul(act, down.astype(dtype), group_sizes)
    if first_expert is None:
        return in_pair_order(out, order)
    # Rows outside every group: zero, whatever a kernel leaves there.
    out = jnp.where((jnp.arange(out.shape[0]) < jnp.sum(group_sizes))[:, None], out, 0)
    return jnp.where(is_local, in_pair_order(out, order).astype(jnp.float32), 0.0)
