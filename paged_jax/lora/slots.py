"""Device slots for LoRA adapters: per decoder layer and target projection, one preallocated ``A: [in, S, R]`` and
``B: [S, R, out]`` (S = ``max_loras + 1`` slots, slot 0 all zeros = no adapter; R = ``max_lora_rank`` times the
projections fused into the target), written in place when an adapter moves in, so loading, evicting and unloading
adapters never changes a shape and never recompiles the step.

Targets follow the model's layout: a fused model (``models.llama.fuse_projections``) has ``qkv_proj``, ``o_proj``,
``gate_up_proj``, ``down_proj``; a fused target stacks its projections' A matrices along the rank (q | k | v) and
holds their B matrices block diagonally, so its update is one low-rank matmul pair with the fused output columns.
The tensor-parallel model keeps the HF layout (seven targets), and its slots are split as the base layers are
(``paged_jax.parallel.plan``): column-parallel q/k/v/gate/up split B over its outputs, row-parallel o/down split A
over its inputs; head rewrites (padded q heads, replicated kv heads) are applied to the adapter as to the weights.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from paged_jax.lora.layers import LORA_IMPLS, LoRALayer
from paged_jax.lora.peft import LoRAAdapter, SUPPORTED_MODULES, module_dims

FUSED_TARGETS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                 "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
UNFUSED_TARGETS = {module: (module,) for module in SUPPORTED_MODULES}
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


@dataclasses.dataclass
class LoadedLoRA:
    """An adapter in host memory in slot form: ``weights[layer][target] = (A [in, R], B [R, out])`` (numpy, the
    model's dtype, zero-padded to the slot rank). ``lora_request`` is the ``LoRARequest`` it came from."""

    lora_request: object
    rank: int
    weights: list[dict[str, tuple[np.ndarray, np.ndarray]]]

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id

    @property
    def cache_key(self) -> bytes:
        return self.lora_request.cache_key

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for layer in self.weights for a, b in layer.values())


class LoRASlots:
    """The slot arrays of one model and the jitted in-place slot write.

    Args:
      config: the model shape as built and run (a tensor-parallel plan's ``model_config``).
      fused: the model's projections are fused (``FUSED_TARGETS``), else the HF layout (``UNFUSED_TARGETS``).
      max_loras: adapters resident at once (slots 1..max_loras).
      max_lora_rank: the largest adapter rank; smaller ranks are zero-padded.
      dtype: the model's compute dtype.
      device: where the arrays live (single device); ignored with ``sharding_plan``.
      sharding_plan: a ``paged_jax.parallel.ShardingPlan`` (tensor parallelism), or None.
      impl: ``paged_jax.lora.layers.LORA_IMPLS``.
    """

    def __init__(self, config: ModelConfig, *, fused: bool, max_loras: int, max_lora_rank: int, dtype,
                 device=None, sharding_plan=None, impl: str = "masked"):
        if impl not in LORA_IMPLS:
            raise ValueError(f"lora impl must be one of {LORA_IMPLS}, got {impl!r}")
        self.config = config
        self.targets = FUSED_TARGETS if fused else UNFUSED_TARGETS
        self.num_slots = max_loras + 1
        self.max_lora_rank = max_lora_rank
        self.dtype = jnp.dtype(dtype)
        self.plan = sharding_plan
        self.impl = impl
        self.device = sharding_plan.replicated if sharding_plan is not None else (device or jax.devices()[0])
        arrays = []
        for _ in range(config.num_hidden_layers):
            layer = {}
            for target, modules in self.targets.items():
                in_features, out_features, rank = self._target_dims(config, modules)
                layer[target] = (
                    jnp.zeros((in_features, self.num_slots, rank), self.dtype, device=self._sharding(modules, "A")),
                    jnp.zeros((self.num_slots, rank, out_features), self.dtype, device=self._sharding(modules, "B")))
            arrays.append(layer)
        self.arrays: list[dict[str, tuple[jax.Array, jax.Array]]] = arrays

        def write(arrays, slot, new):
            """Slot ``slot`` (int32 scalar) of every target := ``new`` (per layer {target: (A [in, R], B [R, out])})."""
            return [{target: (jax.lax.dynamic_update_slice(a, new_layer[target][0][:, None, :].astype(a.dtype),
                                                           (0, slot, 0)),
                              jax.lax.dynamic_update_slice(b, new_layer[target][1][None].astype(b.dtype),
                                                           (slot, 0, 0)))
                     for target, (a, b) in layer.items()}
                    for layer, new_layer in zip(arrays, new)]

        self._write = jax.jit(write, donate_argnums=(0,))

    def _target_dims(self, config: ModelConfig, modules: tuple[str, ...]) -> tuple[int, int, int]:
        in_features = module_dims(config, modules[0])[0]
        out_features = sum(module_dims(config, module)[1] for module in modules)
        return in_features, out_features, len(modules) * self.max_lora_rank

    def _sharding(self, modules: tuple[str, ...], side: str):
        """A: [in, S, R] split over its inputs for a row-parallel layer; B: [S, R, out] over its outputs for a
        column-parallel one (the base kernel's split dimension, ``ShardingPlan.param_spec``)."""
        if self.plan is None:
            return self.device
        from jax.sharding import NamedSharding, PartitionSpec as P

        module = modules[0]
        path = ("model", "layers", 0, _PARENT[module], module, "kernel")
        in_features, out_features = module_dims(self.config, module)
        spec = tuple(self.plan.param_spec(path, (in_features, out_features))) + (None, None)
        split_in, split_out = spec[0], spec[1]
        return NamedSharding(self.plan.mesh, P(split_in, None, None) if side == "A" else P(None, None, split_out))

    @property
    def checkpoint_config(self) -> ModelConfig:
        """The shape adapters are trained for (the checkpoint's; before a tensor-parallel head rewrite)."""
        return self.plan.config if self.plan is not None else self.config

    # ------------------------------------------------------------------ host side
    def to_slot_form(self, adapter: LoRAAdapter, lora_request) -> LoadedLoRA:
        """The adapter's weights as slot contents (zero-padded ranks, block-diagonal B of fused targets, the head
        rewrites of a tensor-parallel plan), in the model's dtype."""
        rank = self.max_lora_rank
        weights = []
        for layer_idx in range(self.config.num_hidden_layers):
            layer = {}
            for target, modules in self.targets.items():
                in_features, out_features, width = self._target_dims(self.config, modules)
                if not any((layer_idx, module) in adapter.weights for module in modules):
                    continue
                lora_a = np.zeros((in_features, width), np.float32)
                lora_b = np.zeros((width, out_features), np.float32)
                column = 0
                for index, module in enumerate(modules):
                    out_module = module_dims(self.config, module)[1]
                    pair = adapter.weights.get((layer_idx, module))
                    if pair is not None:
                        a, b = pair
                        if self.plan is not None:  # rewrite as the base kernel [in, out] of this module is
                            path = ("model", "layers", layer_idx, _PARENT[module], module, "kernel")
                            if module == "o_proj":
                                a = self.plan.rewrite_param(path, a)
                            else:
                                b = self.plan.rewrite_param(path, b)
                        r = a.shape[1]
                        lora_a[:, index * rank:index * rank + r] = a
                        lora_b[index * rank:index * rank + r, column:column + out_module] = b
                    column += out_module
                layer[target] = (lora_a.astype(self.dtype), lora_b.astype(self.dtype))
            weights.append(layer)
        return LoadedLoRA(lora_request=lora_request, rank=adapter.rank, weights=weights)

    # ------------------------------------------------------------------ device side
    def write(self, slot: int, lora: LoadedLoRA | None) -> None:
        """Put ``lora`` into ``slot`` (1..max_loras) in place (targets it lacks become zeros); None zeroes it. One
        host->device transfer of the adapter, one call of the same compiled write whatever the slot."""
        new = []
        for layer_idx, layer in enumerate(self.arrays):
            host = lora.weights[layer_idx] if lora is not None else {}
            zeros = {target: (np.zeros((a.shape[0], a.shape[2]), self.dtype), np.zeros(b.shape[1:], self.dtype))
                     for target, (a, b) in layer.items() if target not in host}
            new.append({target: host[target] if target in host else zeros[target] for target in layer})
        new = jax.device_put(new, self.device)
        self.arrays = self._write(self.arrays, jnp.asarray(slot, jnp.int32), new)

    def num_compiles(self) -> int:
        return self._write._cache_size()

    def layers(self, arrays, slot_ids: jax.Array) -> list[LoRALayer]:
        """Inside the jitted step: per layer the ``LoRALayer`` of ``arrays`` (``self.arrays`` passed in as an
        argument, so new slot contents never retrace) for tokens in slots ``slot_ids: int32[T]``."""
        return [LoRALayer(slot_ids, layer, self.impl) for layer in arrays]

