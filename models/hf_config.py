"""How a Hugging Face ``config.json`` describes the math of each supported family, read the way transformers reads
it (4.x and 5.x layouts): which layers slide and by how much, the RoPE of each layer kind, and each family's
multipliers, soft-caps and norms, and the experts of the mixture-of-experts families.
``models.config.ModelConfig.from_hf_config`` is the one caller.

A field that changes the math and that paged-jax does not implement is refused with a ValueError naming it.
"""

from __future__ import annotations

import math
from typing import Any

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", "GptOssForCausalLM", "DeepseekV2ForCausalLM",
                     "DeepseekV3ForCausalLM", "Llama4ForCausalLM")
DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# Architectures whose block-FP8 checkpoints load (``quantization_config`` fp8 with ``weight_block_size``): their
# experts stay in float8 (``MoeConfig.expert_format`` "fp8"), their other projections are dequantized at load.
BLOCK_FP8_ARCHITECTURES = (*DEEPSEEK_ARCHITECTURES, "Qwen3MoeForCausalLM")
_NO_WINDOW = ("LlamaForCausalLM", "GraniteForCausalLM", "Llama4ForCausalLM")
CHUNKED = "chunked_attention"
SLIDING, FULL = "sliding_attention", "full_attention"
_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
ROPE_TYPES = ("default", "llama3", "linear", "longrope", "yarn")
# Activations of the gated MLP: HF name -> the name models.llama uses.
HIDDEN_ACTS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# transformers' defaults where a family's differ from the Llama-like ones the parser assumes.
_FAMILY_DEFAULTS = {
    "Gemma2ForCausalLM": {"tie_word_embeddings": True, "sliding_window": 4096, "rope_theta": 10000.0},
    "Gemma3ForCausalLM": {"tie_word_embeddings": True, "sliding_window": 4096, "rope_theta": 1_000_000.0},
    "GptOssForCausalLM": {"sliding_window": 128, "rope_theta": 150000.0, "attention_bias": True},
    "Llama4ForCausalLM": {"rope_theta": 500000.0, "rms_norm_eps": 1e-5},
}
# Llama4TextConfig's defaults of the fields models.config.ModelConfig reads for Llama 4.
_LLAMA4_DEFAULTS = {"attention_chunk_size": 8192, "no_rope_layer_interval": 4, "use_qk_norm": True,
                    "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
                    "interleave_moe_layer_step": 1, "num_local_experts": 16, "num_experts_per_tok": 1,
                    "intermediate_size": 8192}
# gpt-oss's experts: transformers' defaults of the clamped SwiGLU (the published config.json omits the alpha).
GPT_OSS_SWIGLU_ALPHA, GPT_OSS_SWIGLU_LIMIT = 1.702, 7.0


def family_default(architecture: str, hf_config: dict, key: str, default: Any) -> Any:
    """``hf_config[key]`` when present (even None), else transformers' default for the family."""
    if key in hf_config:
        return hf_config[key]
    return _FAMILY_DEFAULTS.get(architecture, {}).get(key, default)


