"""Test-only: write quantized checkpoints in the real on-disk formats, from a float HF checkpoint.

``save_quantized_checkpoint(float_dir, out_dir, method, ...)`` quantizes every decoder projection round-to-nearest
and writes it exactly as the format's own packer does (torch / numpy; nothing from ``models.quantization``'s loading
code is used, so a test compares two independent implementations):
  * ``"awq"``: AutoAWQ ``WQLinear_GEMM.from_linear``: ``qweight int32[in, out/8]``, nibble ``i`` of each word =
    column ``[0, 2, 4, 6, 1, 3, 5, 7][i]`` of its 8-column block; ``qzeros`` likewise; ``scales float16[in/g, out]``.
  * ``"gptq"``: AutoGPTQ ``QuantLinear.pack``: ``qweight int32[in*bits/32, out]`` (row ``r`` holds input rows
    ``pack*r + j``), ``qzeros int32[G, out*bits/32]`` storing ``zero - 1`` (v1), ``scales float16[G, out]``,
    ``g_idx int32[in]`` (a random act-order permutation with ``desc_act``).
  * ``"fp8"``: compressed-tensors float-quantized, quantized with the compressed-tensors library's own
    ``quantize``: ``weight F8_E4M3[out, in]``, ``weight_scale float32`` (``[1]`` per tensor, ``[out, 1]`` per
    channel), ``input_scale float32[1]`` for static activations; optional FP8 KV cache scheme with per-layer
    ``self_attn.k_scale`` / ``v_scale``.
Needs torch, safetensors and (for fp8) compressed-tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _is_projection(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in _PROJECTIONS and "layers" in parts


def _quantize_groups(w: np.ndarray, bits: int, group_size: int, sym: bool, g_idx: np.ndarray):
    """``w [in, out]`` float -> ``(int [in, out], scales [G, out] float16, zeros [G, out] int)`` with rows grouped by
    ``g_idx`` (round to nearest; GPTQ-style min/max ranges)."""
    maxq = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    scales = np.zeros((groups, w.shape[1]), np.float32)
    zeros = np.zeros((groups, w.shape[1]), np.int64)
    for g in range(groups):
        rows = w[g_idx == g]
        lo, hi = np.minimum(rows.min(0), 0), np.maximum(rows.max(0), 0)
        if sym:
            hi = np.maximum(np.abs(lo), hi)
            lo = -hi
        scale = np.maximum(hi - lo, 1e-8) / maxq
        scales[g] = scale.astype(np.float16).astype(np.float32)
        zeros[g] = (maxq + 1) // 2 if sym else np.clip(np.round(-lo / scales[g]), 0, maxq)
    q = np.clip(np.round(w / scales[g_idx]) + zeros[g_idx], 0, maxq).astype(np.int64)
    return q, scales.astype(np.float16), zeros


def _awq_pack_columns(intweight: np.ndarray) -> np.ndarray:
    """AutoAWQ's GEMM packer (``WQLinear_GEMM.from_linear``), vectorized over rows."""
    packed = np.zeros((intweight.shape[0], intweight.shape[1] // 8), np.uint32)
    for col in range(intweight.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + AWQ_ORDER[i]].astype(np.uint32) << np.uint32(i * 4)
    return packed.view(np.int32)


def _gptq_pack_rows(intweight: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ ``QuantLinear.pack``: qweight rows."""
    pack = 32 // bits
    packed = np.zeros((intweight.shape[0] // pack, intweight.shape[1]), np.uint32)
    for row in range(packed.shape[0]):
        for j in range(pack):
            packed[row] |= intweight[row * pack + j].astype(np.uint32) << np.uint32(bits * j)
    return packed.view(np.int32)


def _gptq_pack_zeros(zeros: np.ndarray, bits: int) -> np.ndarray:
    """AutoGPTQ ``QuantLinear.pack``: ``zeros - 1`` packed along the columns (v1)."""
    pack = 32 // bits
    stored = (zeros - 1).astype(np.int64) & ((1 << bits) - 1)
    packed = np.zeros((zeros.shape[0], zeros.shape[1] // pack), np.uint32)
    for col in range(packed.shape[1]):
        for j in range(pack):
            packed[:, col] |= stored[:, col * pack + j].astype(np.uint32) << np.uint32(bits * j)
    return packed.view(np.int32)


def save_quantized_checkpoint(float_dir, out_dir, method: str, *, bits: int = 4, group_size: int = 128,
                              sym: bool = False, desc_act: bool = False, weight_strategy: str = "channel",
                              activations: str | None = "dynamic_token", kv_cache_scales: dict | None = None,
                              seed: int = 0) -> Path:
    """Quantize ``float_dir`` (an fp32/bf16 HF checkpoint, one safetensors file) into ``out_dir`` as ``method``.

    ``kv_cache_scales`` (fp8): ``{layer: (k_scale, v_scale)}`` written as the checkpoint's KV cache scales.
    Returns ``out_dir``.
    """
    import torch
    from safetensors.torch import load_file, save_file

    float_dir, out_dir = Path(float_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in float_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out_dir / f.name)
    tensors = load_file(str(float_dir / "model.safetensors"))
    rng = np.random.default_rng(seed)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if not _is_projection(name):
            out[name] = tensor
            continue
        module = name[: -len(".weight")]
        w = tensor.float().numpy().T  # [in, out]
        in_features = w.shape[0]
        if method in ("awq", "gptq"):
            gs = in_features if group_size == -1 else group_size
            g_idx = np.arange(in_features) // gs
            if desc_act:
                g_idx = g_idx[rng.permutation(in_features)]
            q, scales, zeros = _quantize_groups(w, bits, gs, sym or False, g_idx)
            if method == "awq":
                out[f"{module}.qweight"] = torch.from_numpy(_awq_pack_columns(q))
                out[f"{module}.qzeros"] = torch.from_numpy(_awq_pack_columns(zeros))
            else:
                out[f"{module}.qweight"] = torch.from_numpy(_gptq_pack_rows(q, bits))
                out[f"{module}.qzeros"] = torch.from_numpy(_gptq_pack_zeros(zeros, bits))
                out[f"{module}.g_idx"] = torch.from_numpy(g_idx.astype(np.int32))
            out[f"{module}.scales"] = torch.from_numpy(scales)
        elif method == "fp8":
            out.update(_fp8_tensors(module, tensor.float(), weight_strategy, activations))
        else:
            raise ValueError(f"unknown method {method!r}")
    for layer, (k_scale, v_scale) in (kv_cache_scales or {}).items():
        out[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor([k_scale], dtype=torch.float32)
        out[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([v_scale], dtype=torch.float32)
    save_file({k: v.contiguous() for k, v in out.items()}, str(out_dir / "model.safetensors"))

    config = json.loads((float_dir / "config.json").read_text())
    if method == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                         "zero_point": True, "version": "gemm"}
    elif method == "gptq":
        config["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                                         "sym": sym, "desc_act": desc_act, "checkpoint_format": "gptq"}
    else:
        config["quantization_config"] = _fp8_config(weight_strategy, activations, kv_cache_scales is not None)
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def _fp8_args(weight_strategy: str, activations: str | None):
    from compressed_tensors.quantization import QuantizationArgs

    weights = QuantizationArgs(num_bits=8, type="float", strategy=weight_strategy, symmetric=True, dynamic=False)
    acts = None
    if activations is not None:
        strategy = "tensor" if activations in ("static", "dynamic_tensor") else "token"
        acts = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True,
                                dynamic=activations != "static")
    return weights, acts


def _fp8_tensors(module: str, weight, weight_strategy: str, activations: str | None) -> dict:
    import torch
    from compressed_tensors.quantization.lifecycle.forward import quantize

    args, _ = _fp8_args(weight_strategy, activations)
    amax = weight.abs().amax(dim=1, keepdim=True) if weight_strategy == "channel" else weight.abs().amax().reshape(1)
    scale = (amax / 448.0).clamp(min=1e-12).float()
    zero = torch.zeros_like(scale)
    q = quantize(weight, scale, zero, args, dtype=torch.float8_e4m3fn)
    tensors = {f"{module}.weight": q, f"{module}.weight_scale": scale}
    if activations == "static":
        tensors[f"{module}.input_scale"] = torch.tensor([0.02], dtype=torch.float32)
    return tensors


def _fp8_config(weight_strategy: str, activations: str | None, kv_cache: bool) -> dict:
    weights, acts = _fp8_args(weight_strategy, activations)
    group = {"targets": ["Linear"], "weights": weights.model_dump(mode="json"),
             "input_activations": None if acts is None else acts.model_dump(mode="json"),
             "format": "float-quantized"}
    config = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": group}, "ignore": ["lm_head"]}
    if kv_cache:
        config["kv_cache_scheme"] = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
                                     "symmetric": True}
    return config


# gpt-oss's published quantization_config (openai/gpt-oss-20b): only the experts are MXFP4.
GPT_OSS_MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def save_mxfp4_gpt_oss_checkpoint(float_dir, out_dir) -> Path:
    """A float gpt-oss checkpoint (``models.testing.save_random_hf_checkpoint``, one file) rewritten as published:
    each ``mlp.experts.{gate_up_proj,down_proj}`` (``[E, in, out]``) replaced by ``_blocks`` ``uint8[E, out, in/32,
    16]`` and ``_scales`` ``uint8[E, out, in/32]`` (``models.quantization.mxfp4.quantize``), biases and every other
    tensor kept, ``quantization_config`` ``GPT_OSS_MXFP4_CONFIG``. Returns ``out_dir``."""
    from safetensors.numpy import load_file, save_file

    from models.quantization import mxfp4

    float_dir, out_dir = Path(float_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = load_file(float_dir / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4.quantize(np.swapaxes(tensors.pop(name), 1, 2))
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = GPT_OSS_MXFP4_CONFIG
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


# DeepSeek-V3's and Qwen3-MoE's (Qwen/Qwen3-30B-A3B-FP8) block-FP8 checkpoints quantize every linear layer of the
# decoder (attention, dense MLP, experts, shared experts); the embedding, norms, router (mlp.gate) and LM head stay
# in bf16.
_BLOCK_FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                          "o_proj", "gate_proj", "up_proj", "down_proj")


def save_block_fp8_checkpoint(float_dir, out_dir, dequantized_dir, *, block: tuple[int, int] = (128, 128)) -> Path:
    """DeepSeek-V3's and Qwen3-MoE FP8's published layout from a float checkpoint (numpy / ml_dtypes,
    ``block_fp8.quantize``): each decoder projection (experts' per-expert tensors included) as ``weight
    F8_E4M3[out, in]`` + ``weight_scale_inv float32`` per ``block``, and ``quantization_config = {"quant_method":
    "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": block}`` (Qwen3-MoE's also lists
    ``modules_to_not_convert``: the LM head and each layer's router, as Qwen publishes it). ``dequantized_dir`` gets
    the same model with those weights dequantized back to float32 (what the quantized checkpoint means: the
    reference to compare against). Returns ``out_dir``."""
    from safetensors.numpy import load_file, save_file

    from models.quantization.block_fp8 import dequantize, quantize

    float_dir, out_dir, dequantized_dir = Path(float_dir), Path(out_dir), Path(dequantized_dir)
    for directory in (out_dir, dequantized_dir):
        directory.mkdir(parents=True, exist_ok=True)
    quantized, dequantized = {}, {}
    for file in sorted(float_dir.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            parts = name.split(".")
            if parts[-1] == "weight" and parts[-2] in _BLOCK_FP8_PROJECTIONS and "layers" in parts:
                weight, scale_inv = quantize(tensor.astype(np.float32), block)
                quantized[name], quantized[name + "_scale_inv"] = weight, scale_inv
                dequantized[name] = dequantize(weight, scale_inv, block)
            else:
                quantized[name] = dequantized[name] = tensor
    save_file(quantized, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(dequantized, str(dequantized_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_dir / "config.json").read_text())
    (dequantized_dir / "config.json").write_text(json.dumps(config, indent=2))
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "weight_block_size": list(block)}
    if config["architectures"][0] == "Qwen3MoeForCausalLM":
        config["quantization_config"]["modules_to_not_convert"] = ["lm_head", *(
            f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"]))]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir
