"""What a step of a mixture-of-experts model gives back besides its samples, when asked (static options of the
compiled step: off, nothing is traced, computed or fetched for them):

* ``routed_experts`` (``--enable-return-routed-experts``): every forwarded token's top-k expert ids at every sparse
  layer, ``uint8 | uint16[T, num_sparse_layers, top_k]`` (``models.moe_routing.routing_dtype``), split per step row on
  the host (``StepOutput.routed_experts``);
* ``expert_load`` (``--enable-expert-load-metrics``): tokens routed to each expert of each sparse layer over the
  step's real tokens, ``int32[num_sparse_layers, E]`` (``StepOutput.expert_load``).

The sparse layers record their routing as ``nnx.Intermediate`` values (``models.moe_routing``), which a layer traced
apart (``models.llama.ReusableAttention``'s nested jit) would keep to itself: a capturing single-device step runs its
layers inline (``inline_attention``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from models.moe_routing import expert_load, pop_routed_experts, routing_dtype


@dataclasses.dataclass(frozen=True)
class MoeStepOutputs:
    """Which routing outputs the compiled step returns (see the module docstring)."""

    routed_experts: bool = False
    expert_load: bool = False

    @property
    def any(self) -> bool:
        return self.routed_experts or self.expert_load

    def check(self, config) -> None:
        """ValueError naming the engine flag when ``config`` (a ``ModelConfig``) has no sparse layers to report."""
        if config.moe is None:
            names = [name for name, on in (("enable_return_routed_experts", self.routed_experts),
                                           ("enable_expert_load_metrics", self.expert_load)) if on]
            raise ValueError(f"{' / '.join(names)}: {config.architecture} has no mixture-of-experts layers")

    @property
    def num_arrays(self) -> int:
        """Arrays the forward returns for them (after its usual outputs)."""
        return int(self.routed_experts) + int(self.expert_load)


def inline_attention(reusable):
    """A ``ReusableAttention``'s behaviour as a plain ``AttentionFn`` (the model then traces each layer inline)."""

    def attention(layer_idx, q, k, v, kv_layer, **options):
        return reusable(layer_idx, q, k, v, kv_layer, **options)

    attention.fuses_qk_transform = reusable.fuses_qk_transform
    attention.takes_layer_attention = True
    attention.takes_attention_sinks = getattr(reusable, "takes_attention_sinks", False)
    return attention


def device_outputs(model, options: MoeStepOutputs, num_tokens, num_experts: int) -> dict:
    """Inside the jitted forward, after the model call: the requested outputs (``num_tokens``: int32 scalar, the
    step's real tokens; the rest of the bucket is padding)."""
    ids = pop_routed_experts(model)  # int32[T, L, k]
    out = {}
    if options.routed_experts:
        out["routed_experts"] = ids.astype(routing_dtype(num_experts))
    if options.expert_load:
        out["expert_load"] = expert_load(ids, num_experts, jnp.arange(ids.shape[0]) < num_tokens)
    return out


def row_routed_experts(ids: np.ndarray, token_starts: np.ndarray, token_counts: np.ndarray) -> list[np.ndarray]:
    """The step's ``[T, L, k]`` routing -> per step row its tokens' ``[n, L, k]`` (``token_starts`` / ``token_counts``
    int64[rows]: each row's first packed token and count)."""
    return [ids[start:start + count] for start, count in zip(token_starts.tolist(), token_counts.tolist())]
