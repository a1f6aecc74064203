"""gpt-oss's sparse MLP (``GptOssForCausalLM``, openai/gpt-oss-20b and -120b): a router with a bias whose top-k
logits are softmaxed, and experts with biases, a fused gate/up projection (gate and up columns interleaved, as
published) and a clamped SwiGLU. The rest of the model is the one decoder of ``models.llama`` (attention sinks,
q/k/v/o biases, YaRN, alternating sliding and full layers are ``ModelConfig`` fields it reads).

For ``x: dtype[T, H]`` (transformers' ``GptOssMLP``):

    logits = x @ router + router_bias                                     # [T, E]
    top, ids = top_k(float32(logits), k); weights = softmax(top)         # [T, k]
    gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]                  # [2I]; gate = [0::2], up = [1::2]
    g = min(gate, limit); u = clip(up, -limit, limit)
    out[t] = sum_j weights[t, j] * (((u + 1) * g * sigmoid(alpha * g)) @ down_proj[e] + down_proj_bias[e])

Expert weights in model layout (as transformers holds them and bf16 checkpoints store them): ``gate_up_proj``
``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``, biases ``[E, 2I]`` / ``[E, H]``. MXFP4 experts
(``MoeConfig.expert_format``, the published checkpoints) stay packed in device memory (``models.quantization.mxfp4``)
and are decoded inside the step, one layer at a time: all experts dequantized for a grouped matmul over the sorted
rows, or, when the step has few (token, expert) pairs (``MATVEC_PAIRS_PER_EXPERT``: decode), each pair's expert
decoded inside its own reduction (``mxfp4.matvec``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.moe import (ROUTED_EXPERTS, SparseMoeBlock, check_moe_impl, grouped_matmul_for, in_pair_order,
                        refuse_mlp_lora, sort_by_expert)
from models.quantization import mxfp4

# Expert parameters stored under their own names in the checkpoint, in model layout (the loader reads them as is).
EXPERT_PARAMS = {
    None: ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
    "mxfp4": ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
              "down_proj_scales", "down_proj_bias"),
}
CHECKPOINT_LEAVES = frozenset(name for names in EXPERT_PARAMS.values() for name in names) | {"sinks"}
# MXFP4 steps of fewer (token, expert) pairs than this many per expert multiply the packed bytes (``mxfp4.matvec``);
# wider ones dequantize the layer's experts for the grouped matmul. ``benchmarks/mxfp4_experts.py`` times both.
MATVEC_PAIRS_PER_EXPERT = 1


def clamped_swiglu(gate_up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """``[..., 2I]`` interleaved gate/up pre-activations -> float32 ``[..., I]`` (module docstring)."""
    gate_up = gate_up.astype(jnp.float32)
    gate = jnp.minimum(gate_up[..., 0::2], limit)
    up = jnp.clip(gate_up[..., 1::2], -limit, limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(gate * alpha))


def route_top_k_softmax(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """``logits [T, E]`` -> ``(weights float32[T, k], ids int32[T, k])``: the softmax over the k largest logits."""
    top, ids = jax.lax.top_k(logits.astype(jnp.float32), top_k)
    return jax.nn.softmax(top, axis=-1), ids.astype(jnp.int32)


class GptOssExperts(nnx.Module):
    """The experts' stacked weights and biases (``EXPERT_PARAMS``): in ``param_dtype``, or for ``expert_format``
    "mxfp4" the packed ``uint8`` blocks ``[E, out, in // 32, 16]`` and scales ``[E, out, in // 32]``."""

    def __init__(self, num_experts: int, hidden: int, inter: int, *, expert_format: str | None, param_dtype,
                 rngs: nnx.Rngs, init_std: float):
        self.expert_format = expert_format
        init = nnx.initializers.normal(stddev=init_std)
        if expert_format == "mxfp4":
            for name, (out_dim, in_dim) in (("gate_up_proj", (2 * inter, hidden)), ("down_proj", (hidden, inter))):
                blocks_shape, scales_shape = mxfp4.packed_shapes(num_experts, out_dim, in_dim)
                setattr(self, f"{name}_blocks", nnx.Param(jnp.zeros(blocks_shape, jnp.uint8)))
                setattr(self, f"{name}_scales", nnx.Param(jnp.full(scales_shape, mxfp4.SCALE_BIAS, jnp.uint8)))
        else:
            self.gate_up_proj = nnx.Param(init(rngs.params(), (num_experts, hidden, 2 * inter), param_dtype))
            self.down_proj = nnx.Param(init(rngs.params(), (num_experts, inter, hidden), param_dtype))
        self.gate_up_proj_bias = nnx.Param(jnp.zeros((num_experts, 2 * inter), param_dtype))
        self.down_proj_bias = nnx.Param(jnp.zeros((num_experts, hidden), param_dtype))

    def weight(self, name: str, dtype) -> jax.Array:
        """Expert weight ``name`` ("gate_up_proj" / "down_proj") of every expert in model layout ``[E, in, out]``
        and ``dtype`` (MXFP4 experts dequantized)."""
        if self.expert_format == "mxfp4":
            return mxfp4.dequantize(getattr(self, f"{name}_blocks")[...], getattr(self, f"{name}_scales")[...], dtype)
        return getattr(self, name)[...].astype(dtype)


class GptOssMoeBlock(SparseMoeBlock):
    """gpt-oss's MLP of one decoder layer: ``router`` (an ``nnx.Linear`` ``[H, E]`` with bias, HF ``mlp.router``)
    and ``experts`` (``GptOssExperts``, HF ``mlp.experts``). ``impl``: the grouped matmul (``models.moe``)."""

    def __init__(self, config: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs, init_std: float,
                 impl: str = "auto"):
        moe = config.moe
        self.num_experts_per_tok = moe.num_experts_per_tok
        self.norm_topk_prob = True
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit
        self.dtype = dtype
        self.impl = check_moe_impl(impl)
        self.capture_routing = False  # SparseMoeBlock's static hooks (models.moe_routing)
        self.expert_parallel = None  # one device: gpt-oss refuses tensor parallelism
        self.router = nnx.Linear(config.hidden_size, moe.num_experts, use_bias=True, dtype=dtype,
                                 param_dtype=param_dtype, kernel_init=nnx.initializers.normal(stddev=init_std),
                                 bias_init=nnx.initializers.zeros_init(), rngs=rngs)
        self.experts = GptOssExperts(moe.num_experts, config.hidden_size, moe.moe_intermediate_size,
                                     expert_format=moe.expert_format, param_dtype=param_dtype, rngs=rngs,
                                     init_std=init_std)

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [T, H]`` -> ``(weights float32[T, k], ids int32[T, k])``."""
        return route_top_k_softmax(self.router(x), self.num_experts_per_tok)

    def __call__(self, x: jax.Array, lora=None) -> jax.Array:
        """``x: [T, H]`` -> ``[T, H]``; LoRA adapters of the experts are refused as ``SparseMoeBlock`` does."""
        refuse_mlp_lora(lora)
        weights, ids = self.route(x)
        if self.capture_routing:
            self.sow(nnx.Intermediate, ROUTED_EXPERTS, ids)
        num_pairs, num_experts = ids.size, self.experts.gate_up_proj_bias.shape[0]
        if self.experts.expert_format == "mxfp4" and num_pairs < MATVEC_PAIRS_PER_EXPERT * num_experts:
            out = self._gathered(x, ids)
        else:
            out = self._grouped(x, ids)
        out = out.reshape(*ids.shape, x.shape[1]).astype(jnp.float32)
        return jnp.sum(out * weights[:, :, None], axis=1).astype(x.dtype)

    def _grouped(self, x: jax.Array, ids: jax.Array) -> jax.Array:
        """Every (token, slot) pair's expert output, ``float32[T * k, H]`` in pair order, by grouped matmuls over
        the pairs sorted by expert."""
        experts, dtype, top_k = self.experts, x.dtype, ids.shape[1]
        num_experts = experts.gate_up_proj_bias.shape[0]
        order, group_sizes = sort_by_expert(ids, num_experts)
        expert_of_row = ids.reshape(-1)[order]
        matmul = grouped_matmul_for(self.impl, ids.size, x.shape[1], dtype)
        gate_up = matmul(x, experts.weight("gate_up_proj", dtype), group_sizes, row_index=order // top_k)
        gate_up = gate_up.astype(jnp.float32) + experts.gate_up_proj_bias[...][expert_of_row].astype(jnp.float32)
        act = clamped_swiglu(gate_up, self.alpha, self.limit).astype(dtype)
        out = matmul(act, experts.weight("down_proj", dtype), group_sizes).astype(jnp.float32)
        out = out + experts.down_proj_bias[...][expert_of_row].astype(jnp.float32)
        return in_pair_order(out, order)

    def _gathered(self, x: jax.Array, ids: jax.Array) -> jax.Array:
        """``_grouped``'s result for MXFP4 experts, each pair multiplied by its own expert's packed weights
        (``mxfp4.matvec``: nothing dequantized to memory; for steps of few pairs)."""
        experts, top_k = self.experts, ids.shape[1]
        flat = ids.reshape(-1)
        rows = jnp.repeat(x, top_k, axis=0)  # pair t * k + j is token t

        def project(name: str, inputs: jax.Array) -> jax.Array:
            blocks, scales = getattr(experts, f"{name}_blocks")[...], getattr(experts, f"{name}_scales")[...]
            bias = getattr(experts, f"{name}_bias")[...][flat].astype(jnp.float32)
            return mxfp4.matvec(inputs, blocks[flat], scales[flat]) + bias

        act = clamped_swiglu(project("gate_up_proj", rows), self.alpha, self.limit).astype(x.dtype)
        return project("down_proj", act)
