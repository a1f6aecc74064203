"""Building and loading quantized ``LlamaForCausalLM`` models.

The model is the ordinary one with each quantized projection (an ``nnx.Linear`` attribute of ``self_attn`` / ``mlp``)
replaced by a ``WeightOnlyLinear``, ``Fp8Linear`` or ``Int8Linear`` (same call contract); everything else
(embeddings, norms, biases, the LM head, unquantized projections) is read by ``models.loader`` as usual. The
structure depends only on the ``QuantConfig`` and the model shape (act-order ``g_idx`` exactly when ``desc_act``,
as vLLM), so the weights cache can restore into ``abstract_quantized_model`` without reading the checkpoint.

  * ``load_quantized_model(path, config, qc, ...)``: one device. Serialized checkpoints are converted tensor by
    tensor (``formats``); online methods (and random weights of a serialized method) quantize the float model
    after loading it.
  * ``shard_quantized_model(model, plan)``: place a loaded (unfused) quantized model on a tensor-parallel mesh.
  * ``fuse_quantized`` is reached through ``models.llama.fuse_projections`` (``concat`` of the module classes).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import loader
from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from models.quantization.config import QuantConfig
from models.quantization.formats import KV_SCALE_NAMES, convert_projection, projection_tensor_names
from models.quantization.linear import (FP8_DTYPE, Fp8Linear, Int8Linear, WeightOnlyLinear, quantize_weight_fp8,
                                        quantize_weight_int8, quantize_weight_only)

PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


def quantized_projections(config: ModelConfig, qc: QuantConfig) -> list[tuple[int, str, str]]:
    """``(layer, "self_attn" | "mlp", projection name)`` of every projection ``qc`` quantizes."""
    return [(i, parent, name) for i in range(config.num_hidden_layers) for parent, names in PROJECTIONS.items()
            for name in names if qc.is_quantized(f"model.layers.{i}.{parent}.{name}")]


def _has_g_idx(qc: QuantConfig) -> bool:
    return qc.desc_act and qc.group_size != -1


def _swap(model: LlamaForCausalLM, qc: QuantConfig, make: Callable[[int, str, str, nnx.Linear], nnx.Module]):
    for layer_idx, parent, name in quantized_projections(model.config, qc):
        owner = getattr(model.model.layers[layer_idx], parent)
        setattr(owner, name, make(layer_idx, parent, name, getattr(owner, name)))
    return model


def _bias(linear: nnx.Linear):
    return None if linear.bias is None else linear.bias[...]


def _empty_module(qc: QuantConfig, name: str, linear: nnx.Linear, dtype, matmul_impl: str) -> nnx.Module:
    """A quantized module of projection ``name``, ``linear``'s shape, zero-filled (built under ``nnx.eval_shape``:
    shapes only)."""
    in_features, out_features = linear.kernel.shape
    if qc.kind == "int8":
        return Int8Linear(jnp.zeros((out_features, in_features), jnp.int8), jnp.zeros((out_features,), jnp.float32),
                          bias=_bias(linear), dtype=dtype, matmul_impl=matmul_impl)
    if qc.kind == "fp8":
        scale_len = out_features if qc.weight_strategy == "channel" else 1
        scheme = qc.activation_scheme_for(name)
        return Fp8Linear(jnp.zeros((out_features, in_features), FP8_DTYPE), jnp.zeros((scale_len,), jnp.float32),
                         jnp.zeros((1,), jnp.float32) if scheme == "static" else None, _bias(linear),
                         activation_scheme=scheme, dtype=dtype, matmul_impl=matmul_impl)
    group_size = in_features if qc.group_size == -1 else qc.group_size
    groups = in_features // group_size
    return WeightOnlyLinear(
        jnp.zeros((in_features * qc.bits // 32, out_features), jnp.int32), jnp.zeros((groups, out_features), dtype),
        jnp.zeros((groups, out_features), dtype), jnp.zeros((in_features,), jnp.int32) if _has_g_idx(qc) else None,
        _bias(linear), bits=qc.bits, group_size=group_size, dtype=dtype, matmul_impl=matmul_impl)


def quantize_structure(model: LlamaForCausalLM, qc: QuantConfig, *, matmul_impl: str = "auto",
                       kv_cache_scales: bool = False) -> LlamaForCausalLM:
    """In place: every quantized projection becomes a zero-filled quantized module (for ``nnx.eval_shape``); with
    ``kv_cache_scales``, every attention gets its ``kv_scale``."""
    _swap(model, qc, lambda i, p, n, linear: _empty_module(qc, n, linear, model.dtype, matmul_impl))
    if kv_cache_scales:
        for layer in model.model.layers:
            layer.self_attn.kv_scale = nnx.Param(jnp.ones((2,), jnp.float32))
    return model


def abstract_quantized_model(config: ModelConfig, qc: QuantConfig, dtype, *, kv_cache_scales: bool = False,
                             make_model: Callable[[], LlamaForCausalLM] | None = None,
                             transform: Callable | None = None, matmul_impl: str = "auto"):
    """The quantized model with shapes only; ``make_model`` builds the float model (default a
    ``LlamaForCausalLM(config)``), ``transform`` is applied last (e.g. ``fuse_projections``); ``matmul_impl`` of
    its quantized modules (``tensor_parallel_matmul_impl`` for a tensor-parallel model)."""
    dtype = loader.resolve_dtype(dtype)
    make_model = make_model or (lambda: LlamaForCausalLM(config, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))

    def build():
        model = quantize_structure(make_model(), qc, kv_cache_scales=kv_cache_scales, matmul_impl=matmul_impl)
        return transform(model) if transform is not None else model

    return nnx.eval_shape(build)


def quantize_model(model: LlamaForCausalLM, qc: QuantConfig, *, matmul_impl: str = "auto") -> LlamaForCausalLM:
    """In place: quantize every projection ``qc`` names from the model's float weights (online ``fp8`` / ``int8``,
    or random weights in a serialized method's scheme: round-to-nearest with its bits, groups and zero points)."""
    dtype = model.dtype
    if qc.kind == "int8":
        quant = jax.jit(quantize_weight_int8)

        def make(i, parent, name, linear):
            weight, scale = quant(linear.kernel[...])
            return Int8Linear(weight, scale, bias=_bias(linear), dtype=dtype, matmul_impl=matmul_impl)
    elif qc.kind == "fp8":
        quant = jax.jit(quantize_weight_fp8, static_argnames="strategy")

        def make(i, parent, name, linear):
            weight, scale = quant(linear.kernel[...], strategy=qc.weight_strategy)
            scheme = qc.activation_scheme_for(name)
            input_scale = jnp.full((1,), 0.05, jnp.float32) if scheme == "static" else None
            return Fp8Linear(weight, scale, input_scale, _bias(linear), activation_scheme=scheme, dtype=dtype,
                             matmul_impl=matmul_impl)
    else:
        quant = jax.jit(quantize_weight_only, static_argnames=("bits", "group_size", "zero_point", "dtype"))

        def make(i, parent, name, linear):
            in_features = linear.kernel.shape[0]
            group_size = in_features if qc.group_size == -1 else qc.group_size
            qweight, scales, zeros = quant(linear.kernel[...], bits=qc.bits, group_size=group_size,
                                           zero_point=qc.zero_point, dtype=dtype)
            g_idx = jnp.asarray(np.arange(in_features, dtype=np.int32) // group_size) if _has_g_idx(qc) else None
            return WeightOnlyLinear(qweight, scales, zeros, g_idx, _bias(linear), bits=qc.bits,
                                    group_size=group_size, dtype=dtype, matmul_impl=matmul_impl)
    return _swap(model, qc, make)


def load_quantized_model(path: str | os.PathLike | None, config: ModelConfig, qc: QuantConfig, *,
                         dtype: Any = "bfloat16", load_format: str = "auto", seed: int = 0,
                         kv_cache_scales: bool = False, matmul_impl: str = "auto") -> LlamaForCausalLM:
    """A quantized ``LlamaForCausalLM`` on ``jax.devices()[0]`` (HF projection layout, not fused).

    Args:
      path, dtype, load_format, seed: as ``models.loader.load_model``.
      qc: from ``resolve_quantization``.
      kv_cache_scales: attach each layer's FP8 KV-cache scales (``self_attn.kv_scale = [k_scale, v_scale]``, read
        from the checkpoint when it has them, else 1.0).
    Raises:
      ValueError: a missing or unexpected tensor, a wrong shape or dtype (named), or a checkpoint layout ``qc``
        does not describe.
    """
    if not qc.serialized or load_format == "dummy":
        model, _ = loader.load_model(path, dtype=dtype, load_format=load_format, seed=seed, config=config)
        model = quantize_model(model, qc, matmul_impl=matmul_impl)
        kv_scales = _read_kv_scales(path, config, load_format) if kv_cache_scales else None
    else:
        model, kv_scales = _load_serialized(Path(path), config, qc, loader.resolve_dtype(dtype), matmul_impl,
                                            kv_cache_scales)
    if kv_cache_scales:
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.kv_scale = nnx.Param(jnp.asarray(kv_scales[i], jnp.float32))
    return model


def _quantized_tensor_prefixes(config: ModelConfig, qc: QuantConfig) -> set[str]:
    return {f"model.layers.{i}.{parent}.{name}" for i, parent, name in quantized_projections(config, qc)}


def _kv_scale_name(layer: int, which: str, names) -> str | None:
    for suffix in KV_SCALE_NAMES[which]:
        name = f"model.layers.{layer}.self_attn.{suffix}"
        if name in names:
            return name
    return None


def _read_kv_scales(path, config: ModelConfig, load_format: str) -> list[np.ndarray]:
    """Per layer ``float32[2]`` = (k_scale, v_scale) from the checkpoint; 1.0 where it has none."""
    files = {} if path is None or load_format == "dummy" else loader.checkpoint_tensor_files(Path(path))
    scales = []
    for i in range(config.num_hidden_layers):
        pair = []
        for which in ("k", "v"):
            name = _kv_scale_name(i, which, files)
            if name is None:
                pair.append(1.0)
            else:
                with loader._open_safetensors(files[name]) as handle:
                    pair.append(float(np.asarray(loader._read_tensor(handle, name, files[name]),
                                                 np.float32).reshape(-1)[0]))
        scales.append(np.asarray(pair, np.float32))
    return scales


def _is_kv_scale(name: str) -> bool:
    return any(name.endswith(f".self_attn.{s}") for names in KV_SCALE_NAMES.values() for s in names)


def _load_serialized(path: Path, config: ModelConfig, qc: QuantConfig, dtype, matmul_impl: str,
                     kv_cache_scales: bool):
    tensor_files = loader.checkpoint_tensor_files(path)
    prefixes = _quantized_tensor_prefixes(config, qc)

    def owner(name: str) -> str | None:
        module = name.rsplit(".", 1)[0]
        return module if module in prefixes and not name.endswith(".bias") else None

    float_files = {n: f for n, f in tensor_files.items() if owner(n) is None and not _is_kv_scale(n)}
    graphdef, flat_state = loader.abstract_flat_state(config, dtype)
    variables = dict(flat_state)
    quantized_kernels = {("model", "layers", i, parent, name, "kernel")
                         for i, parent, name in quantized_projections(config, qc)}
    expected = {p: tuple(v.get_value().shape) for p, v in flat_state if p not in quantized_kernels}
    device = jax.local_devices()[0]
    for param_path, array, transposed in loader.iter_checkpoint_params(float_files, expected, config):
        value = jax.device_put(array, device).astype(variables[param_path].get_value().dtype)
        variables[param_path].set_value(loader.to_model_layout(value, transposed))
    for param_path in quantized_kernels:  # replaced below; a placeholder keeps nnx.merge happy
        variables[param_path].set_value(jnp.zeros((0,), dtype))
    model = nnx.merge(graphdef, nnx.from_flat_state(flat_state))

    by_module: dict[str, list[str]] = {}
    for name in tensor_files:
        module = owner(name)
        if module is not None:
            by_module.setdefault(module, []).append(name)

    def make(i, parent, proj, linear):
        module = f"model.layers.{i}.{parent}.{proj}"
        required, optional = projection_tensor_names(qc, module)
        present = set(by_module.get(module, ()))
        missing = [n for n in required if n not in present]
        if missing:
            raise ValueError(f"checkpoint is missing tensor(s) {missing} for {qc.method}")
        unexpected = sorted(present - set(required) - set(optional))
        if unexpected:
            raise ValueError(f"checkpoint has unexpected tensor(s) {unexpected} for {qc.method}")
        tensors = {}
        for name in sorted(present):
            with loader._open_safetensors(tensor_files[name]) as handle:
                tensors[name] = loader._read_tensor(handle, name, tensor_files[name])
        in_features, out_features = _proj_shape(config, proj)
        converted = convert_projection(qc, module, tensors, in_features, out_features)
        put = lambda a, dt=None: None if a is None else jax.device_put(  # noqa: E731
            a if dt is None else np.asarray(a).astype(dt), device)
        bias = _bias(linear)
        if converted["kind"] == "fp8":
            scheme = qc.activation_scheme_for(proj)
            return Fp8Linear(put(converted["weight"]), put(converted["weight_scale"]),
                             put(converted["input_scale"]) if scheme == "static" else None, bias,
                             activation_scheme=scheme, dtype=dtype, matmul_impl=matmul_impl)
        g_idx = converted["g_idx"]
        if _has_g_idx(qc) and g_idx is None:  # act-order checkpoint whose order is the plain one
            g_idx = np.arange(in_features, dtype=np.int32) // converted["group_size"]
        elif not _has_g_idx(qc):
            g_idx = None  # without desc_act the groups are contiguous (vLLM ignores g_idx then too)
        np_dtype = np.dtype(dtype)
        return WeightOnlyLinear(put(converted["qweight"]), put(converted["scales"], np_dtype),
                                put(converted["zeros"], np_dtype), put(g_idx), bias, bits=converted["bits"],
                                group_size=converted["group_size"], dtype=dtype, matmul_impl=matmul_impl)

    _swap(model, qc, make)
    kv_scales = _read_kv_scales(path, config, "auto") if kv_cache_scales else None
    return model, kv_scales


def _proj_shape(config: ModelConfig, name: str) -> tuple[int, int]:
    """(in_features, out_features) of a projection of the checkpoint's shape."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    return {"q_proj": (hidden, q_dim), "k_proj": (hidden, kv_dim), "v_proj": (hidden, kv_dim),
            "o_proj": (q_dim, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
            "down_proj": (inter, hidden)}[name]


def tensor_parallel_matmul_impl(qc: QuantConfig) -> str:
    """The ``matmul_impl`` of a tensor-parallel model's quantized modules: an XLA form, which the partitioner splits
    (the Pallas kernels run on one device's arrays). FP8: the dot on the upcast weights ("xla_native", weight-only at
    every batch size: one GPU runs it up to 127 rows and the float8 dot above, where it is faster on the H200; the
    tensor-parallel float8 dot is not measured, and weight-only does not round the activations to e4m3); online int8
    (FP8's layout) the same; AWQ / GPTQ integer weights: dequantize + dot ("xla", on their packed storage)."""
    return "xla" if qc.kind == "weight_only" else "xla_native"


def shard_quantized_model(model: LlamaForCausalLM, plan, qc: QuantConfig, *, kv_cache_scales: bool = False):
    """Place a loaded quantized model (one device, HF layout) on ``plan``'s mesh: a
    ``TensorParallelLlamaForCausalLM`` with every leaf in the sharding ``plan.state_shardings`` gives it.

    Raises ValueError when the plan rewrites heads (heads that do not divide the tensor-parallel size): padded
    heads of packed integer weights are not supported.
    """
    from models.tensor_parallel import TensorParallelLlamaForCausalLM

    if not plan.head_layout.is_identity:
        raise ValueError(f"quantization={qc.method!r} with tensor_parallel_size={plan.tensor_parallel_size}: the "
                         f"attention heads ({plan.config.num_attention_heads} q, {plan.config.num_key_value_heads} "
                         f"kv) must divide the tensor-parallel size")
    dtype = model.dtype
    abstract = abstract_quantized_model(
        plan.model_config, qc, dtype, kv_cache_scales=kv_cache_scales, matmul_impl=tensor_parallel_matmul_impl(qc),
        make_model=lambda: TensorParallelLlamaForCausalLM(plan, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    targets = dict(nnx.to_flat_state(plan.state_shardings(abstract_state)))
    placed = [(path, variable.replace(jax.device_put(variable.get_value(), targets[path].get_value())))
              for path, variable in nnx.to_flat_state(nnx.state(model))]
    return nnx.merge(graphdef, nnx.from_flat_state(placed))
