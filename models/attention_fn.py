"""The model's side of attention: the ``AttentionFn`` contract, ``ReusableAttention`` (one trace for all layers) and
``LayerAttention``, the per-layer attention options of models whose layers differ (sliding-window, chunked and full
layers, a softmax scale other than ``head_dim ** -0.5``, logit soft-capping).

An attention built from the config alone applies ``sm_scale = head_dim ** -0.5`` and ``config.sliding_window`` to
every layer (``LayerAttention.model_default``). When some layer of the model needs other options
(``needs_layer_attention``), the model passes each layer's as keywords ``sm_scale=, sliding_window=,
logit_soft_cap=`` (and ``attention_chunk_size=`` for a chunked layer, Llama 4) to an attention whose
``takes_layer_attention`` attribute is true, and refuses any other attention with a ValueError: the options are never
dropped.

Attention sinks (``ModelConfig.attention_sinks``, gpt-oss) are weights, not static options: the model passes each
layer's ``sinks=`` (``[Hq]``, one logit per query head joining the softmax's denominator) to an attention whose
``takes_attention_sinks`` attribute is true, and refuses any other.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from models.config import ModelConfig
from models.qk_transform import QKTransform

# attention(layer_idx, q[T,Hq,D], k[T,Hkv,D], v[T,Hkv,D], kv_layer) -> (out[T,Hq,D], kv_layer). One whose attribute
# ``fuses_qk_transform`` is true is called with the un-normed, un-rotated q/k and ``qk_transform=QKTransform`` and
# applies the transform itself (models.qk_transform); the model applies it before any other attention. One whose
# attribute ``takes_layer_attention`` is true also takes ``sm_scale=, sliding_window=, logit_soft_cap=`` keywords
# (``LayerAttention.as_kwargs``), which override what it was built with. One whose attribute ``takes_attention_sinks``
# is true takes ``sinks=`` ([Hq] logits) for a model with attention sinks.
AttentionFn = Callable[[int, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class LayerAttention:
    """One layer's attention options (static, hashable).

    Fields:
      sm_scale: the factor on ``q . k``.
      sliding_window: the window in tokens (a query at ``p`` sees keys ``p - window < j <= p``), or None (causal).
      logit_soft_cap: None, or ``cap`` of ``cap * tanh(s / cap)`` on the scaled scores (Gemma 2).
      attention_chunk_size: None, or the chunk in tokens of chunked local attention (Llama 4): a query at ``p``
        sees keys ``p // chunk * chunk <= j <= p`` (``models.config.AttentionChunk``).
    """

    sm_scale: float
    sliding_window: int | None = None
    logit_soft_cap: float | None = None
    attention_chunk_size: int | None = None

    @classmethod
    def for_layer(cls, config: ModelConfig, layer_idx: int) -> "LayerAttention":
        """Layer ``layer_idx``'s options under ``config``."""
        return cls(config.softmax_scale, config.layer_windows[layer_idx], config.attn_logit_softcapping,
                   config.layer_chunks[layer_idx])

    @classmethod
    def model_default(cls, config: ModelConfig) -> "LayerAttention":
        """What an attention built from ``config`` alone applies to every layer."""
        return cls(config.head_dim ** -0.5, config.sliding_window)

    def as_kwargs(self) -> dict[str, Any]:
        """The keywords of the attention call; ``attention_chunk_size`` only for a chunked layer (the attentions
        of models without chunks need not take it)."""
        kwargs = dataclasses.asdict(self)
        if self.attention_chunk_size is None:
            del kwargs["attention_chunk_size"]
        return kwargs


def needs_layer_attention(config: ModelConfig) -> bool:
    """Whether some layer of ``config`` attends otherwise than ``LayerAttention.model_default``."""
    default = LayerAttention.model_default(config)
    return any(LayerAttention.for_layer(config, i) != default for i in range(config.num_hidden_layers))


def check_takes_layer_attention(config: ModelConfig, attention: AttentionFn) -> None:
    """ValueError when ``config``'s layers need their own options and ``attention`` cannot take them."""
    if needs_layer_attention(config) and not getattr(attention, "takes_layer_attention", False):
        raise ValueError(
            f"{config.architecture}: the layers attend with their own sliding window / attention chunk / softmax "
            f"scale / logit soft-cap, which this attention ({type(attention).__name__}) does not take (it needs a true "
            "'takes_layer_attention' attribute and sm_scale / sliding_window / logit_soft_cap keywords)")


def check_takes_attention_sinks(config: ModelConfig, attention: AttentionFn) -> None:
    """ValueError when ``config``'s layers have attention sinks and ``attention`` cannot take them."""
    if config.attention_sinks and not getattr(attention, "takes_attention_sinks", False):
        raise ValueError(
            f"{config.architecture}: the layers attend with attention sinks (a per-head logit in the softmax), "
            f"which this attention ({type(attention).__name__}) does not take (it needs a true "
            "'takes_attention_sinks' attribute and a sinks= keyword)")


@jax.tree_util.register_pytree_node_class
class ReusableAttention:
    """An ``AttentionFn`` whose per-call data is a pytree and whose code is one static function.

    Because it closes over no traced values, ``LlamaForCausalLM`` traces its decoder layer once (a nested jit) and
    calls that trace for every layer, instead of tracing each of the N layers inline: start-up compiles one
    executable per step shape (per distinct kind of layer), and tracing was most of the time each took. XLA inlines
    the nested calls, so the compiled program is the same.

    Args:
      fn: ``fn(metadata, q, k, v, kv_layer) -> (out, kv_layer)``; static (part of the pytree structure, compared by
        identity), so build it once per forward (e.g. a ``functools.partial`` of a module-level function). For a
        model whose layers differ it must also take ``sm_scale=, sliding_window=, logit_soft_cap=`` keywords
        (``paged_jax.ops.write_and_attend`` does): this attention declares ``takes_layer_attention``; for a model
        with attention sinks a ``sinks=`` keyword too (``takes_attention_sinks``).
      metadata: a pytree of arrays (block tables, lengths, ...), the same for every layer of one forward.
      fuses_qk_transform: ``fn`` takes a ``qk_transform=`` keyword (``models.qk_transform.QKTransform``) and
        applies it to q/k itself (see ``AttentionFn``); static.
    A reusable attention is called with ``layer_idx=None``: it must not depend on the layer beyond the options.
    """

    takes_layer_attention = True
    takes_attention_sinks = True

    def __init__(self, fn: Callable, metadata: Any, *, fuses_qk_transform: bool = False):
        self.fn = fn
        self.metadata = metadata
        self.fuses_qk_transform = fuses_qk_transform

    def __call__(self, layer_idx, q, k, v, kv_layer, qk_transform: QKTransform | None = None, **layer_attention):
        if qk_transform is not None:
            layer_attention["qk_transform"] = qk_transform
        return self.fn(self.metadata, q, k, v, kv_layer, **layer_attention)

    def tree_flatten(self):
        return (self.metadata,), (self.fn, self.fuses_qk_transform)

    @classmethod
    def tree_unflatten(cls, static, children):
        fn, fuses_qk_transform = static
        return cls(fn, children[0], fuses_qk_transform=fuses_qk_transform)
