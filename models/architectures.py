"""The model class of each supported architecture (``models.config.SUPPORTED_ARCHITECTURES``).

The dense ones (Llama, Mistral, Qwen2, Qwen3) are ``LlamaForCausalLM``; the mixture-of-experts ones are its
subclasses below, whose sparse decoder layers carry a ``models.moe.SparseMoeBlock`` in place of the dense MLP (the
layer structure follows ``ModelConfig.moe``, so a tensor-parallel or pipelined model of the same config has the same
layers). Build a model of a config with ``model_class(config)(config, ...)``.
"""

from __future__ import annotations

from flax import nnx

from models.config import SUPPORTED_ARCHITECTURES, ModelConfig
from models.llama import LlamaForCausalLM


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


_MOE_CLASSES = {cls.architecture: cls for cls in (Qwen3MoeForCausalLM, MixtralForCausalLM)}


def model_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that runs ``config.architecture``."""
    if config.architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {config.architecture!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    return _MOE_CLASSES.get(config.architecture, LlamaForCausalLM)
