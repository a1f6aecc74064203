"""Flax NNX models of the Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3), the mixture-of-experts Qwen3-MoE and
Mixtral, and their checkpoint loader.

Public names are imported lazily so ``python -m models.smollm2`` and config-only users don't pay for jax/flax.
"""

import importlib

_EXPORTS = {
    "ModelConfig": "models.config",
    "LlamaForCausalLM": "models.llama",
    "Qwen3MoeForCausalLM": "models.architectures",
    "MixtralForCausalLM": "models.architectures",
    "model_class": "models.architectures",
    "AttentionFn": "models.llama",
    "dense_causal_attention": "models.attention",
    "load_model": "models.loader",
    "ensure_smollm2": "models.smollm2",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'models' has no attribute {name!r}")
