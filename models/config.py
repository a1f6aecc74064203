"""Model configuration for the Llama family and its relatives (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3 text, Phi-3 / Phi-4, Granite), its mixture-of-experts relatives (Qwen3-MoE, Mixtral, gpt-oss, Llama 4 text)
and DeepSeek-V2 / V3 (multi-head latent attention, ``MlaConfig``; DeepSeek's expert routing in ``MoeConfig``).

``ModelConfig`` is the one description of a model shape that the rest of paged-jax uses; it is built from a Hugging
Face ``config.json`` dict (transformers 4.x or 5.x layout; each family's fields read in ``models.hf_config``).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from models import deepseek_config, hf_config as hf

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
    "GraniteForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "GptOssForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Llama4ForCausalLM",
)
MOE_ARCHITECTURES = hf.MOE_ARCHITECTURES

# model_type -> architecture, for configs that omit "architectures".
_MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
}
# Checkpoints whose text model is supported only inside a multimodal wrapper we do not load.
_MULTIMODAL = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM (model_type 'gemma3_text')",
               "gemma3": "Gemma3ForCausalLM (model_type 'gemma3_text')"}
# Multimodal checkpoints whose text part is loaded (its ``text_config``, tensors under ``language_model.``); the
# engine takes no image inputs (the server's chat messages take text parts only).
_TEXT_PART_OF = {"Llama4ForConditionalGeneration": "Llama4ForCausalLM", "llama4": "Llama4ForCausalLM"}
HIDDEN_ACTS = tuple(hf.HIDDEN_ACTS.values())
SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
MOE_ROUTERS = ("softmax", "sigmoid_input")
EXPERT_FORMATS = (None, "mxfp4", "fp8")
HEADS = ("lm_head", "score", "none")


@dataclasses.dataclass(frozen=True)
class AttentionChunk:
    """Chunked local attention (Llama 4's ``attention_chunk_size``): a query at position ``p`` sees the keys
    ``p // size * size <= j <= p``, those of its own chunk of ``size`` tokens. A layer's KV span in
    ``ModelConfig.layer_kv_spans`` (beside a sliding window's int and full attention's None)."""

    size: int

    def __post_init__(self):
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size <= 0:
            raise ValueError(f"config field 'attention_chunk_size' must be a positive int, got {self.size!r}")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP of a mixture-of-experts model (HF field names).

    Each token's router logits (``[num_experts]``) go through a float32 softmax; the ``num_experts_per_tok`` largest
    probabilities pick the experts, renormalized to sum to 1 when ``norm_topk_prob``; the layer's output is their
    weighted sum of the experts' SwiGLU MLPs (``moe_intermediate_size`` wide). Layer ``i`` is sparse when
    ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0`` (Qwen3-MoE), else a dense MLP of the model's
    ``intermediate_size``.

    gpt-oss (``swiglu_limit`` set; ``models.gpt_oss``): the router and the experts carry biases, the weights are
    the softmax over the top-k logits, and the experts run the clamped SwiGLU ``(clip(up, -limit, limit) + 1) *
    g * sigmoid(alpha * g)`` with ``g = min(gate, limit)``. ``expert_format``: None (experts in the model dtype),
    "mxfp4" (gpt-oss: kept as the checkpoint's packed fp4 blocks and e8m0 scales, dequantized in the step) or "fp8"
    (DeepSeek-V2 / V3, Qwen3-MoE block-FP8 checkpoints: kept in float8_e4m3fn with float32 scales per
    ``ModelConfig.fp8_weight_block``, dequantized per tile by the grouped matmuls, ``models.moe``).

    DeepSeek-V2 / V3 (``models.deepseek``): ``n_shared_experts`` shared experts (one SwiGLU MLP
    ``n_shared_experts * moe_intermediate_size`` wide, added to every token's routed sum); ``scoring_func``
    "softmax" (V2) or "sigmoid" (V3: the choice adds the router's ``e_score_correction_bias``, the weights do
    not); ``topk_method`` "greedy", "group_limited_greedy" (V2: the ``topk_group`` of ``n_group`` expert groups
    with the largest best score) or "noaux_tc" (V3: the groups with the largest sum of their top-2 biased scores);
    the routed weights renormalized when ``norm_topk_prob``, then times ``routed_scaling_factor``. Its first
    ``first_k_dense_replace`` layers are dense: ``mlp_only_layers``.
    Llama 4 (``router`` "sigmoid_input"; ``models.llama4``): the top-k router logits go through a float32 sigmoid
    and scale each expert's input (not its output); a shared expert (a dense SwiGLU MLP
    ``shared_expert_intermediate_size`` wide) runs on every token beside them.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    swiglu_alpha: float | None = None
    swiglu_limit: float | None = None
    expert_format: str | None = None
    n_shared_experts: int = 0
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    router: str = "softmax"
    shared_expert_intermediate_size: int | None = None

    def __post_init__(self):
        if self.router not in MOE_ROUTERS:
            raise ValueError(f"MoeConfig.router must be one of {MOE_ROUTERS}, got {self.router!r}")
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(f"config field 'scoring_func' = {self.scoring_func!r} is unsupported (one of "
                             f"{SCORING_FUNCS})")
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"config field 'topk_method' = {self.topk_method!r} is unsupported (one of "
                             f"{TOPK_METHODS})")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"config fields 'n_group' ({self.n_group}) and 'topk_group' ({self.topk_group}) must "
                             f"divide the {self.num_experts} experts into groups and keep 1..n_group of them")
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"MoeConfig.expert_format must be one of {EXPERT_FORMATS}, got {self.expert_format!r}")
        if self.expert_format == "mxfp4" and self.swiglu_limit is None:
            raise ValueError("MoeConfig.expert_format 'mxfp4' is gpt-oss's (swiglu_limit set)")
        if self.expert_format == "fp8" and (self.swiglu_limit is not None or self.router != "softmax"):
            raise ValueError("MoeConfig.expert_format 'fp8' (block-FP8 experts) runs the SwiGLU experts of "
                             "models.moe only (not gpt-oss's or Llama 4's)")
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config field {name!r} must be a positive int, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"config field 'num_experts_per_tok' ({self.num_experts_per_tok}) must be at most "
                             f"num_experts ({self.num_experts})")

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` (global index) runs the experts rather than a dense MLP."""
        return layer_idx not in self.mlp_only_layers and (layer_idx + 1) % self.decoder_sparse_step == 0


@dataclasses.dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2 / V3, HF field names; ``models.mla``).

    q: ``q_proj`` (``q_lora_rank`` None, V2-Lite) or ``q_b_proj(rmsnorm(q_a_proj(x)))`` through a ``q_lora_rank``
    bottleneck, ``qk_nope_head_dim + qk_rope_head_dim`` per head. ``kv_a_proj_with_mqa(x)`` gives the latent
    (``kv_lora_rank``, RMS-normed) and one RoPE key shared by the heads (``qk_rope_head_dim``); ``kv_b_proj``
    expands the latent into each head's key (``qk_nope_head_dim``) and value (``v_head_dim``). ``rope_interleave``:
    RoPE rotates adjacent pairs (DeepSeek's layout; transformers' V2 always, V3 by this field) rather than halves.
    The KV cache holds the latent and the rotated shared key only: ``kv_lora_rank + qk_rope_head_dim`` per token and
    layer (``ModelConfig.kv_pool_head_dims``).
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    rope_interleave: bool = True

    def __post_init__(self):
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank"):
            value = getattr(self, name)
            if value is None and name == "q_lora_rank":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"config field {name!r} must be a positive int, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"config field 'qk_rope_head_dim' must be even for RoPE, got {self.qk_rope_head_dim}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """One cached token's width per layer: the latent and the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of one decoder-only model.

    ``rope_scaling`` is None (plain RoPE) or a dict by ``rope_type``: "llama3" (``factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings``), "linear" (``factor``) or "longrope" (``short_factor,
    long_factor`` tuples of ``rotary_dim // 2`` floats, ``original_max_position_embeddings``, ``attention_factor``
    scaling cos and sin, ``use_long_factors``: which factors run, fixed per engine as vLLM does).
    ``attention_bias`` means q/k/v projections carry a bias (Qwen2 always; Llama/Qwen3 when configured);
    ``o_proj_bias`` means the output projection does too (Llama/Qwen3 ``attention_bias=True``).
    ``qk_norm`` is the per-head RMSNorm on q and k before RoPE (Qwen3, Qwen3-MoE, Gemma 3).
    Attention kinds per layer: ``sliding_window`` is the window in tokens of every layer (None: full causal
    attention); ``layer_sliding_windows`` instead gives each layer's window (None entries: full attention) when the
    layers differ (Qwen2 with ``max_window_layers``, Gemma), and ``sliding_window`` is then None. The sliding layers
    rotate with ``local_rope_theta`` (Gemma 3; None: ``rope_theta`` and ``rope_scaling``). ``rotary_dim``: RoPE on
    the first ``rotary_dim`` dims of each head only (Phi-4's ``partial_rotary_factor``; None: all).
    ``attention_scale`` multiplies ``q . k`` (None: ``head_dim ** -0.5``); ``attn_logit_softcapping`` /
    ``final_logit_softcapping``: ``cap * tanh(x / cap)`` on the attention scores / the logits (Gemma 2).
    ``norm_unit_offset``: every RMSNorm scales by ``1 + weight`` in float32 (Gemma); ``sandwich_norms``: Gemma's
    post-attention norm on the attention output and pre-/post-feedforward norms around the MLP.
    ``hidden_act``: the gated MLP's activation (``HIDDEN_ACTS``). ``embedding_multiplier`` (in the model dtype),
    ``residual_multiplier`` on each block's output and ``logits_scaling`` (logits divided by it): Gemma's
    ``sqrt(hidden_size)`` and Granite's multipliers; None: 1.
    ``moe`` is the sparse MLP of a mixture-of-experts architecture (``MOE_ARCHITECTURES``), None for dense ones.
    ``attention_sinks``: each attention layer has a learned per-head logit joining its softmax's denominator
    (gpt-oss; the ``sinks`` parameter ``[num_attention_heads]``).
    ``mla``: multi-head latent attention (DeepSeek-V2 / V3, ``MlaConfig``); the attention it runs is then MQA over
    the latent cache: ``num_key_value_heads`` 1, ``head_dim`` ``kv_lora_rank + qk_rope_head_dim``, ``rotary_dim``
    ``qk_rope_head_dim`` and ``attention_scale`` DeepSeek's (``models.deepseek_config``).
    ``fp8_weight_block``: the checkpoint's projections are block-FP8 (``quantization_config`` fp8 with
    ``weight_block_size``, DeepSeek-V3 and Qwen3-MoE FP8 as published): ``(rows, cols)`` of one
    ``weight_scale_inv`` entry; the loader dequantizes them to the model dtype (``models.quantization.block_fp8``),
    except the experts, which stay in float8 (``MoeConfig.expert_format`` "fp8"). None: unquantized.
    ``num_nextn_predict_layers``: DeepSeek-V3's multi-token prediction layers, stored after the decoder layers
    (``model.layers.{num_hidden_layers + i}``): not part of the model's forward, read by the ``mtp`` speculative
    method (``models.mtp``); 0 for every other architecture.
    ``head``: what follows the final norm (``HEADS``): "lm_head" (the vocabulary, or the tied embedding), "score"
    (a ``num_labels``-wide classifier, transformers' ``*ForSequenceClassification``) or "none" (hidden states only:
    the base model, transformers' ``*Model``, or a decoder run as an embedder).
    Llama 4: ``layer_attention_chunks`` gives each layer's attention chunk (None entries: not chunked;
    ``AttentionChunk``); ``nope_layers`` rotate nothing (NoPE); ``rope_interleaved``: RoPE rotates the pairs
    ``(x[2i], x[2i + 1])`` (Meta's complex form) instead of the two halves; ``qk_l2_norm``: q and k of the RoPE
    layers are RMS-normalized per head without a weight (``use_qk_norm``); ``attn_temperature``: ``(floor_scale,
    attn_scale)``, the NoPE layers' q scaled by ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1`` at
    position ``p``.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    o_proj_bias: bool = False
    layer_sliding_windows: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None
    rotary_dim: int | None = None
    attention_scale: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    logits_scaling: float | None = None
    moe: MoeConfig | None = None
    attention_sinks: bool = False
    mla: MlaConfig | None = None
    fp8_weight_block: tuple[int, int] | None = None
    num_nextn_predict_layers: int = 0
    head: str = "lm_head"
    num_labels: int = 0
    layer_attention_chunks: tuple[int | None, ...] | None = None
    nope_layers: tuple[int, ...] = ()
    rope_interleaved: bool = False
    qk_l2_norm: bool = False
    attn_temperature: tuple[float, float] | None = None

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if (self.moe is not None) != (self.architecture in MOE_ARCHITECTURES):
            raise ValueError(f"ModelConfig.moe must be set exactly for the mixture-of-experts architectures "
                             f"({', '.join(MOE_ARCHITECTURES)}); {self.architecture} has moe={self.moe!r}")
        if self.head not in HEADS or (self.head == "score") != (self.num_labels > 0):
            raise ValueError(f"ModelConfig.head must be one of {HEADS} with num_labels > 0 exactly for 'score', got "
                             f"head={self.head!r}, num_labels={self.num_labels!r}")
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        self._check_windows()
        if (self.moe is not None and self.moe.expert_format == "fp8") != (self.fp8_weight_block is not None):
            raise ValueError("ModelConfig.fp8_weight_block must be set exactly for block-FP8 experts "
                             "(MoeConfig.expert_format 'fp8')")
        if (self.mla is not None) != (self.architecture in hf.DEEPSEEK_ARCHITECTURES):
            raise ValueError(f"ModelConfig.mla must be set exactly for {hf.DEEPSEEK_ARCHITECTURES}")
        if self.mla is not None and (self.num_key_value_heads, self.head_dim) != (1, self.mla.latent_dim):
            raise ValueError("ModelConfig of multi-head latent attention: num_key_value_heads must be 1 and head_dim "
                             f"kv_lora_rank + qk_rope_head_dim ({self.mla.latent_dim})")
        if self.rotary_dim is not None and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"ModelConfig.rotary_dim must be even and in (0, head_dim], got {self.rotary_dim}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"ModelConfig.hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in hf.ROPE_TYPES[1:]:
                raise ValueError(f"ModelConfig.rope_scaling: unsupported rope_type {rope_type!r} (one of "
                                 f"{hf.ROPE_TYPES[1:]})")

    def _check_windows(self):
        for window in (self.sliding_window, *(self.layer_sliding_windows or ())):
            if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
                raise ValueError(f"ModelConfig.sliding_window must be a positive int or None, got {window!r}")
        if self.layer_sliding_windows is not None:
            if len(self.layer_sliding_windows) != self.num_hidden_layers:
                raise ValueError(f"ModelConfig.layer_sliding_windows has {len(self.layer_sliding_windows)} entries "
                                 f"for {self.num_hidden_layers} layers")
            if self.sliding_window is not None:
                raise ValueError("ModelConfig.sliding_window must be None when layer_sliding_windows is given")
        if self.layer_attention_chunks is not None:
            if len(self.layer_attention_chunks) != self.num_hidden_layers:
                raise ValueError(f"ModelConfig.layer_attention_chunks has {len(self.layer_attention_chunks)} "
                                 f"entries for {self.num_hidden_layers} layers")
            for chunk, window in zip(self.layer_attention_chunks, self.layer_windows):
                if chunk is not None and AttentionChunk(chunk) and window is not None:
                    raise ValueError("ModelConfig: a layer cannot both slide and attend in chunks")

    def __hash__(self):
        # NNX keeps the config on the module as static graph data, which must be hashable; the dict/list fields are
        # hashed through immutable views.
        values = []
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, dict):
                value = tuple(sorted(value.items()))
            elif isinstance(value, list):
                value = tuple(value)
            values.append(value)
        return hash(tuple(values))

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window in tokens (None: full causal attention), ``num_hidden_layers`` entries."""
        if self.layer_sliding_windows is not None:
            return self.layer_sliding_windows
        return (self.sliding_window,) * self.num_hidden_layers

    @property
    def kv_pool_head_dims(self) -> tuple[int, int]:
        """The width of one KV head in the K and in the V pool: ``(head_dim, head_dim)``, or for MLA ``(head_dim,
        0)``: the latent cache is one pool whose rows are ``[latent | rope key]``, the values its first
        ``kv_lora_rank`` columns (``paged_jax.ops.write_and_attend``), so the V pool has no width."""
        return (self.head_dim, 0) if self.mla is not None else (self.head_dim, self.head_dim)

    @property
    def layer_chunks(self) -> tuple[int | None, ...]:
        """Each layer's attention chunk in tokens (None: not chunked), ``num_hidden_layers`` entries."""
        return self.layer_attention_chunks or (None,) * self.num_hidden_layers

    @property
    def layer_kv_spans(self) -> tuple[int | AttentionChunk | None, ...]:
        """Which earlier tokens' K/V each layer reads (``paged_jax.core.kv_groups``): its sliding window (int), its
        ``AttentionChunk``, or None (every earlier token)."""
        return tuple(window if chunk is None else AttentionChunk(chunk)
                     for window, chunk in zip(self.layer_windows, self.layer_chunks))

    @property
    def softmax_scale(self) -> float:
        """The factor on ``q . k`` of every layer."""
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

    @property
    def eos_token_ids(self) -> list[int]:
        """EOS ids as a list (empty when unknown)."""
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    def for_max_model_len(self, max_model_len: int) -> "ModelConfig":
        """This config for an engine of ``max_model_len`` tokens: LongRoPE runs its long factors when
        ``max_model_len`` exceeds ``original_max_position_embeddings`` (vLLM's rule), else its short ones; other
        configs are returned as they are."""
        scaling = self.rope_scaling
        if scaling is None or scaling["rope_type"] != "longrope":
            return self
        use_long = max_model_len > scaling["original_max_position_embeddings"]
        return dataclasses.replace(self, rope_scaling={**scaling, "use_long_factors": use_long})

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (transformers 4 ``rope_scaling``/``rope_theta`` or
        transformers 5 ``rope_parameters`` layout). ValueError naming the field for what is not implemented."""
        architecture, head = _architecture(hf_config)
        if architecture in _TEXT_PART_OF.values() and isinstance(hf_config.get("text_config"), dict):
            hf_config = {**hf_config["text_config"], "architectures": [architecture]}
        if architecture in hf.DEEPSEEK_ARCHITECTURES:
            fields = deepseek_config.model_fields(architecture, hf_config)
            return cls(architecture=architecture, head=head, **{
                **fields, "mla": MlaConfig(**fields["mla"]), "moe": MoeConfig(**fields["moe"])})

        def required(key: str):
            if hf_config.get(key) is None:
                raise ValueError(f"config is missing required field {key!r}")
            return hf_config[key]

        if hf_config.get("mlp_bias"):
            raise ValueError("config field 'mlp_bias' = True is unsupported")

        hidden_size = int(required("hidden_size"))
        num_heads = int(required("num_attention_heads"))
        num_layers = int(required("num_hidden_layers"))
        num_kv_heads = hf_config.get("num_key_value_heads")
        num_kv_heads = num_heads if num_kv_heads is None else int(num_kv_heads)
        head_dim = hf_config.get("head_dim")
        head_dim = hidden_size // num_heads if head_dim is None else int(head_dim)

        configured_bias = bool(hf.family_default(architecture, hf_config, "attention_bias", False))
        if architecture == "Qwen2ForCausalLM":
            attention_bias, o_proj_bias = True, False  # Qwen2: q/k/v bias always, o_proj never
        else:
            attention_bias, o_proj_bias = configured_bias, configured_bias

        windows = hf.layer_windows(architecture, hf_config, num_layers)
        uniform = len(set(windows)) <= 1
        moe_fields = hf.moe_fields(architecture, hf_config, num_layers)
        return cls(
            architecture=architecture,
            vocab_size=int(required("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(required("intermediate_size_mlp" if architecture == "Llama4ForCausalLM"
                                           else "intermediate_size")),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            **hf.parse_rope(hf_config, architecture, head_dim),
            rms_norm_eps=float(hf.family_default(architecture, hf_config, "rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.family_default(architecture, hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            max_position_embeddings=int(hf_config.get("max_position_embeddings") or 4096),
            sliding_window=windows[0] if uniform else None,
            layer_sliding_windows=None if uniform else windows,
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_id=hf_config.get("eos_token_id"),
            o_proj_bias=o_proj_bias,
            **hf.family_options(architecture, hf_config),
            moe=None if moe_fields is None else MoeConfig(**moe_fields),
            fp8_weight_block=hf.fp8_weight_block(architecture, hf_config),
            attention_sinks=architecture == "GptOssForCausalLM",
            head=head,
            num_labels=hf.num_labels(hf_config) if head == "score" else 0,
            **hf.llama4_fields(architecture, hf_config, num_layers),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        """Read ``<model_dir>/config.json``; FileNotFoundError naming the path when absent."""
        config_path = Path(model_dir) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"model config not found: {config_path}")
        with open(config_path) as f:
            return cls.from_hf_config(json.load(f))


def _architecture(hf_config: dict[str, Any]) -> tuple[str, str]:
    """``(architecture, head)``: the config's architecture (its first "architectures" entry, else from model_type;
    a supported decoder's base or sequence-classification model as that decoder, ``hf.pooling_base``) and its head
    (``HEADS``); ValueError naming it when unsupported, and for a multimodal checkpoint naming the text-only
    architecture to use instead."""
    architectures = hf_config.get("architectures") or []
    key = architectures[0] if architectures else hf_config.get("model_type")
    if key in _TEXT_PART_OF:
        return _TEXT_PART_OF[key], "lm_head"
    if key in _MULTIMODAL:
        raise ValueError(f"unsupported architecture {key!r}: the multimodal checkpoint is not loaded (its text part "
                         f"neither); use a {_MULTIMODAL[key]} checkpoint")
    if not architectures:
        if key not in _MODEL_TYPE_TO_ARCHITECTURE:
            raise ValueError(f"unsupported architecture: config has no 'architectures' and model_type {key!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        return _MODEL_TYPE_TO_ARCHITECTURE[key], "lm_head"
    base = hf.pooling_base(key)
    if base is not None and base[0] in SUPPORTED_ARCHITECTURES and base[0] not in MOE_ARCHITECTURES:
        if base[1] == "score" and hf_config.get("classifier_from_token"):
            return base[0], "lm_head"  # the LM's weights: the classes are some tokens' logits (paged_jax.pooling)
        return base
    if key not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {key!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)} and "
                         "the dense ones' *Model / *ForSequenceClassification")
    return key, "lm_head"