def layer_windows(architecture: str, hf_config: dict, num_layers: int) -> tuple[int | None, ...]:
    """Each layer's attention window in tokens (None: full causal attention), as transformers builds the layers.

    Mistral / Phi-3: ``sliding_window`` (if set) on every layer; Llama / Granite have none (transformers ignores
    the field there: a non-null one is refused). Qwen2 / Qwen3: only with
    ``use_sliding_window``, on layers ``i >= max_window_layers`` (or as ``layer_types`` says). Gemma 2: even layers
    slide; Gemma 3: every layer but each ``sliding_window_pattern``-th (default 6); ``layer_types`` overrides both.
    gpt-oss: even layers slide (default window 128) unless ``layer_types`` says otherwise.
    """
    window = family_default(architecture, hf_config, "sliding_window", None)
    if window is not None and architecture in _NO_WINDOW:
        raise ValueError(f"config field 'sliding_window' = {window!r} is unsupported for {architecture} "
                         "(transformers' model of it has no window)")
    if architecture == "Qwen3MoeForCausalLM" and hf_config.get("use_sliding_window", False):
        raise ValueError(f"config field 'use_sliding_window' = True is unsupported for {architecture}")
    if architecture.startswith("Qwen") and not hf_config.get("use_sliding_window", False):
        window = None
    if architecture == "Llama4ForCausalLM":  # chunked and full layers: llama4_fields
        return (None,) * num_layers
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"config field 'sliding_window' must be a positive int or null, got {window!r}")
    layer_types = hf_config.get("layer_types")
    if architecture.startswith("Qwen") and layer_types is None:
        first_sliding = int(hf_config.get("max_window_layers", 28))
        layer_types = [SLIDING if window is not None and i >= first_sliding else FULL for i in range(num_layers)]
    elif architecture == "Gemma2ForCausalLM" and layer_types is None:
        layer_types = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    elif architecture == "GptOssForCausalLM" and layer_types is None:
        layer_types = [SLIDING if (i + 1) % 2 else FULL for i in range(num_layers)]
    elif architecture == "Gemma3ForCausalLM" and layer_types is None:
        pattern = int(hf_config.get("sliding_window_pattern", 6))
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    elif layer_types is None or (architecture not in GEMMA_ARCHITECTURES + ("GptOssForCausalLM",)
                                 and not architecture.startswith("Qwen")):
        # transformers builds these families' layers alike and ignores layer_types: one that disagrees is refused.
        uniform = [SLIDING if window is not None else FULL] * num_layers
        if layer_types is not None and list(layer_types) != uniform:
            raise ValueError(f"config field 'layer_types' = {layer_types!r} is unsupported for {architecture}: "
                             "its layers all use 'sliding_window'")
        layer_types = uniform
    if len(layer_types) != num_layers or any(kind not in (SLIDING, FULL) for kind in layer_types):
        raise ValueError(f"config field 'layer_types' must list {num_layers} of {SLIDING!r} / {FULL!r}, got "
                         f"{layer_types!r}")
    if SLIDING in layer_types and window is None:
        raise ValueError("config field 'layer_types' names sliding_attention layers but 'sliding_window' is null")
    return tuple(window if kind == SLIDING else None for kind in layer_types)


def parse_rope(hf_config: dict, architecture: str, head_dim: int) -> dict[str, Any]:
    """RoPE fields of ``ModelConfig``: ``rope_theta``, ``rope_scaling`` (None or a dict, see ``ModelConfig``),
    ``local_rope_theta`` (Gemma 3's sliding layers) and ``rotary_dim``."""
    params = hf_config.get("rope_parameters")
    local_theta = None
    if architecture == "Gemma3ForCausalLM":
        local = {}
        if isinstance(params, dict) and (FULL in params or SLIDING in params):  # transformers 5: per layer type
            local, params = params.get(SLIDING) or {}, params.get(FULL)
        if _rope_type(local) not in (None, "default"):
            raise ValueError(f"config field 'rope_parameters.{SLIDING}' rope_type {_rope_type(local)!r} is "
                             "unsupported (only 'default')")
        local_theta = float(local.get("rope_theta", hf_config.get("rope_local_base_freq", 10000.0)))
    elif isinstance(params, dict) and (FULL in params or SLIDING in params):
        raise ValueError(f"config field 'rope_parameters' per layer type is unsupported for {architecture}")
    source = rope_source(hf_config, params)
    theta = source.get("rope_theta", family_default(architecture, hf_config, "rope_theta", 10000.0))
    partial = float(source.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)
    if partial != 1.0 and architecture != "Phi3ForCausalLM":
        raise ValueError(f"config field 'partial_rotary_factor' = {partial} is unsupported for {architecture}")
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(f"config field 'partial_rotary_factor' = {partial} gives an odd or empty rotary dim")
    return {"rope_theta": float(theta), "local_rope_theta": local_theta,
            "rope_scaling": _rope_scaling(source, hf_config, rotary_dim),
            "rotary_dim": None if rotary_dim == head_dim else rotary_dim}


def rope_source(hf_config: dict, params: Any = None) -> dict:
    """The RoPE fields of one layer kind: ``params`` (default: ``rope_parameters``) with a transformers-4
    ``rope_scaling`` dict merged in when ``params`` names no scaling."""
    params = hf_config.get("rope_parameters") if params is None else params
    source = params if isinstance(params, dict) else {}
    legacy = hf_config.get("rope_scaling")
    if isinstance(legacy, dict) and _rope_type(source) in (None, "default"):
        source = {**source, **legacy}
    return source


