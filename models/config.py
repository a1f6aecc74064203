"""Model configuration for the Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3) and its mixture-of-experts
relatives (Qwen3-MoE, Mixtral).

``ModelConfig`` is the one description of a model shape that the rest of paged-jax uses; it is built from a Hugging
Face ``config.json`` dict (transformers 4.x or 5.x layout).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")

# model_type -> architecture, for configs that omit "architectures".
_MODEL_TYPE_TO_ARCHITECTURE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}

_LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP of a mixture-of-experts model (HF field names).

    Each token's router logits (``[num_experts]``) go through a float32 softmax; the ``num_experts_per_tok`` largest
    probabilities pick the experts, renormalized to sum to 1 when ``norm_topk_prob``; the layer's output is their
    weighted sum of the experts' SwiGLU MLPs (``moe_intermediate_size`` wide). Layer ``i`` is sparse when
    ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0`` (Qwen3-MoE), else a dense MLP of the model's
    ``intermediate_size``.
    """

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
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
class ModelConfig:
    """Shape and numerics of one decoder-only model.

    ``rope_scaling`` is None (plain RoPE) or a dict with ``rope_type == "llama3"`` and the keys
    ``factor, low_freq_factor, high_freq_factor, original_max_position_embeddings``.
    ``attention_bias`` means q/k/v projections carry a bias (Qwen2 always; Llama/Qwen3 when configured);
    ``o_proj_bias`` means the output projection does too (Llama/Qwen3 ``attention_bias=True``).
    ``qk_norm`` is Qwen3's per-head RMSNorm on q and k before RoPE.
    ``sliding_window`` is the attention window in tokens, or None for full causal attention.
    ``moe`` is the sparse MLP of a mixture-of-experts architecture (``MOE_ARCHITECTURES``), None for dense ones.
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
    moe: MoeConfig | None = None

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
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type != "llama3":
                raise ValueError(f"ModelConfig.rope_scaling: unsupported rope_type {rope_type!r} (only 'llama3')")
            missing = [k for k in _LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
            if missing:
                raise ValueError(f"ModelConfig.rope_scaling (llama3) is missing keys {missing}")

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
    def eos_token_ids(self) -> list[int]:
        """EOS ids as a list (empty when unknown)."""
        if self.eos_token_id is None:
            return []
        if isinstance(self.eos_token_id, int):
            return [self.eos_token_id]
        return list(self.eos_token_id)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` dict (transformers 4 ``rope_scaling``/``rope_theta`` or
        transformers 5 ``rope_parameters`` layout)."""
        architectures = hf_config.get("architectures") or []
        if architectures:
            architecture = architectures[0]
        else:
            model_type = hf_config.get("model_type")
            if model_type not in _MODEL_TYPE_TO_ARCHITECTURE:
                raise ValueError(
                    f"unsupported architecture: config has no 'architectures' and model_type {model_type!r}; "
                    f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
                )
            architecture = _MODEL_TYPE_TO_ARCHITECTURE[model_type]
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def required(key: str):
            if hf_config.get(key) is None:
                raise ValueError(f"config is missing required field {key!r}")
            return hf_config[key]

        hidden_act = hf_config.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"config field 'hidden_act' = {hidden_act!r} is unsupported (only 'silu')")
        if hf_config.get("mlp_bias"):
            raise ValueError("config field 'mlp_bias' = True is unsupported")

        hidden_size = int(required("hidden_size"))
        num_heads = int(required("num_attention_heads"))
        num_kv_heads = hf_config.get("num_key_value_heads")
        num_kv_heads = num_heads if num_kv_heads is None else int(num_kv_heads)
        head_dim = hf_config.get("head_dim")
        head_dim = hidden_size // num_heads if head_dim is None else int(head_dim)

        rope_theta, rope_scaling = _parse_rope(hf_config)

        configured_bias = bool(hf_config.get("attention_bias", False))
        if architecture == "Qwen2ForCausalLM":
            attention_bias, o_proj_bias = True, False  # Qwen2: q/k/v bias always, o_proj never
        else:
            attention_bias, o_proj_bias = configured_bias, configured_bias

        sliding_window = hf_config.get("sliding_window")
        if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
            # Qwen only applies the window when use_sliding_window is set; per-layer windows are not supported.
            if not hf_config.get("use_sliding_window", False):
                sliding_window = None
            else:
                raise ValueError("config field 'use_sliding_window' = True is unsupported for Qwen models")
        sliding_window = None if sliding_window is None else int(sliding_window)

        return cls(
            architecture=architecture,
            vocab_size=int(required("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(required("intermediate_size")),
            num_hidden_layers=int(required("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            max_position_embeddings=int(hf_config.get("max_position_embeddings") or 4096),
            sliding_window=sliding_window,
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_id=hf_config.get("eos_token_id"),
            o_proj_bias=o_proj_bias,
            moe=_parse_moe(architecture, hf_config),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike) -> "ModelConfig":
        """Read ``<model_dir>/config.json``; FileNotFoundError naming the path when absent."""
        config_path = Path(model_dir) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"model config not found: {config_path}")
        with open(config_path) as f:
            return cls.from_hf_config(json.load(f))


def _parse_rope(hf_config: dict[str, Any]) -> tuple[float, dict | None]:
    """Return (rope_theta, rope_scaling or None) from either config layout."""
    rope_parameters = hf_config.get("rope_parameters")
    rope_scaling_raw = hf_config.get("rope_scaling")
    rope_theta = hf_config.get("rope_theta")
    scaling_source = None
    if isinstance(rope_parameters, dict):
        if rope_theta is None:
            rope_theta = rope_parameters.get("rope_theta")
        scaling_source = rope_parameters
    if isinstance(rope_scaling_raw, dict) and (scaling_source is None or
                                               _rope_type(scaling_source) in (None, "default")):
        scaling_source = rope_scaling_raw
    rope_theta = 10000.0 if rope_theta is None else float(rope_theta)

    if scaling_source is None:
        return rope_theta, None
    rope_type = _rope_type(scaling_source)
    if rope_type in (None, "default"):
        return rope_theta, None
    if rope_type != "llama3":
        raise ValueError(f"config rope scaling type {rope_type!r} is unsupported (only 'llama3' and default)")
    missing = [k for k in _LLAMA3_ROPE_KEYS if k not in scaling_source]
    if missing:
        raise ValueError(f"config llama3 rope scaling is missing keys {missing}")
    rope_scaling = {"rope_type": "llama3"}
    for key in _LLAMA3_ROPE_KEYS:
        rope_scaling[key] = float(scaling_source[key])
    rope_scaling["original_max_position_embeddings"] = int(scaling_source["original_max_position_embeddings"])
    return rope_theta, rope_scaling


def _parse_moe(architecture: str, hf_config: dict[str, Any]) -> MoeConfig | None:
    """The ``MoeConfig`` of a mixture-of-experts config (None for a dense architecture); ValueError naming a field
    the experts do not implement."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    # Hub checkpoints name the expert count "num_experts" (Qwen3-MoE) or "num_local_experts" (Mixtral, and
    # transformers 5 for both).
    num_experts = hf_config.get("num_experts", hf_config.get("num_local_experts"))
    if num_experts is None:
        raise ValueError("config is missing required field 'num_experts' (or 'num_local_experts')")
    if hf_config.get("num_experts_per_tok") is None:
        raise ValueError("config is missing required field 'num_experts_per_tok'")
    if architecture == "MixtralForCausalLM":
        # Mixtral: every layer sparse, experts as wide as intermediate_size, top-k weights always renormalized
        # (router_jitter_noise only applies in training).
        return MoeConfig(num_experts=int(num_experts), num_experts_per_tok=int(hf_config["num_experts_per_tok"]),
                         moe_intermediate_size=int(hf_config["intermediate_size"]), norm_topk_prob=True)
    for field in ("shared_expert_intermediate_size", "num_shared_experts", "n_shared_experts"):
        if hf_config.get(field):
            raise ValueError(f"config field {field!r} = {hf_config[field]!r} is unsupported (no shared experts)")
    if hf_config.get("moe_intermediate_size") is None:
        raise ValueError("config is missing required field 'moe_intermediate_size'")
    mlp_only_layers = hf_config.get("mlp_only_layers") or []
    if not isinstance(mlp_only_layers, (list, tuple)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in mlp_only_layers):
        raise ValueError(f"config field 'mlp_only_layers' must be a list of layer indices, got {mlp_only_layers!r}")
    num_layers = int(hf_config["num_hidden_layers"])
    outside = [i for i in mlp_only_layers if not 0 <= i < num_layers]
    if outside:
        raise ValueError(f"config field 'mlp_only_layers' names layers {outside} outside the model's {num_layers}")
    sparse_step = hf_config.get("decoder_sparse_step", 1)
    if not isinstance(sparse_step, int) or isinstance(sparse_step, bool) or sparse_step <= 0:
        raise ValueError(f"config field 'decoder_sparse_step' must be a positive int, got {sparse_step!r}")
    return MoeConfig(num_experts=int(num_experts), num_experts_per_tok=int(hf_config["num_experts_per_tok"]),
                     moe_intermediate_size=int(hf_config["moe_intermediate_size"]),
                     norm_topk_prob=bool(hf_config.get("norm_topk_prob", False)),
                     decoder_sparse_step=sparse_step, mlp_only_layers=tuple(sorted(set(mlp_only_layers))))


def _rope_type(params: dict) -> str | None:
    return params.get("rope_type", params.get("type"))
