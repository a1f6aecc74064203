"""paged-jax: a vLLM-style paged LLM inference engine in JAX.

Public API (imported lazily so `import paged_jax` stays cheap):
``LLM``, ``SamplingParams``, ``StructuredOutputsParams``, ``BeamSearchParams``, ``EngineArgs``, ``RequestOutput``,
``CompletionOutput``, ``LoRARequest``, pooling's ``PoolingParams`` and ``*RequestOutput``s, ``generate``, and for
research code ``load_pretrained`` and ``score_tokens``.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "paged_jax.entrypoints.llm",
    "SamplingParams": "paged_jax.sampling_params",
    "StructuredOutputsParams": "paged_jax.sampling_params",
    "BeamSearchParams": "paged_jax.sampling_params",
    "EngineArgs": "paged_jax.config",
    "RequestOutput": "paged_jax.outputs",
    "CompletionOutput": "paged_jax.outputs",
    "LLMEngine": "paged_jax.engine.llm_engine",
    "LoRARequest": "paged_jax.lora.request",
    "generate": "paged_jax.research.generate",
    "load_pretrained": "paged_jax.research.scoring",
    "score_tokens": "paged_jax.research.scoring",
    "PoolingParams": "paged_jax.pooling.params",
    "PoolingRequestOutput": "paged_jax.pooling.outputs",
    "EmbeddingRequestOutput": "paged_jax.pooling.outputs",
    "ClassificationRequestOutput": "paged_jax.pooling.outputs",
    "ScoringRequestOutput": "paged_jax.pooling.outputs",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paged_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