def _rope_scaling(source: dict, hf_config: dict, rotary_dim: int) -> dict | None:
    rope_type = _rope_type(source)
    if rope_type in ("su", "yarn") and "long_factor" in source:  # Phi-3's old names of LongRoPE (as transformers)
        rope_type = "longrope"
    if rope_type in (None, "default"):
        return None
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"config rope scaling type {rope_type!r} (rope_scaling / rope_parameters) is unsupported; "
                         f"supported: {', '.join(ROPE_TYPES)}")
    if rope_type == "linear":
        return {"rope_type": "linear", "factor": float(_rope_key(source, "factor", rope_type))}
    if rope_type == "llama3":
        scaling = {"rope_type": "llama3"}
        for key in _LLAMA3_ROPE_KEYS:
            scaling[key] = float(_rope_key(source, key, rope_type))
        scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
        return scaling
    if rope_type == "yarn":
        return _yarn(source, hf_config)
    return _longrope(source, hf_config, rotary_dim)


def _yarn(source: dict, hf_config: dict) -> dict:
    """YaRN (gpt-oss): ``factor``, ``original_max_position_embeddings``, ``beta_fast`` / ``beta_slow`` (default 32 /
    1), ``truncate`` (default True) and the cos/sin ``attention_factor`` (default ``0.1 ln(factor) + 1``; with
    ``mscale`` and ``mscale_all_dim`` their ratio), as transformers' ``_compute_yarn_parameters``."""
    original = source.get("original_max_position_embeddings")
    if original is None:
        raise ValueError("config yarn rope scaling is missing 'original_max_position_embeddings'")
    factor = source.get("factor")
    factor = float(hf_config.get("max_position_embeddings") or 4096) / int(original) if factor is None \
        else float(factor)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = source.get("attention_factor")
    if attention_factor is None:
        m, m_all = source.get("mscale"), source.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(original),
            "beta_fast": float(source.get("beta_fast") or 32), "beta_slow": float(source.get("beta_slow") or 1),
            "truncate": bool(source.get("truncate", True)), "attention_factor": float(attention_factor)}


def _longrope(source: dict, hf_config: dict, rotary_dim: int) -> dict:
    """LongRoPE (Phi-3 / Phi-4): per-frequency short and long factors and the cos/sin attention factor
    (transformers' ``_compute_longrope_parameters``). ``use_long_factors`` starts as vLLM's choice for a
    ``max_model_len`` of ``max_position_embeddings``; ``ModelConfig.for_max_model_len`` revises it."""
    original = source.get("original_max_position_embeddings", hf_config.get("original_max_position_embeddings"))
    if original is None:
        raise ValueError("config longrope scaling is missing 'original_max_position_embeddings'")
    original = int(original)
    max_positions = int(hf_config.get("max_position_embeddings") or 4096)
    factors = {}
    for key in ("short_factor", "long_factor"):
        values = _rope_key(source, key, "longrope")
        if not isinstance(values, (list, tuple)) or len(values) != rotary_dim // 2:
            raise ValueError(f"config longrope '{key}' must list {rotary_dim // 2} numbers, got {values!r}")
        factors[key] = tuple(float(v) for v in values)
    factor = source.get("factor")
    factor = max_positions / original if factor is None else float(factor)
    attention_factor = source.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {"rope_type": "longrope", **factors, "original_max_position_embeddings": original,
            "attention_factor": float(attention_factor), "use_long_factors": max_positions > original}


def _rope_key(source: dict, key: str, rope_type: str):
    if source.get(key) is None:
        raise ValueError(f"config {rope_type} rope scaling is missing {key!r}")
    return source[key]


def _rope_type(params: dict | None) -> str | None:
    if not params:
        return None
    return params.get("rope_type", params.get("type"))


