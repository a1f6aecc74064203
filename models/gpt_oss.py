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
and reach the grouped matmuls over the sorted rows (``experts_grouped``) as ``mxfp4.Mxfp4Experts``: the fused MoE
kernel decodes each tile it reads, the XLA reference dequantizes the layer's experts inside the step. ``mxfp4_form``
picks, per step, how the experts run: each (token, expert) pair through its own packed bytes (``experts_gathered``,
``mxfp4.matvec``) below one pair per expert, the grouped matmuls on the packed experts up to
``PACKED_MAX_PAIRS_PER_EXPERT``, and beyond that (``"auto"`` on the kernel) the layer's experts decoded to the model
dtype for the float kernel, whose wider tiles then outrun the packed kernel's per-tile decoding
(``benchmarks.moe_kernel --weights mxfp4`` times the forms). The gate/up matmul
writes the interleaved pre-activations; the biases and the clamped SwiGLU run in XLA around the grouped matmuls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.dense import dense_linear
from models.moe import (ROUTED_EXPERTS, SparseMoeBlock, check_moe_impl, grouped_matmul_for, in_pair_order,
                        refuse_mlp_lora, resolve_moe_impl, sort_by_expert)
from models.quantization import mxfp4

# Expert parameters stored under their own names in the checkpoint, in model layout (the loader reads them as is).
EXPERT_PARAMS = {
    None: ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
    "mxfp4": ("gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias", "down_proj_blocks",
              "down_proj_scales", "down_proj_bias"),
}
CHECKPOINT_LEAVES = frozenset(name for names in EXPERT_PARAMS.values() for name in names) | {"sinks"}
# ``mxfp4_form``'s bounds, in (token, expert) pairs per expert: below the first each pair multiplies its expert's
# packed bytes; past the second ``"auto"`` dequantizes the layer's experts for the float kernel.
MATVEC_PAIRS_PER_EXPERT = 1
PACKED_MAX_PAIRS_PER_EXPERT = 256


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

    def operands(self, dtype) -> tuple:
        """``(gate_up, gate_up_bias, down, down_bias)`` as ``experts_grouped`` takes them: the weights in model layout
        ``[E, in, out]`` cast to ``dtype``, or ``mxfp4.Mxfp4Experts`` (packed, as stored)."""
        def weight(name):
            if self.expert_format == "mxfp4":
                return mxfp4.Mxfp4Experts(getattr(self, f"{name}_blocks")[...], getattr(self, f"{name}_scales")[...])
            return getattr(self, name)[...].astype(dtype)

        return weight("gate_up_proj"), self.gate_up_proj_bias[...], weight("down_proj"), self.down_proj_bias[...]

    @property
    def width_dims(self) -> tuple:
        """Each operand's expert-width dim (``I`` or the interleaved ``2I``; None: the down bias has none), for
        splitting the width over devices (``ExpertParallel.weight_spec``): a contiguous slice of the interleaved
        gate/up columns keeps each gate next to its up; MXFP4 blocks and scales split along the same dim."""
        return (1, 1, 2, None) if self.expert_format == "mxfp4" else (2, 1, 1, None)


