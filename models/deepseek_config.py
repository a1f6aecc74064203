"""DeepSeek-V2 / V3's ``config.json`` read the way transformers reads it (``DeepseekV2Config``,
``DeepseekV3Config``): multi-head latent attention, the experts and their routing, YaRN with DeepSeek's softmax
``mscale``, block-FP8 weights. ``models.config.ModelConfig.from_hf_config`` is the one caller; it gets plain dicts
(``ModelConfig`` fields, with ``mla`` and ``moe`` as the fields of ``MlaConfig`` / ``MoeConfig``).

The attention the engine runs is MQA over the latent cache (``models.mla``): one KV head of ``kv_lora_rank +
qk_rope_head_dim``, so ``num_key_value_heads`` is 1 and ``head_dim`` that width whatever config.json says (its
``num_key_value_heads`` only sizes transformers' expanded K/V). A field whose value changes the math and that is not
implemented is refused with a ValueError naming it.
"""

from __future__ import annotations

import math
from typing import Any

from models import hf_config as hf

# Each version's routing as published (DeepSeek-V2's and -V3's config.json) and transformers' defaults.
_ROUTING = {"DeepseekV2ForCausalLM": {"scoring_func": "softmax", "topk_methods": ("greedy", "group_limited_greedy"),
                                      "norm_topk_prob": False, "routed_scaling_factor": 1.0},
            "DeepseekV3ForCausalLM": {"scoring_func": "sigmoid", "topk_methods": ("noaux_tc",),
                                      "norm_topk_prob": True, "routed_scaling_factor": 2.5}}
# transformers' default of a field the published configs may omit.
_DEFAULTS = {"DeepseekV2ForCausalLM": {"max_position_embeddings": 2048, "q_lora_rank": 1536},
             "DeepseekV3ForCausalLM": {"max_position_embeddings": 4096, "q_lora_rank": 1536}}


def _required(hf_config: dict, key: str):
    if hf_config.get(key) is None:
        raise ValueError(f"config is missing required field {key!r}")
    return hf_config[key]


def mla_fields(architecture: str, hf_config: dict) -> dict[str, Any]:
    """The fields of ``MlaConfig``; V3's ``rope_interleave`` defaults to True, V2 always rotates pairs."""
    q_lora_rank = hf_config.get("q_lora_rank", _DEFAULTS[architecture]["q_lora_rank"])
    interleave = True
    if architecture == "DeepseekV3ForCausalLM":
        interleave = bool(hf_config.get("rope_interleave", True))
    return {"kv_lora_rank": int(_required(hf_config, "kv_lora_rank")),
            "qk_nope_head_dim": int(_required(hf_config, "qk_nope_head_dim")),
            "qk_rope_head_dim": int(_required(hf_config, "qk_rope_head_dim")),
            "v_head_dim": int(_required(hf_config, "v_head_dim")),
            "q_lora_rank": None if q_lora_rank is None else int(q_lora_rank), "rope_interleave": interleave}