def family_options(architecture: str, hf_config: dict) -> dict[str, Any]:
    """The fields of ``ModelConfig`` beyond the Llama shape: activation, norms, scales, soft-caps, multipliers."""
    gemma = architecture in GEMMA_ARCHITECTURES
    act_key = "hidden_activation" if gemma else "hidden_act"
    hidden_act = hf_config.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
    if hidden_act not in HIDDEN_ACTS:
        raise ValueError(f"config field {act_key!r} = {hidden_act!r} is unsupported (supported: "
                         f"{', '.join(HIDDEN_ACTS)})")
    options: dict[str, Any] = {"hidden_act": HIDDEN_ACTS[hidden_act]}
    if gemma:
        if hf_config.get("use_bidirectional_attention"):
            raise ValueError("config field 'use_bidirectional_attention' = True is unsupported")
        attn_cap = hf_config.get("attn_logit_softcapping", 50.0 if architecture == "Gemma2ForCausalLM" else None)
        if architecture == "Gemma3ForCausalLM" and attn_cap is not None:
            # transformers' Gemma 3 attention never applies it: refused rather than guessed.
            raise ValueError(f"config field 'attn_logit_softcapping' = {attn_cap} is unsupported for Gemma 3")
        final_cap = hf_config.get("final_logit_softcapping", 30.0 if architecture == "Gemma2ForCausalLM" else None)
        options.update(
            attention_scale=float(hf_config.get("query_pre_attn_scalar", 256)) ** -0.5,
            attn_logit_softcapping=None if attn_cap is None else float(attn_cap),
            final_logit_softcapping=None if final_cap is None else float(final_cap),
            norm_unit_offset=True, sandwich_norms=True, embedding_multiplier=float(hf_config["hidden_size"]) ** 0.5)
    elif architecture == "GraniteForCausalLM":
        options.update(
            attention_scale=float(hf_config.get("attention_multiplier", 1.0)),
            embedding_multiplier=float(hf_config.get("embedding_multiplier", 1.0)),
            residual_multiplier=float(hf_config.get("residual_multiplier", 1.0)),
            logits_scaling=float(hf_config.get("logits_scaling", 1.0)))
    else:
        _refuse_foreign_fields(architecture, hf_config)
    return options


# Fields that change the math in the families that define them; any other family's config carrying one with a
# non-neutral value is refused (transformers would ignore it there, but the checkpoint likely expects it).
_FOREIGN_FIELDS = {"query_pre_attn_scalar": None, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                   "embedding_multiplier": 1.0, "residual_multiplier": 1.0, "logits_scaling": 1.0,
                   "attention_multiplier": None}


def _refuse_foreign_fields(architecture: str, hf_config: dict) -> None:
    for key, neutral in _FOREIGN_FIELDS.items():
        value = hf_config.get(key, neutral)
        if value is not None and value != neutral:
            raise ValueError(f"config field {key!r} = {value!r} is unsupported for {architecture}")


