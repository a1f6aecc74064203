"""Reading a PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) into host arrays,
checked against the model it is to run on.

Supported: LoRA (``peft_type: LORA``) on the decoder projections ``q_proj, k_proj, v_proj, o_proj, gate_proj,
up_proj, down_proj`` of any subset of layers, any rank (also per module, PEFT's ``rank_pattern``) up to
``max_lora_rank``, scaling ``lora_alpha / r`` or, with ``use_rslora``, ``lora_alpha / sqrt(r)``. Everything else an
adapter may carry changes the model in ways the engine does not apply, so it is refused with a ``ValueError`` naming
it: embedding / LM-head LoRA, DoRA (``use_dora``), ``modules_to_save``, trained biases (``bias``, ``lora_bias``),
``alpha_pattern``, ``fan_in_fan_out`` layers, modules or layers the model lacks, a rank above ``max_lora_rank``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT module name -> (input features, output features) of the projection, from the model shape.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_MODULE_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                  "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def module_dims(config: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a decoder projection of ``config`` (checkpoint head counts)."""
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (hidden, q_dim), "k_proj": (hidden, kv_dim), "v_proj": (hidden, kv_dim),
            "o_proj": (q_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}[module]


@dataclasses.dataclass
class LoRAAdapter:
    """One adapter on the host, ready to be put into a device slot.

    Attributes:
      lora_int_id / lora_name / lora_path: from its ``LoRARequest``.
      rank: the largest rank of its modules.
      weights: ``{(layer, module): (A float32[in, r], B float32[r, out])}`` in matmul layout (``x @ A @ B``), the
        scaling (``lora_alpha / r`` or rsLoRA's ``lora_alpha / sqrt(r)``) already folded into B.
    """

    lora_int_id: int
    lora_name: str
    lora_path: str
    rank: int
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _refuse(where: str, what: str) -> ValueError:
    return ValueError(f"lora_request: LoRA adapter {where}: {what}")


def load_peft_adapter(lora_request, config: ModelConfig, max_lora_rank: int) -> LoRAAdapter:
    """Read and check the adapter of ``lora_request`` (a ``LoRARequest``) for a model of shape ``config``.

    Raises:
      ValueError starting with ``lora_request`` and naming the problem: no adapter at the path ("No adapter
      found"), an unsupported feature or module, a rank above ``max_lora_rank``, shapes that do not fit ``config``.
    """
    path = Path(lora_request.lora_path)
    where = f"{lora_request.lora_name!r} at {str(path)!r}"
    config_path, weights_path = _adapter_files(path, where)
    alpha, rslora = _read_adapter_config(config_path, where)
    tensors = _read_lora_tensors(weights_path, config, where)
    weights, max_rank = _scaled_weights(tensors, config, max_lora_rank, alpha, rslora, where)
    return LoRAAdapter(lora_int_id=lora_request.lora_int_id, lora_name=lora_request.lora_name,
                       lora_path=str(path), rank=max_rank, weights=weights)


def _adapter_files(path: Path, where: str) -> tuple[Path, Path]:
    """``(adapter_config.json, adapter_model.safetensors)`` of the adapter directory ``path``; ValueError ("No
    adapter found") when either is missing, or naming a pickled ``adapter_model.bin``."""
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"lora_request: No adapter found at {str(path)!r} ({CONFIG_FILE} is missing)")
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        if (path / "adapter_model.bin").is_file():
            raise _refuse(where, "adapter_model.bin (a pickle) is not read; save the adapter with "
                                 "safe_serialization=True (adapter_model.safetensors)")
        raise ValueError(f"lora_request: No adapter found at {str(path)!r} ({WEIGHTS_FILE} is missing)")
    return config_path, weights_path


def _read_adapter_config(config_path: Path, where: str) -> tuple[float, bool]:
    """``(lora_alpha, use_rslora)`` of ``adapter_config.json``; ValueError naming any setting the engine does not
    apply (module docstring) or a missing ``r`` / ``lora_alpha``."""
    try:
        adapter_config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise _refuse(where, f"{CONFIG_FILE} is not valid JSON ({exc})") from exc

    peft_type = adapter_config.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise _refuse(where, f"peft_type {peft_type!r} is not supported (only LORA)")
    if adapter_config.get("use_dora"):
        raise _refuse(where, "use_dora=True (DoRA) is not supported")
    if adapter_config.get("modules_to_save"):
        raise _refuse(where, f"modules_to_save {adapter_config['modules_to_save']!r} is not supported (fully "
                             "trained modules replace base weights)")
    if adapter_config.get("bias", "none") != "none":
        raise _refuse(where, f"bias={adapter_config['bias']!r} (trained biases) is not supported")
    if adapter_config.get("lora_bias"):
        raise _refuse(where, "lora_bias=True is not supported")
    if adapter_config.get("fan_in_fan_out"):
        raise _refuse(where, "fan_in_fan_out=True (Conv1D layers) is not supported")
    if adapter_config.get("alpha_pattern"):
        raise _refuse(where, f"alpha_pattern {adapter_config['alpha_pattern']!r} is not supported")
    if "r" not in adapter_config or "lora_alpha" not in adapter_config:
        raise _refuse(where, f"{CONFIG_FILE} lacks r / lora_alpha")
    return float(adapter_config["lora_alpha"]), bool(adapter_config.get("use_rslora", False))


