"""The model class of each supported architecture (``models.config.SUPPORTED_ARCHITECTURES``).

The dense ones (Llama, Mistral, Qwen2, Qwen3) are ``LlamaForCausalLM`` (with ``ModelConfig.head`` "none" too: hidden
states only), with a classifier head ``DecoderForSequenceClassification``; the mixture-of-experts ones are its
subclasses below, whose sparse decoder layers carry a ``models.moe.SparseMoeBlock`` in place of the dense MLP (the
layer structure follows ``ModelConfig.moe``, so a tensor-parallel or pipelined model of the same config has the same
layers). Build a model of a config with ``model_class(config)(config, ...)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from models.dense import dense_linear
from models.llama import LlamaForCausalLM, matmul_precision


class _MoeForCausalLM(LlamaForCausalLM):
    """``LlamaForCausalLM`` of a mixture-of-experts config: refuses a config of another architecture."""

    architecture = ""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, **kwargs):
        if config.architecture != self.architecture:
            raise ValueError(f"{type(self).__name__} needs a {self.architecture} config, got {config.architecture}")
        super().__init__(config, rngs=rngs, **kwargs)


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norm), sparse layers by
    ``decoder_sparse_step`` / ``mlp_only_layers``, top-k weights renormalized when ``norm_topk_prob``. Checkpoint
    names: ``mlp.gate``, ``mlp.experts.{e}.{gate,up,down}_proj``."""

    architecture = "Qwen3MoeForCausalLM"


class MixtralForCausalLM(_MoeForCausalLM):
    """Mixtral (8x7B, 8x22B): Mistral's attention, every layer sparse, top-k weights renormalized. Checkpoint names:
    ``block_sparse_moe.gate``, ``block_sparse_moe.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down)."""

    architecture = "MixtralForCausalLM"


class GptOssForCausalLM(_MoeForCausalLM):
    """gpt-oss (gpt-oss-20b, gpt-oss-120b): attention with q/k/v/o biases and sinks (``self_attn.sinks``),
    alternating sliding-window and full layers (``layer_types``), YaRN, and ``models.gpt_oss.GptOssMoeBlock`` in
    every layer. Checkpoint names: ``mlp.router.{weight,bias}``, ``mlp.experts.{gate_up_proj,down_proj}`` with
    ``_bias``, or as published ``_blocks`` / ``_scales`` (MXFP4)."""

    architecture = "GptOssForCausalLM"


class DeepseekV2ForCausalLM(_MoeForCausalLM):
    """DeepSeek-V2 (and V2-Lite, ``q_lora_rank`` null): multi-head latent attention (``models.mla``) over a latent
    KV cache, dense first ``first_k_dense_replace`` layers, then sparse layers with softmax routing (greedy or
    group-limited) and shared experts (``models.deepseek``). Checkpoint names: ``self_attn.{q_proj | q_a_proj,
    q_a_layernorm, q_b_proj}``, ``self_attn.kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj`` / ``o_proj``,
    ``mlp.gate.weight``, ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_experts.{gate,up,down}_proj``."""

    architecture = "DeepseekV2ForCausalLM"


class DeepseekV3ForCausalLM(_MoeForCausalLM):
    """DeepSeek-V3 / R1: DeepSeek-V2's layers with sigmoid routing, ``mlp.gate.e_score_correction_bias`` and
    ``noaux_tc`` group selection; block-FP8 checkpoints (as published) dequantized at load; the multi-token
    prediction layers (``num_nextn_predict_layers``) are not part of the model: the ``mtp`` speculative method loads
    them as its drafter (``models.mtp``)."""

    architecture = "DeepseekV3ForCausalLM"
class Llama4ForCausalLM(_MoeForCausalLM):
    """Llama 4's text model (Llama-4-Scout-17B-16E, -Maverick-17B-128E; the text part of their
    ``Llama4ForConditionalGeneration`` checkpoints): chunked local attention with interleaved RoPE and the weightless
    q/k norm on three layers of four, full attention without RoPE (with the attention temperature) on the fourth,
    ``models.llama4.Llama4MoeBlock`` on the ``moe_layers`` and dense MLPs (``intermediate_size_mlp``) on the others.
    Checkpoint names: ``feed_forward.router``, ``feed_forward.experts.{gate_up_proj,down_proj}``,
    ``feed_forward.shared_expert.*``, ``feed_forward.{gate,up,down}_proj``."""

    architecture = "Llama4ForCausalLM"


class DecoderForSequenceClassification(LlamaForCausalLM):
    """A dense decoder with transformers' sequence-classification head (``Qwen3ForSequenceClassification`` and
    kin): ``score`` [hidden -> num_labels], no bias, in place of the LM head; checkpoint name ``score.weight``. Which
    token's hidden state it scores is the pooler's (``paged_jax.pooling``)."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.bfloat16, param_dtype=None, rngs: nnx.Rngs, **kwargs):
        if config.head != "score":
            raise ValueError(f"DecoderForSequenceClassification needs head='score', got {config.head!r}")
        super().__init__(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs, **kwargs)
        self.score = dense_linear(config.hidden_size, config.num_labels, use_bias=False, dtype=dtype,
                                  param_dtype=dtype if param_dtype is None else param_dtype, rngs=rngs)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """hidden: [N, hidden_size] -> float32[N, num_labels] (matmul in the compute dtype, fp32 accumulation)."""
        with matmul_precision(self.dtype):
            return jnp.dot(hidden.astype(self.dtype), self.score.kernel[...].astype(self.dtype),
                           preferred_element_type=jnp.float32)


_MOE_CLASSES = {cls.architecture: cls for cls in (Qwen3MoeForCausalLM, MixtralForCausalLM, GptOssForCausalLM,
                                                  DeepseekV2ForCausalLM, DeepseekV3ForCausalLM, Llama4ForCausalLM)}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that runs ``config.architecture``."""
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {config.architecture!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    if config.head == "score":
        return DecoderForSequenceClassification
    return _MOE_CLASSES.get(config.architecture, LlamaForCausalLM)