def moe_fields(architecture: str, hf_config: dict, num_layers: int) -> dict[str, Any] | None:
    """The fields of ``models.config.MoeConfig`` of a mixture-of-experts config (None for a dense family);
    ValueError naming a field the experts do not implement."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    if architecture == "Llama4ForCausalLM":
        return _llama4_experts(hf_config, num_layers)
    # Hub checkpoints name the expert count "num_experts" (Qwen3-MoE) or "num_local_experts" (Mixtral, and
    # transformers 5 for both).
    num_experts = hf_config.get("num_experts", hf_config.get("num_local_experts"))
    if num_experts is None:
        raise ValueError("config is missing required field 'num_experts' (or 'num_local_experts')")
    if hf_config.get("num_experts_per_tok") is None:
        raise ValueError("config is missing required field 'num_experts_per_tok'")
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config field 'hidden_act' = {hf_config['hidden_act']!r} is unsupported for {architecture} "
                         "(the experts run SwiGLU)")
    fields = {"num_experts": int(num_experts), "num_experts_per_tok": int(hf_config["num_experts_per_tok"])}
    if architecture == "GptOssForCausalLM":
        return {**fields, **_gpt_oss_experts(hf_config)}
    if architecture == "MixtralForCausalLM":
        # Mixtral: every layer sparse, experts as wide as intermediate_size, top-k weights always renormalized
        # (router_jitter_noise only applies in training).
        return {**fields, "moe_intermediate_size": int(hf_config["intermediate_size"]), "norm_topk_prob": True}
    for field in ("shared_expert_intermediate_size", "num_shared_experts", "n_shared_experts"):
        if hf_config.get(field):
            raise ValueError(f"config field {field!r} = {hf_config[field]!r} is unsupported (no shared experts)")
    if hf_config.get("moe_intermediate_size") is None:
        raise ValueError("config is missing required field 'moe_intermediate_size'")
    mlp_only_layers = hf_config.get("mlp_only_layers") or []
    if not isinstance(mlp_only_layers, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in mlp_only_layers):
        raise ValueError(f"config field 'mlp_only_layers' must be a list of layer indices, got {mlp_only_layers!r}")
    outside = [i for i in mlp_only_layers if not 0 <= i < num_layers]
    if outside:
        raise ValueError(f"config field 'mlp_only_layers' names layers {outside} outside the model's {num_layers}")
    sparse_step = hf_config.get("decoder_sparse_step", 1)
    if not isinstance(sparse_step, int) or isinstance(sparse_step, bool) or sparse_step <= 0:
        raise ValueError(f"config field 'decoder_sparse_step' must be a positive int, got {sparse_step!r}")
    return {**fields, "moe_intermediate_size": int(hf_config["moe_intermediate_size"]),
            "norm_topk_prob": bool(hf_config.get("norm_topk_prob", False)), "decoder_sparse_step": sparse_step,
            "mlp_only_layers": tuple(sorted(set(mlp_only_layers))),
            "expert_format": "fp8" if fp8_weight_block(architecture, hf_config) else None}


def fp8_weight_block(architecture: str, hf_config: dict) -> tuple[int, int] | None:
    """A ``BLOCK_FP8_ARCHITECTURES`` config's block-FP8 weights (``quantization_config`` fp8 with
    ``weight_block_size``, as DeepSeek-V3 and Qwen3-MoE FP8 publish them): ``weight_block_size``, else None for an
    unquantized checkpoint or another architecture; ValueError naming the field for any other quantization of one."""
    quant = hf_config.get("quantization_config")
    if quant is None or architecture not in BLOCK_FP8_ARCHITECTURES:
        return None
    method = str(quant.get("quant_method", "")).lower()
    block = quant.get("weight_block_size")
    if method != "fp8" or not isinstance(block, (list, tuple)) or len(block) != 2:
        raise ValueError(f"config field 'quantization_config' ({method or quant!r}, weight_block_size={block!r}) is "
                         f"unsupported for {architecture}: only block-FP8 (quant_method 'fp8' with weight_block_size)")
    if str(quant.get("fmt", "e4m3")).lower() != "e4m3":
        raise ValueError(f"config field 'quantization_config.fmt' = {quant['fmt']!r} is unsupported (only e4m3)")
    return int(block[0]), int(block[1])


def _llama4(hf_config: dict, key: str):
    """A Llama 4 text config's field as Llama4TextConfig reads it (its default when absent or null)."""
    value = hf_config.get(key)
    return _LLAMA4_DEFAULTS[key] if value is None else value


def _llama4_experts(hf_config: dict, num_layers: int) -> dict[str, Any]:
    """Llama 4's sparse layers: ``moe_layers`` (default every ``interleave_moe_layer_step``-th layer, as
    Llama4TextConfig), experts and the shared expert ``intermediate_size`` wide, the sigmoid router on the inputs."""
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config field 'hidden_act' = {hf_config['hidden_act']!r} is unsupported for "
                         "Llama4ForCausalLM (the experts run SwiGLU)")
    step = _llama4(hf_config, "interleave_moe_layer_step")
    if not isinstance(step, int) or isinstance(step, bool) or step <= 0:
        raise ValueError(f"config field 'interleave_moe_layer_step' must be a positive int, got {step!r}")
    moe_layers = hf_config.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, num_layers, step))
    if not isinstance(moe_layers, (list, tuple)) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in moe_layers):
        raise ValueError(f"config field 'moe_layers' must list layer indices below {num_layers}, got {moe_layers!r}")
    inter = int(_llama4(hf_config, "intermediate_size"))
    return {"num_experts": int(_llama4(hf_config, "num_local_experts")),
            "num_experts_per_tok": int(_llama4(hf_config, "num_experts_per_tok")), "moe_intermediate_size": inter,
            "norm_topk_prob": False, "mlp_only_layers": tuple(i for i in range(num_layers) if i not in moe_layers),
            "router": "sigmoid_input", "shared_expert_intermediate_size": inter}


