"""Quantized weights: AWQ and GPTQ checkpoints (int4/int8 weight-only), FP8 checkpoints (compressed-tensors
float-quantized, vLLM's ``fp8``), and online ``fp8`` / ``int8`` quantization of a bf16 checkpoint at load time.

* ``config``: ``QuantConfig`` (what a checkpoint or ``--quantization`` asks for) and ``resolve_quantization``
  (``quantization_config`` of config.json vs the flag, as vLLM checks it). JAX-free.
* ``linear``: the NNX modules swapped in for ``nnx.Linear`` projections (same ``__call__(x)`` contract):
  ``WeightOnlyLinear`` (packed int4/int8 + group scales and zero points, AWQ / GPTQ), ``Fp8Linear`` (float8_e4m3fn
  weights, XLA float8 dots) and ``Int8Linear`` (online int8: ``Fp8Linear``'s layout and kernels on int8); their jnp
  matmuls and the online quantizers; ``compiler_options``, the XLA options of programs that run such a model.
* ``packing``: the canonical packed ``int32`` layout of weight-only integers (``pack_int32`` / ``unpack_int32``).
* ``native``: native ``int4`` / ``int8`` weight storage and XLA's matmuls on it.
* ``formats``: the on-disk layouts (AWQ GEMM, GPTQ v1/v2, FP8) -> the modules' canonical arrays.
* ``load``: building / loading a quantized ``LlamaForCausalLM`` (one device or sharded).
* ``paged_jax/ops/quantized_matmul``: the Pallas weight-only matmul (dequantization inside the kernel).
"""

import importlib

_EXPORTS = {
    "QuantConfig": "models.quantization.config",
    "QUANTIZATION_METHODS": "models.quantization.config",
    "resolve_quantization": "models.quantization.config",
    "WeightOnlyLinear": "models.quantization.linear",
    "Fp8Linear": "models.quantization.linear",
    "Int8Linear": "models.quantization.linear",
    "compiler_options": "models.quantization.linear",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'models.quantization' has no attribute {name!r}")