class GptOssMoeBlock(SparseMoeBlock):
    """gpt-oss's MLP of one decoder layer: ``router`` (an ``nnx.Linear`` ``[H, E]`` with bias, HF ``mlp.router``)
    and ``experts`` (``GptOssExperts``, HF ``mlp.experts``). ``impl``: the grouped matmul (``models.moe``);
    ``expert_parallel``: None, or what runs each device's share of the experts (whole experts, or a slice of every
    expert's width) and sums them over the devices (``paged_jax.parallel.expert_parallel.ExpertParallel``)."""

    def __init__(self, config: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs, init_std: float,
                 impl: str = "auto"):
        moe = config.moe
        self.num_experts_per_tok = moe.num_experts_per_tok
        self.norm_topk_prob = True
        self.alpha, self.limit = moe.swiglu_alpha, moe.swiglu_limit
        self.dtype = dtype
        self.impl = check_moe_impl(impl)
        self.capture_routing = False  # SparseMoeBlock's static hooks (models.moe_routing)
        self.expert_parallel = None  # or experts over devices: paged_jax.parallel.ExpertParallel
        self.router = dense_linear(config.hidden_size, moe.num_experts, use_bias=True, dtype=dtype,
                                   param_dtype=param_dtype, init_std=init_std, rngs=rngs)
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
        operands = self.experts.operands(x.dtype)
        local = functools.partial(gpt_oss_experts, self.impl, self.alpha, self.limit)
        split = self.expert_parallel
        if split is None:
            return local(x, weights, ids, *operands).astype(x.dtype)
        if split.whole_experts:
            out = split.partial_sums(local, (x, weights, ids), operands, self.experts.width_dims)
            return out.astype(x.dtype)
        # Each device holds a slice of every expert's width: its down projections are partial sums, the down bias
        # joins once, after the sum.
        *sliced, down_bias = operands
        out = split.partial_sums(lambda x, w, i, gate_up, gate_up_bias, down, first: local(
            x, w, i, gate_up, gate_up_bias, down, None, first), (x, weights, ids), tuple(sliced),
            self.experts.width_dims[:3])
        return (out + combine_top_k(down_bias[ids.reshape(-1)].astype(jnp.float32), weights)).astype(x.dtype)


def gpt_oss_experts(requested_impl: str, alpha: float, limit: float, x: jax.Array, weights: jax.Array,
                    ids: jax.Array, gate_up, gate_up_bias: jax.Array, down, down_bias: jax.Array | None,
                    first_expert: jax.Array | None = None) -> jax.Array:
    """The weighted sum of each token's experts, in the form ``mxfp4_form`` picks (``experts_gathered`` or
    ``experts_grouped``).

    Args:
      requested_impl: the block's ``moe_impl``; alpha, limit: the clamped SwiGLU's.
      x: ``dtype[T, H]``; weights: ``float32[T, k]``; ids: ``int32[T, k]`` global expert ids.
      gate_up, gate_up_bias, down, down_bias: ``GptOssExperts.operands``: every expert (``first_expert`` None),
        or one device's part: experts ``first_expert + e`` whole, or a width slice of every expert (``first_expert``
        0, ``down_bias`` None: added after the devices' sum).
    Returns:
      ``float32[T, H]``; with ``first_expert`` the sum over the device's experts only, zero for a token with none
      (``ExpertParallel.partial_sums`` adds the devices' sums).
    """
    num_local = gate_up_bias.shape[0]
    if first_expert is not None:  # other devices' experts: an out-of-range id (in no group), weight 0
        ids = ids - first_expert
        is_local = (ids >= 0) & (ids < num_local)
        ids = jnp.where(is_local, ids, num_local)
        weights = jnp.where(is_local, weights, 0.0)
    if down_bias is None:
        down_bias = jnp.zeros((num_local, x.shape[1]), jnp.float32)
    impl = resolve_moe_impl(requested_impl, ids.size, x.shape[1], x.dtype)
    form = (mxfp4_form(requested_impl, impl, ids.size, num_local)
            if isinstance(gate_up, mxfp4.Mxfp4Experts) else "float")
    if form == "matvec":
        out = experts_gathered(x, ids, gate_up, gate_up_bias, down, down_bias, alpha=alpha, limit=limit)
    else:
        if form == "dequantized":
            gate_up, down = gate_up.dequantize(x.dtype), down.dequantize(x.dtype)
        matmul = grouped_matmul_for(impl, ids.size, x.shape[1], x.dtype)
        out = experts_grouped(matmul, x, ids, gate_up, gate_up_bias, down, down_bias, alpha=alpha, limit=limit)
    if first_expert is not None:  # rows of other devices' experts: zero, whatever a kernel or gather left there
        out = jnp.where((ids < num_local).reshape(-1, 1), out, 0.0)
    return combine_top_k(out, weights)