def _read_lora_tensors(weights_path: Path, config: ModelConfig, where: str) -> dict[tuple[int, str], dict]:
    """``{(layer, module): {"A": lora_A [r, in], "B": lora_B [out, r]}}`` (PEFT's torch layout, as stored) from
    ``adapter_model.safetensors``; ValueError naming a tensor that is not a LoRA weight of a supported module of a
    layer ``config`` has, or an unreadable file."""
    from models.loader import _read_tensor  # the checkpoint reader (bf16 via raw bytes); no torch
    from safetensors import safe_open

    tensors: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    try:
        handle_cm = safe_open(str(weights_path), framework="numpy")
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file
        raise _refuse(where, f"cannot read {WEIGHTS_FILE} ({exc})") from exc
    with handle_cm as handle:
        for name in handle.keys():
            key, side = _lora_tensor_key(name, config, where)
            tensors.setdefault(key, {})[side] = _read_tensor(handle, name, weights_path)
    return tensors


def _lora_tensor_key(name: str, config: ModelConfig, where: str) -> tuple[tuple[int, str], str]:
    """``((layer, module), "A" | "B")`` of the safetensors tensor ``name``
    (``base_model.model.model.layers.{layer}.{parent}.{module}.lora_{A|B}.weight``); ValueError naming what the
    engine does not apply (embedding LoRA, DoRA, another module or layer)."""
    match = _TENSOR_NAME.match(name)
    if match is None:
        if "lora_embedding" in name:
            raise _refuse(where, f"embedding LoRA ({name}) is not supported")
        if "lora_magnitude_vector" in name:
            raise _refuse(where, f"DoRA ({name}) is not supported")
        raise _refuse(where, f"tensor {name} is not a LoRA weight of a supported module (LoRA applies "
                             f"to {', '.join(SUPPORTED_MODULES)})")
    layer, parent, module, side = int(match[1]), match[2], match[3], match[4]
    if module not in SUPPORTED_MODULES or _MODULE_PARENT[module] != parent:
        raise _refuse(where, f"module {parent}.{module} ({name}) is not supported (LoRA applies to "
                             f"{', '.join(SUPPORTED_MODULES)})")
    if layer >= config.num_hidden_layers:
        raise _refuse(where, f"layer {layer} ({name}) does not exist: the model has "
                             f"{config.num_hidden_layers} layers")
    return (layer, module), side


def _scaled_weights(tensors: dict, config: ModelConfig, max_lora_rank: int, alpha: float, rslora: bool,
                    where: str) -> tuple[dict, int]:
    """``(LoRAAdapter.weights, largest rank)`` from ``_read_lora_tensors``'s pairs: each checked (both sides present,
    shapes fitting ``config``, rank <= ``max_lora_rank``), transposed to matmul layout (A ``float32[in, r]``, B
    ``float32[r, out]``) with the scaling folded into B."""
    if not tensors:
        raise _refuse(where, f"{WEIGHTS_FILE} holds no LoRA weights")
    weights, max_rank = {}, 0
    for (layer, module), pair in sorted(tensors.items()):
        label = f"layers.{layer}.{module}"
        if set(pair) != {"A", "B"}:
            raise _refuse(where, f"{label} has lora_{''.join(pair)} without its partner")
        lora_a, lora_b = pair["A"], pair["B"]  # PEFT (torch) layout: A [r, in], B [out, r]
        rank = lora_a.shape[0]
        in_features, out_features = module_dims(config, module)
        if lora_a.shape != (rank, in_features) or lora_b.shape != (out_features, rank):
            raise _refuse(where, f"{label} has lora_A {tuple(lora_a.shape)} and lora_B {tuple(lora_b.shape)}; the "
                                 f"model needs [r, {in_features}] and [{out_features}, r] (an adapter of another "
                                 "model?)")
        if rank > max_lora_rank:
            raise _refuse(where, f"rank {rank} ({label}) exceeds max_lora_rank={max_lora_rank} (--max-lora-rank)")
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        weights[(layer, module)] = (np.ascontiguousarray(lora_a.astype(np.float32).T),
                                    np.ascontiguousarray(lora_b.astype(np.float32).T * np.float32(scale)))
        max_rank = max(max_rank, rank)
    return weights, max_rank
