"""What a quantized model is: ``QuantConfig``, resolved from ``--quantization`` and config.json's
``quantization_config`` the way vLLM resolves them. JAX-free (``EngineArgs`` validates its flag with it).

Methods (vLLM's names):
  * ``awq``: AutoAWQ GEMM checkpoints, 4-bit, group sizes 32/64/128, zero points.
  * ``gptq``: GPTQ checkpoints (AutoGPTQ / GPTQModel / optimum), 4- and 8-bit, sym and asym, ``desc_act`` with
    ``g_idx``; checkpoint_format ``gptq`` (v1: stored zero = zero - 1) and ``gptq_v2``.
  * ``compressed-tensors``: llm-compressor checkpoints in the ``float-quantized`` / ``naive-quantized`` FP8 format
    (weights per tensor or per channel; input activations static per tensor, dynamic per token or tensor, or none),
    optionally an FP8 KV cache scheme (per-layer ``k_scale`` / ``v_scale``).
  * ``fp8``: a checkpoint whose ``quant_method`` is ``fp8`` (per-tensor weight scales, ``activation_scheme`` static
    or dynamic), or, for an unquantized checkpoint, online FP8: every projection quantized at load (per-channel
    weight scales; dynamic per-token activation scales on the q/k/v and gate/up inputs, o_proj and down_proj
    weight-only: ``ONLINE_FP8_ACTIVATION_PROJECTIONS``).
  * ``int8``: online weight-only int8 (per-channel, symmetric), quantized at load.
  * block-FP8 (``fp8`` with ``weight_block_size``): DeepSeek-V2 / V3's and Qwen3-MoE's published FP8 checkpoints;
    their experts stay in float8 with their block scales (``MoeConfig.expert_format`` "fp8"), their other
    projections are dequantized to the model dtype at load (``ModelConfig.fp8_weight_block``), so it resolves to no
    ``QuantConfig``.
  * ``mxfp4``: gpt-oss's published checkpoints, whose experts are MXFP4 (``models.quantization.mxfp4``); they load
    as part of the model (``ModelConfig.moe.expert_format``), so it resolves to no ``QuantConfig``.
Only the decoder's projections (q/k/v/o, gate/up/down) are quantized; embeddings, norms and the LM head stay in the
model dtype (vLLM's defaults for these methods; a checkpoint that quantizes the LM head is refused).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from models.config import MOE_ARCHITECTURES
from models.hf_config import BLOCK_FP8_ARCHITECTURES

QUANTIZATION_METHODS = ("awq", "gptq", "compressed-tensors", "fp8", "int8", "mxfp4")
# Online fp8 quantizes the inputs of these projections (W8A8) and runs o_proj and down_proj weight-only: their
# inputs (the attention output, SwiGLU's product) carry the outlier channels that cost W8A8 most of its loss
# (SmolLM2's perplexity, benchmarks/RESULTS.md: +4.3% with every input quantized, +1.7% with these only).
ONLINE_FP8_ACTIVATION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# --kv-cache-dtype values (vLLM's names); fp8 = fp8_e4m3 (float8_e4m3fn).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
# Methods that need a quantized checkpoint; the others may also quantize an unquantized one at load.
_CHECKPOINT_ONLY = ("awq", "gptq", "compressed-tensors", "mxfp4")
_AWQ_GROUP_SIZES = (32, 64, 128)


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """How the projections of one model are quantized (frozen, JSON-able via ``to_json`` for cache keys).

    Fields:
      method: one of ``QUANTIZATION_METHODS``.
      kind: ``"weight_only"`` (AWQ / GPTQ int4 / int8 integers, dequantized to the compute dtype), ``"fp8"``
        (float8_e4m3fn weights; XLA float8 dots when activations are quantized too) or ``"int8"`` (online int8:
        int8 weights per output channel, symmetric, in FP8's layout, ``Int8Linear``).
      serialized: True when the checkpoint stores quantized weights; False = quantize a float checkpoint at load.
      bits: weight bits (4 or 8).
      group_size: input rows sharing one scale / zero point; -1 = one group over all inputs (per channel).
      zero_point: weight-only: asymmetric (a zero point per group and column); False = symmetric.
      desc_act: GPTQ act-order: each input row's group is ``g_idx[row]``.
      gptq_zero_offset: GPTQ v1 stores ``zero - 1`` (1); v2 stores the zero point itself (0).
      weight_strategy: fp8: ``"tensor"`` or ``"channel"`` weight scales.
      activation_scheme: fp8: ``"static"`` (one scale per tensor from the checkpoint), ``"dynamic_token"``,
        ``"dynamic_tensor"`` or None (weight-only fp8: weights upcast, activations untouched).
      activation_projections: fp8: the projections (HF names, e.g. ``"q_proj"``) whose inputs are quantized with
        ``activation_scheme``, the others weight-only; None = every projection (a checkpoint's declared scheme).
        Online ``fp8`` quantizes the inputs of q/k/v and gate/up only (``ONLINE_FP8_ACTIVATION_PROJECTIONS``).
      ignore: module names (or ``re:`` patterns) left unquantized; ``ignore_substrings``: AWQ/GPTQ-style
        substrings (``modules_to_not_convert``).
      kv_cache_scheme: the checkpoint declares an FP8 KV cache (its ``k_scale`` / ``v_scale`` are then read).
    """

    method: str
    kind: str
    serialized: bool
    bits: int = 8
    group_size: int = -1
    zero_point: bool = False
    desc_act: bool = False
    gptq_zero_offset: int = 0
    weight_strategy: str = "channel"
    activation_scheme: str | None = None
    activation_projections: tuple[str, ...] | None = None
    ignore: tuple[str, ...] = ()
    ignore_substrings: tuple[str, ...] = ()
    kv_cache_scheme: bool = False

    def is_quantized(self, module_name: str) -> bool:
        """Whether the projection ``module_name`` (HF name, e.g. ``model.layers.0.mlp.down_proj``) is quantized."""
        if any(s and s in module_name for s in self.ignore_substrings):
            return False
        for pattern in self.ignore:
            if pattern.startswith("re:"):
                if re.fullmatch(pattern[3:], module_name):
                    return False
            elif module_name == pattern or module_name.endswith("." + pattern):
                return False
        return True

    def activation_scheme_for(self, projection: str) -> str | None:
        """The activation scheme of projection ``projection`` (HF name, e.g. ``"o_proj"``): ``activation_scheme``,
        or None (weight-only) for a projection outside ``activation_projections``."""
        if self.activation_projections is not None and projection not in self.activation_projections:
            return None
        return self.activation_scheme

    def to_json(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}


def _online(method: str) -> QuantConfig:
    if method == "int8":
        return QuantConfig("int8", "int8", serialized=False, bits=8, group_size=-1, zero_point=False)
    return QuantConfig("fp8", "fp8", serialized=False, bits=8, weight_strategy="channel",
                       activation_scheme="dynamic_token", activation_projections=ONLINE_FP8_ACTIVATION_PROJECTIONS)


def resolve_quantization(flag: str | None, hf_config: dict[str, Any]) -> QuantConfig | None:
    """The quantization of a model: ``--quantization`` (``flag``) checked against config.json's
    ``quantization_config`` (vLLM: the flag may be omitted; when both are given they must name the same method).

    Returns None for an unquantized model without the flag. Raises ValueError naming ``quantization`` for an unknown
    method, a flag that contradicts the checkpoint, a checkpoint-only method (awq, gptq, compressed-tensors) without
    a quantized checkpoint, and for checkpoint settings this engine does not run (naming the setting).
    """
    if flag is not None:
        flag = flag.lower()
        if flag not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization: unknown quantization method {flag!r}; must be one of "
                             f"{', '.join(QUANTIZATION_METHODS)}")
    quant_cfg = hf_config.get("quantization_config") or hf_config.get("compression_config")
    architecture = (hf_config.get("architectures") or [None])[0]
    if architecture == "GptOssForCausalLM" and _gpt_oss_mxfp4(flag, quant_cfg):
        return None  # the experts' format is part of the model (ModelConfig.moe.expert_format)
    if architecture in BLOCK_FP8_ARCHITECTURES and flag in (None, "fp8") and _block_fp8(quant_cfg):
        return None  # part of the model (ModelConfig.fp8_weight_block, MoeConfig.expert_format "fp8")
    if architecture in MOE_ARCHITECTURES and (flag is not None or quant_cfg is not None):
        raise _moe_refusal(architecture, flag, quant_cfg)
    if quant_cfg is None:
        if flag is None:
            return None
        if flag in _CHECKPOINT_ONLY:
            raise ValueError(f"quantization={flag!r} needs a checkpoint quantized with {flag} (config.json has no "
                             f"quantization_config); for load-time quantization use fp8 or int8")
        return _online(flag)
    method = str(quant_cfg.get("quant_method", "")).lower()
    if method not in QUANTIZATION_METHODS or method in ("int8", "mxfp4"):
        raise ValueError(f"quantization: the checkpoint's quantization_config.quant_method {method!r} is not "
                         f"supported; supported checkpoint methods: awq, gptq, compressed-tensors, fp8")
    if flag is not None and flag != method:
        raise ValueError(f"quantization: the method in the model config ({method}) does not match the method "
                         f"given by the quantization argument ({flag})")
    if method == "awq":
        return _awq(quant_cfg)
    if method == "gptq":
        return _gptq(quant_cfg)
    if method == "fp8":
        return _fp8_checkpoint(quant_cfg)
    return _compressed_tensors(quant_cfg)


def _gpt_oss_mxfp4(flag: str | None, quant_cfg: dict | None) -> bool:
    """Whether a gpt-oss checkpoint is the published MXFP4 one and ``--quantization`` is unset or says "mxfp4"
    (its experts then load packed: ``models.gpt_oss``); ValueError naming ``quantization`` for "mxfp4" asked of
    an unquantized checkpoint."""
    method = None if quant_cfg is None else str(quant_cfg.get("quant_method", "")).lower()
    if flag == "mxfp4" and method != "mxfp4":
        raise ValueError("quantization: mxfp4 needs a checkpoint quantized with mxfp4 (its experts as published); "
                         "this gpt-oss checkpoint's experts are unquantized")
    return method == "mxfp4" and flag in (None, "mxfp4")


def _moe_refusal(architecture: str, flag: str | None, quant_cfg: dict | None) -> ValueError:
    """The ValueError naming what a mixture-of-experts model refuses: a checkpoint's quantization other than its
    family's published one, or ``--quantization`` (online, or contradicting the checkpoint)."""
    runs = ("block-FP8 checkpoints (quant_method 'fp8' with weight_block_size) as published"
            if architecture in BLOCK_FP8_ARCHITECTURES else "its published MXFP4 checkpoints"
            if architecture == "GptOssForCausalLM" else "unquantized checkpoints only")
    if quant_cfg is None:
        what = f"--quantization {flag} (load-time quantization of an unquantized checkpoint)"
    else:
        method = str(quant_cfg.get("quant_method", "")).lower()
        block = quant_cfg.get("weight_block_size")
        what = (f"the checkpoint's quantization_config (quant_method {method!r}"
                f"{f', weight_block_size {block}' if block else ''})")
        if flag is not None:
            what += f" with --quantization {flag}"
    return ValueError(f"quantization: {what} is not supported for {architecture}: its experts run {runs}")


def _block_fp8(quant_cfg: dict | None) -> bool:
    """Whether ``quantization_config`` is block-FP8 (``fp8`` with ``weight_block_size``, DeepSeek-V3 and Qwen3-MoE
    FP8 as published)."""
    return (quant_cfg is not None and str(quant_cfg.get("quant_method", "")).lower() == "fp8"
            and bool(quant_cfg.get("weight_block_size")))


def _unsupported(method: str, what: str) -> ValueError:
    return ValueError(f"quantization: {method} checkpoint with {what} is not supported")


def _awq(cfg: dict) -> QuantConfig:
    bits = int(cfg.get("bits", cfg.get("w_bit", 4)))
    group_size = int(cfg.get("group_size", cfg.get("q_group_size", 128)))
    version = str(cfg.get("version", "gemm")).lower()
    if bits != 4:
        raise _unsupported("awq", f"bits={bits} (only 4)")
    if group_size not in _AWQ_GROUP_SIZES:
        raise _unsupported("awq", f"group_size={group_size} (32, 64 or 128)")
    if version != "gemm":
        raise _unsupported("awq", f"version={version!r} (only the GEMM packing)")
    if not cfg.get("zero_point", True):
        raise _unsupported("awq", "zero_point=false")
    return QuantConfig("awq", "weight_only", serialized=True, bits=4, group_size=group_size,
                       zero_point=True,
                       ignore_substrings=tuple(cfg.get("modules_to_not_convert") or ()))


def _gptq(cfg: dict) -> QuantConfig:
    bits = int(cfg.get("bits", 4))
    if bits not in (4, 8):
        raise _unsupported("gptq", f"bits={bits} (4 or 8)")
    fmt = str(cfg.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise _unsupported("gptq", f"checkpoint_format={fmt!r} (gptq or gptq_v2)")
    if cfg.get("lm_head"):
        raise _unsupported("gptq", "a quantized lm_head")
    return QuantConfig("gptq", "weight_only", serialized=True, bits=bits, group_size=int(cfg.get("group_size", 128)),
                       zero_point=not bool(cfg.get("sym", True)), desc_act=bool(cfg.get("desc_act", False)),
                       gptq_zero_offset=1 if fmt == "gptq" else 0,
                       ignore_substrings=tuple(cfg.get("modules_to_not_convert") or ()))


def _fp8_checkpoint(cfg: dict) -> QuantConfig:
    if cfg.get("weight_block_size"):
        raise _unsupported("fp8", f"weight_block_size={cfg['weight_block_size']} (per-tensor weight scales only)")
    scheme = str(cfg.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("static", "dynamic"):
        raise _unsupported("fp8", f"activation_scheme={scheme!r}")
    return QuantConfig("fp8", "fp8", serialized=True, bits=8, weight_strategy="tensor",
                       activation_scheme="static" if scheme == "static" else "dynamic_tensor",
                       ignore=tuple(cfg.get("ignored_layers") or ()) + ("lm_head",),
                       kv_cache_scheme=bool(cfg.get("kv_cache_quant_method") or cfg.get("kv_cache_scheme")))


def _compressed_tensors(cfg: dict) -> QuantConfig:
    groups = list((cfg.get("config_groups") or {}).values())
    if not groups:
        raise _unsupported("compressed-tensors", "no config_groups")
    if any(g != groups[0] for g in groups[1:]):
        raise _unsupported("compressed-tensors", "several different config_groups")
    group = groups[0]
    fmt = str(group.get("format") or cfg.get("format") or "").lower()
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    is_fp8 = weights.get("type") == "float" and int(weights.get("num_bits", 0)) == 8
    if not is_fp8 or fmt not in ("float-quantized", "naive-quantized"):
        raise _unsupported("compressed-tensors", f"format={fmt!r} and weights {weights.get('type')}"
                           f"{weights.get('num_bits')} (only FP8 float-quantized)")
    strategy = str(weights.get("strategy", "tensor")).lower()
    if strategy not in ("tensor", "channel") or weights.get("dynamic"):
        raise _unsupported("compressed-tensors", f"weight strategy={strategy!r} (static tensor or channel)")
    if acts is None:
        activation = None
    else:
        if acts.get("type") != "float" or int(acts.get("num_bits", 0)) != 8:
            raise _unsupported("compressed-tensors", "non-FP8 input activations")
        act_strategy = str(acts.get("strategy", "tensor")).lower()
        if acts.get("dynamic"):
            if act_strategy not in ("token", "tensor"):
                raise _unsupported("compressed-tensors", f"dynamic activation strategy={act_strategy!r}")
            activation = f"dynamic_{act_strategy}"
        elif act_strategy == "tensor":
            activation = "static"
        else:
            raise _unsupported("compressed-tensors", f"static activation strategy={act_strategy!r}")
    targets = [str(t) for t in group.get("targets") or ["Linear"]]
    if not any(t == "Linear" or "proj" in t for t in targets):
        raise _unsupported("compressed-tensors", f"targets={targets}")
    ignore = tuple(cfg.get("ignore") or ())
    if "lm_head" not in ignore:
        raise _unsupported("compressed-tensors", "a quantized lm_head (not in ignore)")
    return QuantConfig("compressed-tensors", "fp8", serialized=True, bits=8, weight_strategy=strategy,
                       activation_scheme=activation, ignore=ignore,
                       kv_cache_scheme=cfg.get("kv_cache_scheme") is not None)