def mxfp4_form(requested_impl: str, impl: str, num_pairs: int, num_experts: int) -> str:
    """How a step of ``num_pairs`` (token, expert) pairs runs ``num_experts`` MXFP4 experts, for the ``moe_impl``
    asked for and the one it resolved to: "matvec" (``experts_gathered``), "packed" (the grouped matmuls on the packed
    experts) or "dequantized" (the layer's experts decoded to the model dtype, then the float kernel). An explicit
    ``"pallas"`` keeps the kernel on the packed experts at every size."""
    if requested_impl == "pallas":
        return "packed"
    if num_pairs < MATVEC_PAIRS_PER_EXPERT * num_experts:
        return "matvec"
    if impl == "pallas" and num_pairs > PACKED_MAX_PAIRS_PER_EXPERT * num_experts:
        return "dequantized"
    return "packed"


def experts_grouped(matmul, x: jax.Array, ids: jax.Array, gate_up, gate_up_bias: jax.Array, down,
                    down_bias: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """Every (token, slot) pair's expert output by grouped matmuls over the pairs sorted by expert.

    Args:
      matmul: the grouped matmul (``models.moe.grouped_matmul_reference``'s contract: the reference, the kernel).
      x: ``dtype[T, H]``; ids: ``int32[T, k]``.
      gate_up: ``[E, H, 2I]`` (gate and up interleaved) of ``x``'s dtype, or ``mxfp4.Mxfp4Experts`` of that shape;
        down: ``[E, I, H]`` likewise; the biases ``[E, 2I]`` / ``[E, H]``.
    Returns:
      ``float32[T * k, H]`` in pair order (pair ``t * k + j``).
    """
    dtype, top_k, num_experts = x.dtype, ids.shape[1], gate_up_bias.shape[0]
    order, group_sizes = sort_by_expert(ids, num_experts)
    expert_of_row = ids.reshape(-1)[order]
    pre = matmul(x, gate_up, group_sizes, row_index=order // top_k)
    pre = pre.astype(jnp.float32) + gate_up_bias[expert_of_row].astype(jnp.float32)
    act = clamped_swiglu(pre, alpha, limit).astype(dtype)
    out = matmul(act, down, group_sizes).astype(jnp.float32) + down_bias[expert_of_row].astype(jnp.float32)
    return in_pair_order(out, order)


def experts_gathered(x: jax.Array, ids: jax.Array, gate_up: mxfp4.Mxfp4Experts, gate_up_bias: jax.Array,
                     down: mxfp4.Mxfp4Experts, down_bias: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """``experts_grouped``'s result for MXFP4 experts, each pair multiplied by its own expert's packed weights
    (``mxfp4.matvec``: nothing dequantized to memory; for steps of few pairs). Same arguments and result."""
    top_k, flat = ids.shape[1], ids.reshape(-1)
    rows = jnp.repeat(x, top_k, axis=0)  # pair t * k + j is token t

    def project(weight: mxfp4.Mxfp4Experts, bias: jax.Array, inputs: jax.Array) -> jax.Array:
        return mxfp4.matvec(inputs, weight.blocks[flat], weight.scales[flat]) + bias[flat].astype(jnp.float32)

    act = clamped_swiglu(project(gate_up, gate_up_bias, rows), alpha, limit).astype(x.dtype)
    return project(down, down_bias, act)


def combine_top_k(out: jax.Array, weights: jax.Array) -> jax.Array:
    """``out float32[T * k, H]`` (pair order), ``weights float32[T, k]`` -> ``float32[T, H]``: the weighted sum."""
    out = out.reshape(*weights.shape, out.shape[-1])
    return jnp.sum(out * weights[:, :, None], axis=1)