def llama4_fields(architecture: str, hf_config: dict, num_layers: int) -> dict[str, Any]:
    """Llama 4's fields of ``models.config.ModelConfig`` (empty for other families), as Llama4TextConfig and
    transformers' Llama4TextAttention read them: ``no_rope_layers`` (1: RoPE; default a NoPE layer every
    ``no_rope_layer_interval``-th), ``layer_types`` (default: the RoPE layers chunked when ``attention_chunk_size``
    is set, the others full), ``use_qk_norm`` on the RoPE layers, the NoPE layers' attention temperature."""
    if architecture != "Llama4ForCausalLM":
        return {}
    interval = _llama4(hf_config, "no_rope_layer_interval")
    use_rope = hf_config.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(num_layers)]
    if len(use_rope) < num_layers or any(flag not in (0, 1) for flag in use_rope):
        raise ValueError(f"config field 'no_rope_layers' must list 0 or 1 for each of the {num_layers} layers, "
                         f"got {use_rope!r}")
    chunk = hf_config.get("attention_chunk_size", _LLAMA4_DEFAULTS["attention_chunk_size"])
    layer_types = hf_config.get("layer_types") or [
        CHUNKED if use_rope[i] and chunk is not None else FULL for i in range(num_layers)]
    if len(layer_types) != num_layers or any(kind not in (CHUNKED, FULL) for kind in layer_types):
        raise ValueError(f"config field 'layer_types' must list {num_layers} of {CHUNKED!r} / {FULL!r} for "
                         f"Llama4ForCausalLM, got {layer_types!r}")
    if CHUNKED in layer_types and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
        raise ValueError(f"config field 'attention_chunk_size' must be a positive int for chunked_attention "
                         f"layers, got {chunk!r}")
    nope_layers = tuple(i for i in range(num_layers) if not use_rope[i])
    tuning = bool(_llama4(hf_config, "attn_temperature_tuning")) and bool(nope_layers)
    return {"layer_attention_chunks": tuple(chunk if kind == CHUNKED else None for kind in layer_types),
            "nope_layers": nope_layers, "rope_interleaved": True, "qk_l2_norm": bool(_llama4(hf_config, "use_qk_norm")),
            "attn_temperature": (float(_llama4(hf_config, "floor_scale")), float(_llama4(hf_config, "attn_scale")))
            if tuning else None}


def _gpt_oss_experts(hf_config: dict) -> dict[str, Any]:
    """gpt-oss: every layer sparse, experts as wide as ``intermediate_size``, the softmax over the top-k router
    logits (what renormalized top-k probabilities are), the clamped SwiGLU, and the experts' storage:
    ``quantization_config.quant_method`` "mxfp4" (as published) or none (bf16 experts)."""
    quant = hf_config.get("quantization_config")
    expert_format = None
    if quant is not None:
        method = str(quant.get("quant_method", "")).lower()
        if method != "mxfp4":
            raise ValueError(f"quantization: {method or repr(quant)} is not supported for GptOssForCausalLM (its "
                             "experts load as published in mxfp4, or unquantized)")
        expert_format = "mxfp4"
    return {"moe_intermediate_size": int(hf_config["intermediate_size"]), "norm_topk_prob": True,
            "swiglu_alpha": float(hf_config.get("swiglu_alpha", GPT_OSS_SWIGLU_ALPHA)),
            "swiglu_limit": float(hf_config.get("swiglu_limit", GPT_OSS_SWIGLU_LIMIT)),
            "expert_format": expert_format}


# A supported decoder's pooling checkpoints (transformers' names): its base model (``AutoModel``: hidden states, no
# head; what sentence-transformers saves) and its sequence-classification model (a ``score`` linear head).
POOLING_SUFFIXES = {"Model": "none", "ForSequenceClassification": "score"}


def pooling_base(architecture: str) -> tuple[str, str] | None:
    """``(the decoder's ForCausalLM architecture, head)`` of a pooling architecture name (``Qwen3Model`` ->
    ``("Qwen3ForCausalLM", "none")``, ``Qwen3ForSequenceClassification`` -> ``(..., "score")``); None otherwise."""
    for suffix, head in POOLING_SUFFIXES.items():
        if architecture.endswith(suffix):
            return architecture[:-len(suffix)] + "ForCausalLM", head
    return None


def num_labels(hf_config: dict) -> int:
    """A sequence-classification config's output count, as transformers reads it (``id2label``, else
    ``num_labels``, default 2)."""
    id2label = hf_config.get("id2label")
    return len(id2label) if id2label else int(hf_config.get("num_labels", 2))
