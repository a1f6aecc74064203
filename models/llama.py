"""One Flax NNX decoder for the Llama family and its relatives: Llama 2/3/3.1, Mistral, Qwen2 (q/k/v bias), Qwen3
(q/k norm), Gemma 2 / Gemma 3 (per-layer windows and RoPE, soft-capping, (1 + w) norms around each block, scaled
embeddings, GELU), Phi-3 / Phi-4 (LongRoPE, partial rotary; fused checkpoint projections split by the loader),
Granite (multipliers), and with sparse expert MLPs (``models.moe``, by ``ModelConfig.moe``) Qwen3-MoE and Mixtral,
and gpt-oss (attention sinks, its experts in ``models.gpt_oss``), Llama 4's text model (chunked and NoPE layers,
interleaved RoPE, weightless q/k norm, attention temperature; its experts in ``models.llama4``, its MLPs named
``feed_forward`` in the checkpoint) and DeepSeek-V2 / V3 (latent attention in ``models.mla``, their routing and
shared experts in ``models.deepseek``).
Each difference is a ``ModelConfig`` field read by the one decoder below.

The model runs on a flat (ragged) token batch: ``input_ids`` and ``positions`` are ``int32[T]`` with no batch
dimension; which token attends to which is entirely the business of the ``AttentionFn`` passed in (see
``models.attention``), so the same weights serve dense tests, paged prefill and decode.

Parameter paths mirror Hugging Face names so the loader maps them mechanically:
``model.layers[i].self_attn.q_proj.kernel`` <- ``model.layers.{i}.self_attn.q_proj.weight`` (transposed),
``*.scale`` <- RMSNorm ``*.weight``, ``model.embed_tokens.embedding`` <- ``model.embed_tokens.weight``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

# The attention contract lives in models.attention_fn; re-exported for existing importers.
from models.attention_fn import (AttentionFn, LayerAttention, ReusableAttention,  # noqa: F401
                                 check_takes_attention_sinks, check_takes_layer_attention, needs_layer_attention)
from models.config import ModelConfig
from models.deepseek import DeepseekMoeBlock
from models.dense import INIT_STD, dense_linear
from models.gpt_oss import GptOssMoeBlock
from models.mla import MlaAttention
from models.llama4 import Llama4MoeBlock
from models.moe import SparseMoeBlock, set_moe_impl
from models.norm import RMSNorm, check_rms_norm_impl
# RoPE lives in models.qk_transform (with the rest of the q/k transform); re-exported for existing importers.
from models.qk_transform import (QKTransform, apply_qk_transform, apply_rope, rope_cos_sin,  # noqa: F401
                                 rope_inv_freq, rope_table_index, rope_tables)

def _normal_init(std: float = INIT_STD):
    return nnx.initializers.normal(stddev=std)


def _linear(in_features: int, out_features: int, *, use_bias: bool, dtype, param_dtype, rngs: nnx.Rngs):
    return dense_linear(in_features, out_features, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                        rngs=rngs)


def _concat_linear(layers: Sequence[nnx.Module]) -> nnx.Module | None:
    """One ``nnx.Linear`` equal to ``layers`` side by side (kernels and biases concatenated along the outputs), so
    the inputs they share are multiplied once. Left separate, XLA's dot merger may build that same concatenation at
    run time, i.e. copy the weights on every call. Other projection modules (``models.quantization``) concatenate
    themselves (``type.concat``); None: they cannot share one matmul and stay separate."""
    first = layers[0]
    if not all(type(layer) is nnx.Linear for layer in layers):
        same_type = all(type(layer) is type(first) for layer in layers)
        return type(first).concat(layers) if same_type and hasattr(type(first), "concat") else None
    kernel = jnp.concatenate([layer.kernel[...] for layer in layers], axis=1)
    has_bias = [layer.bias is not None for layer in layers]
    if any(has_bias) and not all(has_bias):
        raise ValueError("fused layers must all have a bias or none")
    bias = jnp.concatenate([layer.bias[...] for layer in layers]) if all(has_bias) else None
    return dense_linear(kernel.shape[0], kernel.shape[1], use_bias=bias is not None, dtype=first.dtype,
                        param_dtype=kernel.dtype, precision=first.precision,
                        kernel_init=lambda *_: kernel, bias_init=lambda *_: bias, rngs=nnx.Rngs(0))


class Attention(nnx.Module):
    """Projections, optional q/k norm and RoPE around an external ``AttentionFn``.

    q/k/v projections are either three ``nnx.Linear`` (``q_proj``/``k_proj``/``v_proj``, the HF layout, as loaded)
    or, after ``fuse_projections``, one ``qkv_proj`` (an ``nnx.Linear``) whose output columns are [q | k | v].
    """

    def __init__(self, config: ModelConfig, layer_idx: int = 0, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden, q_dim, kv_dim = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.attention_bias
        self.q_proj = _linear(hidden, q_dim, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.k_proj = _linear(hidden, kv_dim, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.v_proj = _linear(hidden, kv_dim, use_bias=bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.qkv_proj: nnx.Linear | None = nnx.data(None)  # set by fuse_projections (a data slot, not static)
        # FP8 KV cache with per-layer scales: float32[2] = (k_scale, v_scale), set by models.quantization.load.
        self.kv_scale: nnx.Param | None = nnx.data(None)
        self.o_proj = _linear(q_dim, hidden, use_bias=config.o_proj_bias, dtype=dtype, param_dtype=param_dtype,
                              rngs=rngs)
        # gpt-oss: one learned logit per query head in the softmax's denominator ([Hq], HF ``self_attn.sinks``).
        self.sinks = nnx.data(nnx.Param(_normal_init()(rngs.params(), (self.num_heads,), param_dtype))
                              if config.attention_sinks else None)
        if config.qk_norm:
            # Per head ([T, H, D]), applied through the layer's QKTransform: the jnp form (apply_qk_transform), or
            # fused with RoPE and the KV write by an attention that fuses it (paged_jax.ops.qk_prepare).
            # These modules hold the weights (HF names) and eps; they are never called themselves.
            self.q_norm, self.k_norm = (
                RMSNorm(self.head_dim, eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype,
                        unit_offset=config.norm_unit_offset) for _ in range(2))
        else:
            self.q_norm = None
            self.k_norm = None
        # Static per-layer choices: which RoPE table (Gemma 3's sliding layers have their own; None: a NoPE layer),
        # and the layer's attention options, passed only when some layer of the model differs from the attention's
        # defaults. Llama 4: interleaved RoPE, the weightless q/k norm (eps, dtype) of its RoPE layers, its NoPE
        # layers' temperature (the last of the forward's rope tables).
        self.rope_table = None if layer_idx in config.nope_layers else rope_table_index(config, layer_idx)
        self.rope_interleaved = config.rope_interleaved
        self.l2_norm = (config.rms_norm_eps, dtype) if config.qk_l2_norm and self.rope_table is not None else None
        self.temperature = config.attn_temperature is not None and self.rope_table is None
        self.layer_attention = LayerAttention.for_layer(config, layer_idx) if needs_layer_attention(config) else None

    def __call__(self, layer_idx: int, x: jax.Array, rope: tuple, kv_layer, attention: AttentionFn, lora=None):
        """x: [T, hidden], rope: ``rope_tables`` -> ([T, hidden], kv_layer). ``lora``: see ``with_lora``."""
        return self.attend(layer_idx, *self.project(x, lora), rope, kv_layer, attention, lora)

    def project(self, x: jax.Array, lora=None) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [T, hidden] -> (q [T, Hq * D], k [T, Hkv * D], v [T, Hkv * D]), LoRA updates included."""
        if self.qkv_proj is not None:
            return self.split_qkv(with_lora(lora, "qkv_proj", x, self.qkv_proj(x)))
        return tuple(with_lora(lora, name, x, getattr(self, name)(x)) for name in ("q_proj", "k_proj", "v_proj"))

    def split_qkv(self, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The fused projection's output [T, (Hq + 2 Hkv) * D] -> (q, k, v) as ``project`` returns them."""
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return tuple(jnp.split(qkv, [q_dim, q_dim + kv_dim], axis=-1))

    def attend(self, layer_idx: int, q: jax.Array, k: jax.Array, v: jax.Array, rope: tuple, kv_layer,
               attention: AttentionFn, lora=None):
        """``project``'s (q, k, v) and the forward's ``rope_tables`` -> ([T, hidden], kv_layer): the q/k transform,
        ``attention`` (with the layer's own options, if the model has them) and ``o_proj``."""
        num_tokens = q.shape[0]
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        options = {} if self.layer_attention is None else self.layer_attention.as_kwargs()
        if self.sinks is not None:
            options["sinks"] = self.sinks[...]
        transform = self.qk_transform(rope)
        if getattr(attention, "fuses_qk_transform", False):  # e.g. one kernel with the KV write (paged_jax.ops)
            out, kv_layer = attention(layer_idx, q, k, v, kv_layer, qk_transform=transform, **options)
        else:
            q, k, v = apply_qk_transform(transform, q, k, v)
            out, kv_layer = attention(layer_idx, q, k, v, kv_layer, **options)
        if self.kv_scale is not None:
            # The cache holds k / k_scale and v / v_scale (apply_qk_transform): rescale the output by v_scale.
            out = (out * self.kv_scale[1]).astype(out.dtype)
        out = out.reshape(num_tokens, self.num_heads * self.head_dim)
        return with_lora(lora, "o_proj", out, self.o_proj(out)), kv_layer

    def qk_transform(self, rope: tuple) -> QKTransform:
        """The layer's ``QKTransform`` from the forward's ``rope_tables``."""
        cos, sin = (None, None) if self.rope_table is None else rope[self.rope_table]
        transform = QKTransform(
            cos=cos, sin=sin,
            q_norm_weight=None if self.q_norm is None else self.q_norm.scale[...],
            k_norm_weight=None if self.k_norm is None else self.k_norm.scale[...],
            kv_scale=None if self.kv_scale is None else self.kv_scale[...],
            norm_eps=None if self.q_norm is None else self.q_norm.eps,
            dtype=None if self.q_norm is None else self.q_norm.dtype,
            norm_unit_offset=self.q_norm is not None and self.q_norm.unit_offset,
            q_scale=rope[-1] if self.temperature else None, rope_interleaved=self.rope_interleaved)
        if self.l2_norm is not None:  # Llama 4's weightless norm: a weight of ones
            eps, dtype = self.l2_norm
            ones = jnp.ones((self.head_dim,), dtype)
            transform = dataclasses.replace(transform, q_norm_weight=ones, k_norm_weight=ones, norm_eps=eps,
                                            dtype=dtype)
        return transform


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True)}