def moe_fields(architecture: str, hf_config: dict, num_layers: int) -> dict[str, Any]:
    """The fields of ``MoeConfig``: routed experts, the shared ones, the routing, dense first layers."""
    routing = _ROUTING[architecture]
    scoring = hf_config.get("scoring_func", routing["scoring_func"])
    if scoring != routing["scoring_func"]:
        raise ValueError(f"config field 'scoring_func' = {scoring!r} is unsupported for {architecture} (only "
                         f"{routing['scoring_func']!r})")
    topk_method = hf_config.get("topk_method", routing["topk_methods"][0])
    if topk_method not in routing["topk_methods"]:
        raise ValueError(f"config field 'topk_method' = {topk_method!r} is unsupported for {architecture} (one of "
                         f"{routing['topk_methods']})")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config field 'hidden_act' = {hf_config['hidden_act']!r} is unsupported for {architecture} "
                         "(the experts run SwiGLU)")
    first_dense = int(hf_config.get("first_k_dense_replace", 0))
    if not 0 <= first_dense <= num_layers:
        raise ValueError(f"config field 'first_k_dense_replace' = {first_dense} is outside 0..{num_layers}")
    moe_layer_freq = hf_config.get("moe_layer_freq", 1)
    if moe_layer_freq != 1:
        raise ValueError(f"config field 'moe_layer_freq' = {moe_layer_freq!r} is unsupported (only 1: every layer "
                         "from first_k_dense_replace on is sparse, as transformers builds them)")
    grouped = topk_method != "greedy"
    return {"num_experts": int(_required(hf_config, "n_routed_experts")),
            "num_experts_per_tok": int(_required(hf_config, "num_experts_per_tok")),
            "moe_intermediate_size": int(_required(hf_config, "moe_intermediate_size")),
            "norm_topk_prob": bool(hf_config.get("norm_topk_prob", routing["norm_topk_prob"])),
            "mlp_only_layers": tuple(range(first_dense)),
            "n_shared_experts": int(hf_config.get("n_shared_experts") or 0),
            "scoring_func": scoring, "topk_method": topk_method,
            "n_group": int(hf_config.get("n_group") or 1) if grouped else 1,
            "topk_group": int(hf_config.get("topk_group") or 1) if grouped else 1,
            "routed_scaling_factor": float(hf_config.get("routed_scaling_factor",
                                                         routing["routed_scaling_factor"])),
            "expert_format": "fp8" if hf.fp8_weight_block(architecture, hf_config) else None}


def softmax_scale(mla: dict[str, Any], rope_scaling: dict | None, rope_source: dict) -> float:
    """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` under YaRN
    with ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``: DeepSeek scales every dim's scores, not only the
    rotated ones' cos/sin)."""
    scale = (mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]) ** -0.5
    mscale_all_dim = rope_source.get("mscale_all_dim")
    if rope_scaling is not None and mscale_all_dim:
        factor = rope_scaling["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def model_fields(architecture: str, hf_config: dict) -> dict[str, Any]:
    """Every ``ModelConfig`` field of a DeepSeek config but ``architecture`` and ``head``."""
    num_layers = int(_required(hf_config, "num_hidden_layers"))
    hidden_size = int(_required(hf_config, "hidden_size"))
    if hf_config.get("attention_bias"):
        raise ValueError("config field 'attention_bias' = True is unsupported for DeepSeek")
    if hf_config.get("mlp_bias"):
        raise ValueError("config field 'mlp_bias' = True is unsupported")
    mla = mla_fields(architecture, hf_config)
    rope_config = {"max_position_embeddings": _DEFAULTS[architecture]["max_position_embeddings"], **hf_config}
    rope = hf.parse_rope({**rope_config, "partial_rotary_factor": 1.0}, architecture, mla["qk_rope_head_dim"])
    source = hf.rope_source(rope_config)
    return {
        "vocab_size": int(_required(hf_config, "vocab_size")), "hidden_size": hidden_size,
        "intermediate_size": int(_required(hf_config, "intermediate_size")), "num_hidden_layers": num_layers,
        "num_attention_heads": int(_required(hf_config, "num_attention_heads")), "num_key_value_heads": 1,
        "head_dim": mla["kv_lora_rank"] + mla["qk_rope_head_dim"],
        "rope_theta": rope["rope_theta"], "rope_scaling": rope["rope_scaling"],
        "rotary_dim": mla["qk_rope_head_dim"],
        "attention_scale": softmax_scale(mla, rope["rope_scaling"], source),
        "rms_norm_eps": float(hf_config.get("rms_norm_eps", 1e-6)),
        "tie_word_embeddings": bool(hf_config.get("tie_word_embeddings", False)),
        "max_position_embeddings": int(rope_config["max_position_embeddings"] or 4096),
        "bos_token_id": hf_config.get("bos_token_id"), "eos_token_id": hf_config.get("eos_token_id"),
        "mla": mla, "moe": moe_fields(architecture, hf_config, num_layers),
        "fp8_weight_block": hf.fp8_weight_block(architecture, hf_config),
        "num_nextn_predict_layers": int(hf_config.get("num_nextn_predict_layers") or 0),
    }
