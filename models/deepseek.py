"""DeepSeek-V2 / V3's sparse MLP: their router (``MoeConfig.scoring_func`` / ``topk_method``, expert groups,
``routed_scaling_factor``) and shared experts around the experts of ``models.moe`` (the same grouped matmuls, expert
parallelism and routing capture as Qwen3-MoE's: ``DeepseekMoeBlock`` is a ``SparseMoeBlock``). The attention is
``models.mla``; the first ``first_k_dense_replace`` layers are dense (``MoeConfig.mlp_only_layers``).

For ``x: dtype[T, H]`` (transformers' ``DeepseekV2Moe`` / ``DeepseekV3MoE``, vLLM's ``grouped_topk``)::

    logits = float32(x) @ float32(gate)                                   # [T, E]
    scores = softmax(logits) (V2)  |  sigmoid(logits) (V3)
    choice = scores (+ e_score_correction_bias, V3)
    group_limited_greedy: keep the topk_group of n_group groups with the largest max(choice) (others -> 0)
    noaux_tc: keep the topk_group groups with the largest sum of their top-2 choices (others -> -inf)
    ids = top_k(choice, k); weights = scores[ids] (/ their sum + 1e-20 when norm_topk_prob) * routed_scaling_factor
    out = experts(x, weights, ids) + shared_experts(x)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig, MoeConfig
from models.moe import MoeExperts, SparseMoeBlock, check_moe_impl, expert_fp8_block

# Router parameters stored under their own names (the loader reads them as is).
CHECKPOINT_LEAVES = frozenset({"e_score_correction_bias"})


def group_mask(choice: jax.Array, moe: MoeConfig) -> jax.Array:
    """``choice float32[T, E]`` -> ``bool[T, E]``: the experts of each token's ``topk_group`` best groups."""
    num_tokens, num_experts = choice.shape
    grouped = choice.reshape(num_tokens, moe.n_group, num_experts // moe.n_group)
    if moe.topk_method == "noaux_tc":
        group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
    else:
        group_scores = jnp.max(grouped, axis=-1)
    _, best = jax.lax.top_k(group_scores, moe.topk_group)  # [T, topk_group]
    kept = jnp.any(best[:, :, None] == jnp.arange(moe.n_group)[None, None, :], axis=1)  # [T, n_group]
    return jnp.repeat(kept, num_experts // moe.n_group, axis=1)


def deepseek_route(logits: jax.Array, correction_bias: jax.Array | None, moe: MoeConfig
                   ) -> tuple[jax.Array, jax.Array]:
    """``logits float32[T, E]`` (and V3's ``e_score_correction_bias float32[E]``) -> ``(weights float32[T, k], ids
    int32[T, k])`` by the module docstring's rule, largest choice first."""
    scores = jax.nn.softmax(logits, axis=-1) if moe.scoring_func == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
    if moe.topk_method != "greedy":
        masked = -jnp.inf if moe.topk_method == "noaux_tc" else 0.0
        choice = jnp.where(group_mask(choice, moe), choice, masked)
    _, ids = jax.lax.top_k(choice, moe.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if moe.norm_topk_prob:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * moe.routed_scaling_factor, ids.astype(jnp.int32)


class DeepseekRouter(nnx.Module):
    """``kernel [H, E]`` (HF ``mlp.gate.weight``, transposed) and, for ``noaux_tc``, ``e_score_correction_bias
    float32[E]``; the logits are computed in float32 (transformers keeps the router in float32)."""

    def __init__(self, hidden: int, moe: MoeConfig, *, param_dtype, rngs: nnx.Rngs, init_std: float):
        self.kernel = nnx.Param(nnx.initializers.normal(stddev=init_std)(rngs.params(), (hidden, moe.num_experts),
                                                                         param_dtype))
        self.e_score_correction_bias = nnx.data(
            nnx.Param(jnp.zeros((moe.num_experts,), jnp.float32)) if moe.topk_method == "noaux_tc" else None)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [T, H]`` -> ``float32[T, E]`` logits."""
        return jnp.dot(x.astype(jnp.float32), self.kernel[...].astype(jnp.float32),
                       precision=jax.lax.Precision.HIGHEST)


class DeepseekMoeBlock(SparseMoeBlock):
    """The sparse MLP of one DeepSeek layer: ``gate`` (``DeepseekRouter``), ``experts`` (``models.moe.MoeExperts``)
    and ``shared_experts`` (a dense gated MLP ``n_shared_experts * moe_intermediate_size`` wide, built by the
    caller: ``models.llama.MLP``), or None without shared experts."""

    def __init__(self, config: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs, init_std: float,
                 shared_experts: nnx.Module | None, impl: str = "auto"):
        moe = config.moe
        self.moe = moe
        self.num_experts_per_tok = moe.num_experts_per_tok
        self.norm_topk_prob = moe.norm_topk_prob
        self.dtype = dtype
        self.impl = check_moe_impl(impl)
        self.capture_routing = False  # SparseMoeBlock's static hooks (models.moe_routing)
        self.expert_parallel = None
        self.gate = DeepseekRouter(config.hidden_size, moe, param_dtype=param_dtype, rngs=rngs, init_std=init_std)
        self.experts = MoeExperts(moe.num_experts, config.hidden_size, moe.moe_intermediate_size,
                                  param_dtype=param_dtype, rngs=rngs, init_std=init_std,
                                  fp8_block=expert_fp8_block(config))
        self.shared_experts = nnx.data(shared_experts)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [T, H]`` -> ``(weights float32[T, k], ids int32[T, k])`` (``deepseek_route``)."""
        bias = self.gate.e_score_correction_bias
        return deepseek_route(self.gate(x), None if bias is None else bias[...], self.moe)

    def __call__(self, x: jax.Array, lora=None) -> jax.Array:
        """``x: [T, H]`` -> ``[T, H]``: the routed experts' weighted sum plus the shared experts."""
        out = super().__call__(x, lora)
        return out if self.shared_experts is None else out + self.shared_experts(x)