class MLP(nnx.Module):
    """Gated MLP: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or tanh-approximated GELU (Gemma's GeGLU;
    ``ModelConfig.hidden_act``); gate and up either separate (as loaded) or, after ``fuse_projections``, one
    ``gate_up_proj`` whose output columns are [gate | up]. ``intermediate_size``: None for the config's (DeepSeek's
    shared experts are narrower)."""

    def __init__(self, config: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs,
                 intermediate_size: int | None = None):
        hidden = config.hidden_size
        inter = config.intermediate_size if intermediate_size is None else intermediate_size
        self.hidden_act = config.hidden_act
        self.gate_proj = _linear(hidden, inter, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.up_proj = _linear(hidden, inter, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.gate_up_proj: nnx.Linear | None = nnx.data(None)  # set by fuse_projections
        self.down_proj = _linear(inter, hidden, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, lora=None) -> jax.Array:
        """x: [T, hidden] -> [T, hidden]."""
        if self.gate_up_proj is not None:
            return self.down(with_lora(lora, "gate_up_proj", x, self.gate_up_proj(x)), lora)
        gate, up = (with_lora(lora, name, x, getattr(self, name)(x)) for name in ("gate_proj", "up_proj"))
        act = _ACTIVATIONS[self.hidden_act](gate) * up
        return with_lora(lora, "down_proj", act, self.down_proj(act))

    def down(self, gate_up: jax.Array, lora=None) -> jax.Array:
        """The fused projection's output [T, 2 * inter] = [gate | up] -> ``down_proj(act(gate) * up)`` [T, hidden]:
        one kernel when ``down_proj`` has a fused form for the shape (``silu_mul_matmul``, e.g. the FP8 GEMV), the
        activation is SiLU and no LoRA update reads the activation."""
        fused = getattr(self.down_proj, "silu_mul_matmul", None)
        if fused is not None and lora is None and self.hidden_act == "silu":
            out = fused(gate_up)
            if out is not None:
                return out
        gate, up = jnp.split(gate_up, 2, axis=-1)
        act = _ACTIVATIONS[self.hidden_act](gate) * up
        return with_lora(lora, "down_proj", act, self.down_proj(act))


class DecoderLayer(nnx.Module):
    """One decoder layer in vLLM's form: the residual stream travels beside the hidden state, so each residual add
    is fused into the RMSNorm after it (``RMSNorm.__call__(x, residual)``). ``mlp`` is the dense ``MLP``, or for a
    sparse layer of a mixture-of-experts model (``MoeConfig.is_sparse(layer_idx)``) a ``SparseMoeBlock``, for gpt-oss
    (``MoeConfig.swiglu_limit`` set) its ``models.gpt_oss.GptOssMoeBlock``, for Llama 4 (``MoeConfig.router``
    "sigmoid_input") its ``models.llama4.Llama4MoeBlock`` with a dense ``MLP`` as the shared expert.

    Gemma (``sandwich_norms``): ``post_attention_layernorm`` norms the attention output before its residual add,
    ``pre_feedforward_layernorm`` is the norm fused with that add, ``post_feedforward_layernorm`` norms the MLP
    output. Granite's ``residual_multiplier`` scales each block's output before its add (float32 math, as torch's
    tensor-times-scalar)."""

    def __init__(self, config: ModelConfig, layer_idx: int = 0, *, dtype, param_dtype, rngs: nnx.Rngs):
        norm = functools.partial(RMSNorm, config.hidden_size, eps=config.rms_norm_eps, dtype=dtype,
                                 param_dtype=param_dtype, unit_offset=config.norm_unit_offset)
        self.input_layernorm = norm()
        attention = MlaAttention if config.mla is not None else Attention
        self.self_attn = attention(config, layer_idx, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.post_attention_layernorm = norm()
        if config.moe is not None and config.moe.swiglu_limit is not None:
            self.mlp = GptOssMoeBlock(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, init_std=INIT_STD)
        elif config.mla is not None and config.moe.is_sparse(layer_idx):
            shared = config.moe.n_shared_experts * config.moe.moe_intermediate_size
            self.mlp = DeepseekMoeBlock(
                config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, init_std=INIT_STD,
                shared_experts=MLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                                   intermediate_size=shared) if shared else None)
        elif config.moe is not None and config.moe.router == "sigmoid_input" and config.moe.is_sparse(layer_idx):
            shared = dataclasses.replace(config, intermediate_size=config.moe.shared_expert_intermediate_size)
            self.mlp = Llama4MoeBlock(config, MLP(shared, dtype=dtype, param_dtype=param_dtype, rngs=rngs),
                                      dtype=dtype, param_dtype=param_dtype, rngs=rngs, init_std=INIT_STD)
        elif config.moe is not None and config.moe.is_sparse(layer_idx):
            self.mlp = SparseMoeBlock(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, init_std=INIT_STD)
        else:
            self.mlp = MLP(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        sandwich = config.sandwich_norms
        self.pre_feedforward_layernorm = nnx.data(norm() if sandwich else None)
        self.post_feedforward_layernorm = nnx.data(norm() if sandwich else None)
        self.residual_multiplier = config.residual_multiplier

    def norms(self) -> list[RMSNorm]:
        """The layer's hidden-size norms (Gemma's four, else two)."""
        return [norm for norm in (self.input_layernorm, self.post_attention_layernorm,
                                  self.pre_feedforward_layernorm, self.post_feedforward_layernorm) if norm is not None]

    def __call__(self, layer_idx, x, residual, rope, kv_layer, attention, lora=None):
        """x: [T, hidden], the previous layer's MLP output (the embedding for the first layer); residual: [T,
        hidden], the residual stream that x is still to be added to, or None for the first layer; rope: the
        forward's ``rope_tables``. -> (mlp_out [T, hidden], residual [T, hidden], kv_layer); the layer's output is
        ``mlp_out + residual``, added by the next norm (the same sums, in the same order, as adding at the end of
        each block)."""
        attn, mlp = self.self_attn, self.mlp
        if residual is None:
            residual = x
            q, k, v = attn.project(self.input_layernorm(x), lora)
        elif attn.qkv_proj is not None:
            qkv, residual = norm_then_project(self.input_layernorm, attn.qkv_proj, "qkv_proj", x, residual, lora)
            q, k, v = attn.split_qkv(qkv)
        else:
            hidden, residual = self.input_layernorm(x, residual)
            q, k, v = attn.project(hidden, lora)
        attn_out, kv_layer = attn.attend(layer_idx, q, k, v, rope, kv_layer, attention, lora)
        ffn_norm = self.post_attention_layernorm
        if self.pre_feedforward_layernorm is not None:
            attn_out, ffn_norm = self.post_attention_layernorm(attn_out), self.pre_feedforward_layernorm
        attn_out = self._scale_block_output(attn_out)
        if not isinstance(mlp, MLP) or mlp.gate_up_proj is None:
            hidden, residual = ffn_norm(attn_out, residual)
            out = mlp(hidden, lora)
        else:
            gate_up, residual = norm_then_project(ffn_norm, mlp.gate_up_proj, "gate_up_proj", attn_out, residual, lora)
            out = mlp.down(gate_up, lora)
        if self.post_feedforward_layernorm is not None:
            out = self.post_feedforward_layernorm(out)
        return self._scale_block_output(out), residual, kv_layer

    def _scale_block_output(self, x: jax.Array) -> jax.Array:
        if self.residual_multiplier is None:
            return x
        return (x.astype(jnp.float32) * self.residual_multiplier).astype(x.dtype)


def norm_then_project(norm: RMSNorm, proj, name: str, x: jax.Array, residual: jax.Array, lora=None):
    """``(with_lora(lora, name, h, proj(h)), new_residual)`` for ``h, new_residual = norm(x, residual)`` (x, residual:
    [T, in]): one kernel when ``proj`` has a fused form for the shape (``rms_norm_matmul``, e.g. the FP8 GEMV), the
    norm itself runs as a kernel (``RMSNorm.runs_kernel``: not on a mesh or under XLA) and no LoRA update reads
    ``h`` (the fused forms implement Llama's norm, not Gemma's unit offset); the norm, then the projection,
    otherwise."""
    fused = getattr(proj, "rms_norm_matmul", None)
    if fused is not None and lora is None and not norm.unit_offset and norm.runs_kernel(x):
        out = fused(x, residual, norm.scale[...], eps=norm.eps, norm_dtype=norm.dtype)
        if out is not None:
            return out
    hidden, residual = norm(x, residual)
    return with_lora(lora, name, hidden, proj(hidden)), residual


def with_lora(lora, name: str, x: jax.Array, y: jax.Array) -> jax.Array:
    """The LoRA hook of one projection: ``y = proj(x)`` plus the layer's low-rank update of projection ``name``
    (e.g. "qkv_proj", "o_proj") when ``lora`` (duck-typed ``lora.add(name, x, y)``, e.g.
    ``paged_jax.lora.layers.LoRALayer``) is given; ``y`` itself when ``lora`` is None."""
    return y if lora is None else lora.add(name, x, y)


@functools.partial(jax.jit, static_argnums=0)
def _decoder_layer(graphdef, state, x, residual, rope, kv_layer, attention: ReusableAttention, lora=None):
    """One decoder layer as its own jitted function, so equal layers share one trace (see ``ReusableAttention``;
    ``run_decoder_layers`` hands the first layer a zero residual so that it shares it too)."""
    return nnx.merge(graphdef, state)(None, x, residual, rope, kv_layer, attention, lora)


def run_decoder_layers(layers, x, residual, rope, kv_caches, attention: AttentionFn, lora=None, *,
                       first_layer_idx: int = 0):
    """Run ``layers`` (a sequence of ``DecoderLayer``) on ``(x, residual)`` (``residual`` None: ``x`` is the
    embedding). ``kv_caches``: per layer its kv state (a list, or a container with ``copy()`` whose item
    assignment a later layer reads back: layers sharing a state), or None; ``lora``: per layer or None. A
    ``ReusableAttention`` runs each layer through the nested jit ``_decoder_layer``, other attentions inline.
    Returns ``(x, residual, new kv states: as kv_caches)``; the hidden state is ``x + residual`` (the final norm
    adds it)."""
    if kv_caches is not None:
        kv_caches = list(kv_caches) if isinstance(kv_caches, (list, tuple)) else kv_caches.copy()
    reusable = isinstance(attention, ReusableAttention)
    if reusable and residual is None and len(layers) > 1:
        # x + 0 == x exactly, so the first layer can take the same (x, residual) form as the others: one trace for
        # every layer (a fill kernel per step) instead of a second trace of the layer per step shape at start-up.
        residual = jnp.zeros_like(x)
    for j, layer in enumerate(layers):
        kv_layer = None if kv_caches is None else kv_caches[j]
        lora_layer = None if lora is None else lora[j]
        if reusable:  # one trace for all layers (same structure, same shapes)
            graphdef, state = nnx.split(layer)
            x, residual, kv_layer = _decoder_layer(graphdef, state, x, residual, rope, kv_layer, attention,
                                                   lora_layer)
        else:
            x, residual, kv_layer = layer(first_layer_idx + j, x, residual, rope, kv_layer, attention, lora_layer)
        if kv_caches is not None:
            kv_caches[j] = kv_layer
    return x, residual, kv_caches


class LlamaModel(nnx.Module):
    """Embedding, decoder layers (a plain list, unrolled under jit) and the final norm."""

    def __init__(self, config: ModelConfig, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype,
            embedding_init=_normal_init(), rngs=rngs,
        )
        self.embedding_multiplier = config.embedding_multiplier
        self.layers = nnx.List(
            [DecoderLayer(config, i, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
             for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype,
                            unit_offset=config.norm_unit_offset)

    def embed(self, input_ids: jax.Array) -> jax.Array:
        """int32[T] -> [T, hidden]: ``scale_embedding`` of the embedding rows."""
        return scale_embedding(self.embedding_multiplier, self.embed_tokens(input_ids))


def scale_embedding(multiplier: float | None, x: jax.Array) -> jax.Array:
    """Embedding rows [T, hidden] times ``ModelConfig.embedding_multiplier`` (Gemma's sqrt(hidden), Granite's),
    rounded to the compute dtype first as transformers multiplies by a tensor of that dtype; ``x`` for None."""
    return x if multiplier is None else x * jnp.asarray(multiplier, x.dtype)


def matmul_precision(dtype):
    """Context for tracing a model of compute ``dtype``: float32 models run every matmul at full precision (on GPUs
    JAX's default for float32 operands is TF32, which changes greedy tokens against a float32 reference); other
    dtypes keep the caller's setting."""
    if jnp.dtype(dtype) == jnp.float32:
        return jax.default_matmul_precision("highest")
    return contextlib.nullcontext()


class LlamaForCausalLM(nnx.Module):
    """Decoder-only LM for the architectures of ``models.config.SUPPORTED_ARCHITECTURES`` (Llama 2/3/3.1, Mistral,
    Qwen2, Qwen3, Gemma 2, Gemma 3 text, Phi-3 / Phi-4, Granite), and the base of the mixture-of-experts ones
    (``models.architectures``).

    Args:
      config: the model shape.
      dtype: compute dtype (activations), default bfloat16.
      param_dtype: storage dtype of the weights; defaults to ``dtype``.
      rngs: initializer randomness (weights ~ N(0, 0.02), norms = 1, biases = 0).
      rms_norm_impl: the decoder norms' implementation (``models.norm.RMS_NORM_IMPLS``; see ``set_rms_norm_impl``).
      moe_impl: the sparse layers' grouped matmuls (``models.moe.MOE_IMPLS``; see ``models.moe.set_moe_impl``).
    """

    def __init__(self, config: ModelConfig, *, dtype=jnp.bfloat16, param_dtype=None, rngs: nnx.Rngs,
                 rms_norm_impl: str = "auto", moe_impl: str = "auto"):
        param_dtype = dtype if param_dtype is None else param_dtype
        self.config = config
        self.dtype = dtype
        self.model = LlamaModel(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        if config.tie_word_embeddings or config.head != "lm_head":  # other heads: models.architectures
            self.lm_head = None
        else:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype,
                                   param_dtype=param_dtype, rngs=rngs)
        # The LM head's matmul, ``jax.lax.dot_general``'s signature (nnx.Linear's ``dot_general`` for the head,
        # which reads its weight itself): a static choice, replaced before tracing (batch-invariant mode).
        self.logits_dot_general = jax.lax.dot_general
        set_rms_norm_impl(self, rms_norm_impl)
        set_moe_impl(self, moe_impl)

    def __call__(self, input_ids: jax.Array, positions: jax.Array, kv_caches: list | None,
                 attention: AttentionFn, lora: Sequence | None = None, *,
                 aux_hidden_layers: tuple[int, ...] = ()) -> tuple:
        """Run the decoder on a flat token batch.

        Args:
          input_ids: int32[T] token ids.
          positions: int32[T] position of each token within its own sequence (drives RoPE).
          kv_caches: per-layer KV state handed to ``attention`` (``kv_caches[i]`` for layer i), or None.
          attention: ``AttentionFn``; decides which tokens see which (segments, pages, windows). A model whose layers
            attend differently (``models.attention_fn.needs_layer_attention``) needs one that takes each layer's
            options (``takes_layer_attention``): ValueError otherwise.
          lora: None, or per layer the LoRA state its projections add (``with_lora``; multi-LoRA serving).
          aux_hidden_layers: static; non-empty (ascending layer indices >= 1, an EAGLE-3 drafter's feature layers,
            ``models.eagle3``): also return the residual stream entering each of these layers.
        Returns:
          (hidden: dtype[T, hidden_size] after the final norm, kv_caches: list of the layers' returned kv state,
          or None when ``kv_caches`` was None), and with ``aux_hidden_layers`` a third item: dtype[T, n * hidden].
        """
        if input_ids.ndim != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must both be [T]; got {input_ids.shape} and {positions.shape}"
            )
        with matmul_precision(self.dtype):
            if aux_hidden_layers:
                return self._forward_with_aux(input_ids, positions, kv_caches, attention, lora, aux_hidden_layers)
            return self._forward(input_ids, positions, kv_caches, attention, lora)

    def _forward_with_aux(self, input_ids, positions, kv_caches, attention, lora, aux_hidden_layers):
        """``_forward`` run in segments split at ``aux_hidden_layers``, keeping each boundary's ``x + residual``."""
        layers = list(self.model.layers)
        if kv_caches is not None and not isinstance(kv_caches, (list, tuple)):
            raise ValueError("aux_hidden_layers needs a per-layer kv_caches list (no KV-cache groups)")
        check_takes_layer_attention(self.config, attention)
        rope = rope_tables(self.config, positions)
        x, residual, aux, new_kv_caches = self.model.embed(input_ids), None, [], []
        bounds = [0, *aux_hidden_layers, len(layers)]
        for start, end in zip(bounds, bounds[1:]):
            if start:
                aux.append(x + residual)
            x, residual, kv = run_decoder_layers(
                layers[start:end], x, residual, rope, None if kv_caches is None else kv_caches[start:end], attention,
                None if lora is None else lora[start:end], first_layer_idx=start)
            new_kv_caches += kv or []
        hidden = self.model.norm(x, residual)[0]
        return hidden, (None if kv_caches is None else new_kv_caches), jnp.concatenate(aux, axis=-1)

    def _forward(self, input_ids, positions, kv_caches, attention, lora=None):
        num_layers = len(self.model.layers)
        if kv_caches is not None and len(kv_caches) != num_layers:
            raise ValueError(f"kv_caches has {len(kv_caches)} layers, the model has {num_layers}")
        check_takes_layer_attention(self.config, attention)
        check_takes_attention_sinks(self.config, attention)
        rope = rope_tables(self.config, positions)
        x = self.model.embed(input_ids)
        x, residual, new_kv_caches = run_decoder_layers(self.model.layers, x, None, rope, kv_caches, attention, lora)
        hidden = self.model.norm(x) if residual is None else self.model.norm(x, residual)[0]  # None: no layers
        return hidden, (None if kv_caches is None else new_kv_caches)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [N, hidden_size] -> float32[N, vocab_size] (matmul in the compute dtype, fp32 accumulation), then
        Granite's ``logits_scaling`` and Gemma 2's final soft-cap (float32)."""
        if self.config.head == "none":
            raise ValueError(f"{self.config.architecture} with head='none' has no logits (hidden states only)")
        if self.lm_head is None:
            weight = self.model.embed_tokens.embedding[...].T  # [hidden, vocab]
        else:
            weight = self.lm_head.kernel[...]
        with matmul_precision(self.dtype):
            logits = self.logits_dot_general(hidden.astype(self.dtype), weight.astype(self.dtype),
                                             (((hidden.ndim - 1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return scale_logits(self.config, logits)


def scale_logits(config: ModelConfig, logits: jax.Array) -> jax.Array:
    """float32[N, V] LM-head outputs -> the model's logits: divided by ``logits_scaling`` (Granite), then
    ``cap * tanh(logits / cap)`` with ``final_logit_softcapping`` (Gemma 2); unchanged for other models."""
    if config.logits_scaling is not None:
        logits = logits / config.logits_scaling
    cap = config.final_logit_softcapping
    if cap is not None:
        logits = cap * jnp.tanh(logits / cap)
    return logits


def set_rms_norm_impl(model: LlamaForCausalLM, impl: str) -> LlamaForCausalLM:
    """In place: the implementation (``models.norm.RMS_NORM_IMPLS``) of every decoder-layer norm and the final norm,
    each a residual add fused with an RMSNorm (Qwen3's per-head q/k norms are part of the q/k transform,
    ``models.qk_transform``). A static choice: set it before tracing. "auto" (default): the Pallas kernel on one GPU
    once ``paged_jax.ops`` is imported, else XLA. A model on a mesh (``TensorParallelLlamaForCausalLM``: a pallas_call
    is not partitioned) runs "xla" only: ValueError for anything else. Returns ``model``."""
    check_rms_norm_impl(impl)
    if getattr(model, "sharding_plan", None) is not None and impl != "xla":
        raise ValueError(f"rms_norm_impl={impl!r}: a model on a mesh (tensor or pipeline parallel) runs 'xla' norms")
    for layer in model.model.layers:
        for norm in layer.norms():
            norm.impl = impl
    model.model.norm.impl = impl
    return model


def fuse_projections(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """In place: each layer's q/k/v projections become one ``qkv_proj`` and a dense MLP's gate/up one
    ``gate_up_proj`` (the experts of a sparse layer keep theirs: the grouped matmul reads both in one pass).

    For a model on one device (the engine does this after loading; a tensor-parallel model keeps the HF layout,
    whose per-projection shardings ``paged_jax.parallel`` defines, and a fused model given to a ``ShardingPlan``
    is refused with a ValueError naming the parameter). Same outputs; fewer, larger matmuls. The
    separate weights are dropped layer by layer, so the peak extra memory is one layer's projections.
    Returns ``model``. Calling it twice is a no-op.
    """
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if isinstance(attn, Attention) and attn.qkv_proj is None and attn.q_proj is not None:
            fused = _concat_linear([attn.q_proj, attn.k_proj, attn.v_proj])
            if fused is not None:
                attn.qkv_proj = fused
                attn.q_proj = attn.k_proj = attn.v_proj = None
        if isinstance(mlp, MLP) and mlp.gate_up_proj is None and mlp.gate_proj is not None:
            fused = _concat_linear([mlp.gate_proj, mlp.up_proj])
            if fused is not None:
                mlp.gate_up_proj = fused
                mlp.gate_proj = mlp.up_proj = None
    return model
