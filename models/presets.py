"""Named model shapes (public config.json figures) for benchmarks with random ("dummy") weights.

No weights are involved: each preset is the HF ``config.json`` dict of a public model, so a benchmark can build the
real shape with ``load_format="dummy"`` on a machine that has no checkpoint.
"""

from __future__ import annotations

from typing import Any

from models.config import ModelConfig

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
        "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "llama-3.1-8b": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    },
    "llama-3.2-1b": {  # a draft model for llama-3.1-8b (the same vocabulary)
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 64, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        "max_position_embeddings": 131072, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    },
    "qwen2.5-7b": {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 152064, "hidden_size": 3584,
        "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
        "head_dim": 128, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "max_position_embeddings": 32768, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    "gemma-3-12b": {  # the text model of google/gemma-3-12b-it: 40 sliding layers (window 1024), 8 full ones
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "vocab_size": 262208,
        "hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": 48, "num_attention_heads": 16,
        "num_key_value_heads": 8, "head_dim": 256, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 1024, "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-6, "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "tie_word_embeddings": True,
        "max_position_embeddings": 131072, "bos_token_id": 2, "eos_token_id": [1, 106],
    },
    "qwen3-30b-a3b": {  # Qwen/Qwen3-30B-A3B: 128 experts, 8 per token, every layer sparse
        "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
        "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        "max_position_embeddings": 40960, "bos_token_id": 151643, "eos_token_id": 151645,
    },
    # openai/gpt-oss-20b's config.json as published: MXFP4 experts, alternating 128-token sliding and full layers.
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
        "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * 12, "attention_bias": True, "swiglu_limit": 7.0,
        "rope_theta": 150000, "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "truncate": False,
                                               "original_max_position_embeddings": 4096},
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 131072,
        "eos_token_id": 200002, "pad_token_id": 199999,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
    },
    # The text model of meta-llama/Llama-4-Scout-17B-16E (its config.json's text_config): 16 experts + a shared
    # expert in every layer, 8192-token attention chunks on three layers of four, the fourth NoPE with full attention.
    "llama-4-scout-17b-16e": {
        "model_type": "llama4_text", "architectures": ["Llama4ForCausalLM"], "vocab_size": 202048,
        "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_hidden_layers": 48,
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128, "num_local_experts": 16,
        "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "attention_chunk_size": 8192,
        "no_rope_layer_interval": 4, "use_qk_norm": True, "attn_temperature_tuning": True, "floor_scale": 8192,
        "attn_scale": 0.1, "attention_bias": False, "hidden_act": "silu", "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192},
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "max_position_embeddings": 10485760,
        "bos_token_id": 200000, "eos_token_id": [200001, 200007, 200008], "pad_token_id": 200018,
    },
    "smollm2-135m": {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "head_dim": 64, "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
        "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
    },
}


# Qwen/Qwen3-30B-A3B-FP8: the same model in block-FP8 (128 x 128 scales), the routers and LM head unquantized; its
# experts stay in float8 (MoeConfig.expert_format "fp8").
PRESETS["qwen3-30b-a3b-fp8"] = {**PRESETS["qwen3-30b-a3b"], "quantization_config": {
    "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128],
    "modules_to_not_convert": ["lm_head", *(f"model.layers.{i}.mlp.gate" for i in range(48))]}}

# openai/gpt-oss-120b: gpt-oss-20b's layers, 36 of them, with 128 experts each.
PRESETS["gpt-oss-120b"] = {**PRESETS["gpt-oss-20b"], "num_hidden_layers": 36, "num_local_experts": 128,
                           "layer_types": ["sliding_attention", "full_attention"] * 18}

# deepseek-ai/DeepSeek-V2-Lite's config.json as published: latent attention without a q bottleneck, 64 experts (6
# per token, greedy softmax routing) and 2 shared ones, the first layer dense.
PRESETS["deepseek-v2-lite"] = {
    "model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
    "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1,
    "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                     "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 163840,
    "bos_token_id": 100000, "eos_token_id": 100001, "attention_bias": False,
}
# deepseek-ai/DeepSeek-V3's config.json as published: block-FP8 weights, 256 experts in 8 groups (sigmoid noaux_tc
# routing, 8 per token from 4 groups), one shared expert, 3 dense layers, one multi-token prediction layer.
PRESETS["deepseek-v3"] = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8,
    "topk_group": 4, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096},
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "max_position_embeddings": 163840, "bos_token_id": 0,
    "eos_token_id": 1, "attention_bias": False,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                            "weight_block_size": [128, 128]},
}


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig of a named shape; ValueError listing the known names otherwise."""
    key = name.lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(sorted(PRESETS))}")
    return ModelConfig.from_hf_config(PRESETS[key])


def num_params(config: ModelConfig) -> int:
    """Parameter count of a Llama-family shape (embeddings and LM head included, norms included; a
    mixture-of-experts shape's every expert)."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    attn = h * q + 2 * h * kv + q * h if config.mla is None else mla_params(config)
    if config.attention_bias:
        attn += q + 2 * kv
    if config.qk_norm:
        attn += 2 * config.head_dim
    mlps = sum(mlp_params(config, layer) for layer in range(layers))
    embed = config.vocab_size * h
    head = 0 if config.tie_word_embeddings else config.vocab_size * h
    return layers * (attn + 2 * h) + mlps + embed + head + h


def mla_params(config: ModelConfig) -> int:
    """Parameters of one latent-attention layer (its projections and the q / kv bottleneck norms)."""
    h, heads, mla = config.hidden_size, config.num_attention_heads, config.mla
    q_out = heads * mla.qk_head_dim
    q = h * q_out if mla.q_lora_rank is None else h * mla.q_lora_rank + mla.q_lora_rank * (1 + q_out)
    kv = h * mla.latent_dim + mla.kv_lora_rank * (1 + heads * (mla.qk_nope_head_dim + mla.v_head_dim))
    return q + kv + heads * mla.v_head_dim * h


def mlp_params(config: ModelConfig, layer: int) -> int:
    """Parameters of decoder layer ``layer``'s MLP: a dense SwiGLU, or a sparse layer's router, every expert and the
    shared expert (Llama 4)."""
    h, moe = config.hidden_size, config.moe
    if moe is None or not moe.is_sparse(layer):
        return 3 * h * config.intermediate_size
    shared = moe.n_shared_experts * expert_params(config) + 3 * h * (moe.shared_expert_intermediate_size or 0)
    bias = moe.num_experts if moe.topk_method == "noaux_tc" else 0
    return h * moe.num_experts + bias + moe.num_experts * expert_params(config) + shared


def expert_params(config: ModelConfig) -> int:
    """Parameters of one expert of a mixture-of-experts shape (its gate, up and down projections)."""
    return 3 * config.hidden_size * config.moe.moe_intermediate_size


def kv_bytes_per_token(config: ModelConfig, dtype_bytes: int = 2) -> int:
    """Bytes of K and V one token occupies across all layers (a latent cache's one row per layer)."""
    return config.num_hidden_layers * config.num_key_value_heads * sum(config.kv_pool_head_dims) * dtype_bytes
