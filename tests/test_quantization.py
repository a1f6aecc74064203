"""Quantized models (models.quantization): format detection, AWQ / GPTQ / FP8 checkpoints written in their real
on-disk layouts and checked against independent implementations (compressed-tensors' AutoAWQ converter and
``dequantize``, transformers + compressed-tensors for FP8, the GPTQ format spec re-implemented here), greedy decoding
equal to the fp32 model with the dequantized weights, the engine, the weights cache, tensor parallelism."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from models.attention import dense_causal_attention
from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from models.quantization.config import resolve_quantization
from models.quantization.load import PROJECTIONS, load_quantized_model
from models.quantization.testing import save_quantized_checkpoint
from models.testing import save_random_hf_checkpoint, tiny_config

PROMPT = [5, 17, 99, 3, 250, 41]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    # hidden 128 holds AWQ group sizes up to 128; a wider init than the default makes greedy tokens sensitive to
    # small weight errors (a wrong nibble order cannot hide).
    hf = tiny_config("llama", hidden_size=128, intermediate_size=256, num_attention_heads=8, num_key_value_heads=4,
                     initializer_range=0.2)
    return save_random_hf_checkpoint(hf, tmp_path_factory.mktemp("float"))


def _load(path, qc=None, **kw):
    hf = json.loads((path / "config.json").read_text())
    qc = qc or resolve_quantization(None, hf)
    return load_quantized_model(path, ModelConfig.from_hf_config(hf), qc, dtype="float32", **kw)


def _projections(model):
    for i, layer in enumerate(model.model.layers):
        for parent, names in PROJECTIONS.items():
            for name in names:
                yield f"model.layers.{i}.{parent}.{name}", getattr(getattr(layer, parent), name)


def _dequantized_reference(model) -> LlamaForCausalLM:
    """The same model in fp32 with every quantized projection replaced by an nnx.Linear of its dequantized weights."""
    from flax import nnx

    ref = LlamaForCausalLM(model.config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    ref.model.embed_tokens.embedding.set_value(model.model.embed_tokens.embedding[...])
    ref.model.norm.scale.set_value(model.model.norm.scale[...])
    if model.lm_head is not None:
        ref.lm_head.kernel.set_value(model.lm_head.kernel[...])
    for layer, ref_layer in (zip(model.model.layers, ref.model.layers)):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            getattr(ref_layer, norm).scale.set_value(getattr(layer, norm).scale[...])
        for parent, names in PROJECTIONS.items():
            for name in names:
                module = getattr(getattr(layer, parent), name)
                target = getattr(getattr(ref_layer, parent), name)
                kernel = module.dequantized_kernel() if hasattr(module, "dequantized_kernel") else module.kernel[...]
                target.kernel.set_value(kernel.astype(jnp.float32))
    return ref


def _greedy(model, prompt=PROMPT, n=NEW_TOKENS):
    """Dense-attention greedy decoding, eager on one padded shape (each op compiles once for all steps and all
    models of this shape): (tokens, last-step logits)."""
    ids = list(prompt)
    total = len(prompt) + n
    attention = dense_causal_attention(np.zeros((total,), np.int32), model.config.head_dim ** -0.5)
    positions = jnp.arange(total, dtype=jnp.int32)
    for _ in range(n):
        padded = jnp.asarray(ids + [0] * (total - len(ids)), jnp.int32)  # causal: padding after t never seen
        hidden, _ = model(padded, positions, None, attention)
        logits = model.compute_logits(hidden)[len(ids) - 1]
        ids.append(int(jnp.argmax(logits)))
    return ids[len(prompt):], np.asarray(logits)


def _logits(model, ids=PROMPT):
    """float32[len(ids), V] of one dense forward."""
    t = len(ids)
    attention = dense_causal_attention(np.zeros((t,), np.int32), model.config.head_dim ** -0.5)
    hidden, _ = model(jnp.asarray(ids, jnp.int32), jnp.arange(t, dtype=jnp.int32), None, attention)
    return np.asarray(model.compute_logits(hidden))


# -- detection --------------------------------------------------------------------------------------------------------

def test_resolve_quantization_as_vllm():
    awq = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                   "version": "gemm"}}
    assert resolve_quantization(None, awq) == resolve_quantization("awq", awq)
    assert resolve_quantization(None, awq).group_size == 64
    assert resolve_quantization(None, {}) is None
    assert resolve_quantization("int8", {}).serialized is False
    online_fp8 = resolve_quantization("fp8", {})
    assert online_fp8.activation_scheme == "dynamic_token"
    # Online fp8 quantizes the inputs of q/k/v and gate/up only; a checkpoint's scheme covers every projection.
    assert [online_fp8.activation_scheme_for(p) for p in ("q_proj", "v_proj", "o_proj", "up_proj", "down_proj")] \
        == ["dynamic_token", "dynamic_token", None, "dynamic_token", None]
    for flag, cfg, match in [
        ("bitsandbytes", {}, "unknown quantization method"),
        ("gptq", awq, r"model config \(awq\) does not match .* \(gptq\)"),
        ("awq", {}, "needs a checkpoint quantized with awq"),
        (None, {"quantization_config": {"quant_method": "gptq", "bits": 3}}, "bits=3"),
        (None, {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 256}}, "group_size=256"),
        (None, {"quantization_config": {"quant_method": "marlin"}}, "'marlin' is not supported"),
        (None, {"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                        "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
                                        "ignore": ["lm_head"]}}, "only FP8"),
    ]:
        with pytest.raises(ValueError, match=match):
            resolve_quantization(flag, cfg)
    from models.quantization.linear import quantize_weight_only

    with pytest.raises(ValueError, match="group_size 128 does not divide a layer's 576 input features"):
        quantize_weight_only(jnp.ones((576, 8)), bits=4, group_size=128, zero_point=True, dtype=jnp.bfloat16)
    from paged_jax.config import EngineArgs

    with pytest.raises(ValueError, match="quantization"):
        EngineArgs(quantization="bnb")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int8")


# -- formats against independent implementations ----------------------------------------------------------------------

def test_awq_matches_compressed_tensors_converter(float_dir, tmp_path):
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file

    for group_size in (32, 64, 128):
        path = save_quantized_checkpoint(float_dir, tmp_path / f"awq{group_size}", "awq", group_size=group_size)
        model = _load(path)
        stored = load_file(str(path / "model.safetensors"))
        converter = AutoAWQConverter(group_size=group_size)
        args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group_size)
        for name, module in _projections(model):
            weight, scale, zero = converter._convert_gemm_module(
                stored[f"{name}.qweight"], stored[f"{name}.scales"].float(), stored[f"{name}.qzeros"])
            expected = dequantize(weight.float(), scale, zero.float(), args, dtype=torch.float32).numpy().T
            np.testing.assert_array_equal(np.asarray(module.dequantized_kernel()), expected, err_msg=name)


def _gptq_spec_dequantize(stored, name, bits, offset=1):
    """GPTQ's dequantization straight from the format (AutoGPTQ's torch reference kernel): unpack qweight along
    rows and qzeros along columns with shifts, zero = stored + 1 (v1), w = (q - zero[g_idx]) * scale[g_idx]."""
    qweight, qzeros = stored[f"{name}.qweight"], stored[f"{name}.qzeros"]
    scales, g_idx = stored[f"{name}.scales"].float(), stored[f"{name}.g_idx"].long()
    wf = torch.arange(0, 32, bits, dtype=torch.int32)
    zeros = torch.bitwise_and(torch.bitwise_right_shift(qzeros.unsqueeze(2), wf.view(1, 1, -1)), 2 ** bits - 1)
    zeros = zeros.reshape(qzeros.shape[0], -1) + offset
    weight = torch.bitwise_and(torch.bitwise_right_shift(qweight.unsqueeze(1), wf.view(1, -1, 1)), 2 ** bits - 1)
    weight = weight.reshape(-1, qweight.shape[1])
    return ((weight - zeros[g_idx]).float() * scales[g_idx]).numpy()


@pytest.mark.parametrize("bits,group_size,sym,desc_act", [(4, 32, False, True), (8, -1, True, False),
                                                          (4, 64, True, False)])
def test_gptq_matches_format_spec(float_dir, tmp_path, bits, group_size, sym, desc_act):
    from safetensors.torch import load_file

    path = save_quantized_checkpoint(float_dir, tmp_path / "gptq", "gptq", bits=bits, group_size=group_size,
                                     sym=sym, desc_act=desc_act)
    model = _load(path)
    stored = load_file(str(path / "model.safetensors"))
    for name, module in _projections(model):
        assert (module.g_idx is not None) == desc_act
        np.testing.assert_array_equal(np.asarray(module.dequantized_kernel()),
                                      _gptq_spec_dequantize(stored, name, bits), err_msg=name)
    if not desc_act:
        return
    reference = _dequantized_reference(model)
    np.testing.assert_allclose(_logits(model), _logits(reference), atol=2e-4, rtol=1e-4)
    # Greedy through the jittable research API (paged kernels, one compile) = the dequantized fp32 model's.
    from paged_jax.research.generate import generate

    out = generate(model, jnp.asarray([PROMPT], jnp.int32), jnp.asarray([len(PROMPT)], jnp.int32),
                   max_new_tokens=NEW_TOKENS)
    ref_tokens, _ = _greedy(reference)
    assert np.asarray(out.tokens)[0].tolist() == ref_tokens


@pytest.mark.parametrize("strategy,activations", [("tensor", "static"), ("channel", "dynamic_token")])
def test_fp8_matches_compressed_tensors_and_transformers(float_dir, tmp_path, strategy, activations):
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from models.quantization.testing import _fp8_args

    path = save_quantized_checkpoint(float_dir, tmp_path / "fp8", "fp8", weight_strategy=strategy,
                                     activations=activations)
    model = _load(path)
    stored = load_file(str(path / "model.safetensors"))
    args, _ = _fp8_args(strategy, activations)
    for name, module in _projections(model):
        scale = stored[f"{name}.weight_scale"]
        expected = dequantize(stored[f"{name}.weight"], scale, torch.zeros_like(scale), args,
                              dtype=torch.float32).numpy().T
        np.testing.assert_array_equal(np.asarray(module.dequantized_kernel()), expected, err_msg=name)
    if activations == "static":
        return  # the transformers run below covers the dynamic W8A8 path (each run costs seconds of test time)
    # W8A8: the reference quantizes activations too: transformers running the checkpoint through compressed-tensors
    # (weights decompressed, input activations fake-quantized, fp32).
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    tokens, logits = _greedy(model)
    assert tokens == hf_out.sequences[0, len(PROMPT):].tolist()
    np.testing.assert_allclose(logits, hf_out.logits[-1][0].numpy(), atol=2e-3, rtol=1e-3)


# Slow: int8 / FP8 numerics stay covered by the kernel and per-format checks in this file and test_quantized_kernels.
@pytest.mark.slow
def test_smollm2_perplexity_int8_fp8(smollm2_dir, smollm2_tokenizer, tmp_path):
    """Online int8 / fp8 (bf16 compute) lose at most 1% / 2% perplexity against bf16 on the benchmark's whole text
    (3% for online fp8 with its per-token activation scales):
    int8, fp8 weight-only (what one GPU runs below ``FP8_DOT_MIN_ROWS`` rows, and tensor parallelism) and online fp8
    as it runs off the GPU and from that many rows on one (the float8 dot with per-token activation scales on the
    q/k/v and gate/up inputs, o_proj and down_proj weight-only). The 4-bit formats are reported by
    benchmarks/perplexity.py, not tested: a round-to-nearest int4 SmolLM2 says little about AWQ / GPTQ models."""
    from benchmarks.perplexity import MORE_TEXT, TEXT, model_for, perplexity

    whole = smollm2_tokenizer.encode(TEXT + MORE_TEXT)
    results = {}
    for name in ("bf16", "int8", "fp8", "fp8-weight-only"):
        model = model_for(name, smollm2_dir, tmp_path)
        results[name] = perplexity(model, whole)
        if name == "fp8":
            layer = model.model.layers[0]
            schemes = [getattr(module, proj).activation_scheme for module, proj in (
                (layer.self_attn, "q_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "up_proj"),
                (layer.mlp, "down_proj"))]
            assert schemes == ["dynamic_token", None, "dynamic_token", None]
    print("SmolLM2 perplexity (whole text):", json.dumps(results))
    bf16 = results["bf16"]
    assert 0.95 * bf16 < results["int8"] <= 1.01 * bf16
    assert 0.95 * bf16 < results["fp8-weight-only"] <= 1.02 * bf16
    # Online fp8 also rounds the activations (per token) on the CPU's emulated float8 dot: a looser bound than the
    # weight-only formats'.
    assert 0.95 * bf16 < results["fp8"] <= 1.03 * bf16


# -- engine, weights cache, tensor parallelism ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def awq_dir(float_dir, tmp_path_factory):
    return save_quantized_checkpoint(float_dir, tmp_path_factory.mktemp("awq"), "awq", group_size=64)


def _engine_model(llm):
    from flax import nnx

    runner = llm.llm_engine.engine_core.runner
    return nnx.merge(runner._graphdef, jax.tree.unflatten(runner._state_treedef, runner._param_leaves))


def _record_engine_loading(monkeypatch, tmp_path) -> tuple[dict, list]:
    """(the KV sizing's keyword arguments, the models ``place_contiguously`` placed) of the next engine built."""
    import paged_jax.engine.core_setup as engine_module
    from paged_jax.worker import device_memory

    sizing, real_sizing = {}, engine_module.determine_num_blocks

    def recording_sizing(*args, **kwargs):
        sizing.update(kwargs)
        return real_sizing(*args, **kwargs)

    monkeypatch.setattr(engine_module, "determine_num_blocks", recording_sizing)
    placed, real_place = [], device_memory.place_contiguously
    monkeypatch.setattr(device_memory, "place_contiguously", lambda model: (placed.append(model), real_place(model)))
    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path))
    return sizing, placed


def test_engine_awq_greedy_equals_dequantized_fp32(awq_dir, tmp_path, monkeypatch):
    """The AWQ engine decodes the dequantized fp32 model's greedy tokens; its KV sizing leaves free the bytes XLA
    dequantizes in the widest decoder layer (on CPU every int4 matmul is XLA's dequantize + dot: each projection's
    in x out in the compute dtype); a serialized checkpoint is not placed again."""
    from flax import nnx

    from models.quantization.linear import WeightOnlyLinear
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    sizing, placed = _record_engine_loading(monkeypatch, tmp_path)
    llm = LLM(model=str(awq_dir), max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              num_gpu_blocks_override=16, use_tqdm=False)
    engine = llm.llm_engine
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    reference = _dequantized_reference(_load(awq_dir))
    assert out[0].outputs[0].token_ids == _greedy(reference)[0]
    assert engine.engine_core.runner.num_compiles_since_warmup == 0
    per_layer = {}
    for path, m in nnx.iter_graph(_engine_model(llm)):
        if isinstance(m, WeightOnlyLinear):
            assert path[:2] == ("model", "layers")
            per_layer[path[2]] = per_layer.get(path[2], 0) + m.in_features * m.out_features * 4
    assert len(per_layer) == reference.config.num_hidden_layers
    assert sizing["dequantization_bytes"] == max(per_layer.values()) > 0
    assert placed == []


def test_engine_int8_greedy_equals_dequantized_fp32(float_dir, tmp_path, monkeypatch):
    """``quantization="int8"``: every projection (fused as the engine runs them) is an ``Int8Linear`` (int8 [out, in],
    a float32 scale per output channel); the engine decodes the greedy tokens of the fp32 model with the same
    dequantized weights; the weights quantized on the device at load are placed again before the KV sizing, which
    leaves no dequantization headroom (no XLA dequantize + dot)."""
    from flax import nnx

    from models.quantization.linear import Int8Linear, WeightOnlyLinear
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    sizing, placed = _record_engine_loading(monkeypatch, tmp_path)
    llm = LLM(model=str(float_dir), quantization="int8", dtype="float32", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=32, num_gpu_blocks_override=16, use_tqdm=False)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    model = _engine_model(llm)
    modules = [m for _, m in nnx.iter_graph(model) if isinstance(m, (Int8Linear, WeightOnlyLinear))]
    assert modules and all(type(m) is Int8Linear and m.weight.dtype == jnp.int8 for m in modules)
    assert len(modules) == 4 * model.config.num_hidden_layers  # qkv, o, gate_up, down: q/k/v and gate/up fused
    reference = _dequantized_reference(_load(float_dir, resolve_quantization("int8", {})))
    assert out[0].outputs[0].token_ids == _greedy(reference)[0]
    assert llm.llm_engine.engine_core.runner.num_compiles_since_warmup == 0
    assert sizing["dequantization_bytes"] == 0
    assert len(placed) == 1
    # Each 8-bit class holds its own element type only; int8 is weight-only.
    from models.quantization.linear import Fp8Linear, quantize_weight_fp8, quantize_weight_int8

    w = jax.random.normal(jax.random.key(0), (32, 16), jnp.float32)
    with pytest.raises(ValueError, match="Int8Linear weights must be int8"):
        Int8Linear(*quantize_weight_fp8(w), dtype=jnp.float32)
    with pytest.raises(ValueError, match="Fp8Linear weights must be float8_e4m3fn"):
        Fp8Linear(*quantize_weight_int8(w), activation_scheme=None, dtype=jnp.float32)
    with pytest.raises(ValueError, match="weight-only"):
        Int8Linear(*quantize_weight_int8(w), activation_scheme="dynamic_token", dtype=jnp.float32)


def test_engine_tensor_parallel_fp8_runs_weight_only(float_dir, tmp_path, monkeypatch):
    """``--quantization fp8`` with ``tensor_parallel_size=2`` (the engine's loader, 2 CPU devices): every FP8 module
    runs the weight-only XLA dot (``tensor_parallel_matmul_impl``), converted or restored from the weights cache, and
    greedy output equals one device's weight-only FP8 model, token for token, with nothing compiled after warm-up."""
    from flax import nnx

    from models.loader import load_model
    from models.quantization import load
    from models.quantization.load import quantize_model
    from paged_jax.config import EngineArgs
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.worker.model_loader import _load_tensor_parallel, resolve_engine_quantization
    from paged_jax.sampling_params import SamplingParams

    def fp8_impls(model):
        return {m.matmul_impl for _, m in nnx.iter_graph(model) if type(m).__name__ == "Fp8Linear"}

    def fp8_schemes(model):  # online fp8: quantized activations on the q/k/v and gate/up inputs only
        return {(path[-1], m.activation_scheme) for path, m in nnx.iter_graph(model)
                if type(m).__name__ == "Fp8Linear"}

    online_schemes = {(p, "dynamic_token") for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")} | {
        ("o_proj", None), ("down_proj", None)}

    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path))
    llm = LLM(model=str(float_dir), quantization="fp8", tensor_parallel_size=2, dtype="float32", max_model_len=64,
              max_num_seqs=2, max_num_batched_tokens=32, num_gpu_blocks_override=16, use_tqdm=False)
    runner = llm.llm_engine.engine_core.runner
    model = _engine_model(llm)
    assert fp8_impls(model) == {"xla_native"}
    assert fp8_schemes(model) == online_schemes
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS), use_tqdm=False)
    single, _ = load_model(float_dir, dtype="float32")
    single = quantize_model(single, resolve_quantization("fp8", {}), matmul_impl="xla_native")
    assert out[0].outputs[0].token_ids == _greedy(single)[0]
    assert runner.num_compiles_since_warmup == 0
    # A second load restores the weights the engine cached (it must not convert) into the same modules.
    monkeypatch.setattr(load, "load_quantized_model", None)
    args = EngineArgs(model=str(float_dir), quantization="fp8", tensor_parallel_size=2, dtype="float32")
    restored, *_ = _load_tensor_parallel(args, str(float_dir), ModelConfig.from_pretrained(float_dir), "float32",
                                         resolve_engine_quantization(args, str(float_dir)))
    assert fp8_impls(restored) == {"xla_native"}
    assert fp8_schemes(restored) == online_schemes


def test_weight_cache_restores_quantized_layout(awq_dir, tmp_path, monkeypatch):
    from paged_jax.config import EngineArgs
    from paged_jax.worker.model_loader import _load_single_device, resolve_engine_quantization

    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path))
    args = EngineArgs(model=str(awq_dir), dtype="float32")
    config = ModelConfig.from_pretrained(awq_dir)
    quant = resolve_engine_quantization(args, str(awq_dir))
    converted = _load_single_device(args, str(awq_dir), config, "float32", quant)
    assert type(converted.model.layers[0].self_attn.qkv_proj).__name__ == "WeightOnlyLinear"  # fused
    from models.quantization import load

    monkeypatch.setattr(load, "load_quantized_model", None)  # a cache hit never converts
    restored = _load_single_device(args, str(awq_dir), config, "float32", quant)
    from flax import nnx

    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(converted)), nnx.to_flat_state(nnx.state(restored))):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))
    assert list(tmp_path.glob("weights/*"))  # an entry was written (the second load restored it)
    # The key names the storage "auto" modules hold: another tuning table's storage is another entry.
    from models.quantization import linear

    assert quant.layout()["weight_storage"] == linear.weight_storage("auto", "int4")
    other = "native" if quant.layout()["weight_storage"] == "packed" else "packed"
    monkeypatch.setattr(linear, "weight_storage", lambda impl, fmt: other)
    assert quant.layout()["weight_storage"] == other


def test_weight_cache_restores_online_int8(float_dir, tmp_path, monkeypatch):
    """Online int8's converted weights (``Int8Linear``: int8 [out, in] and float32 scales, fused) are cached and
    restored without quantizing again, dtypes included."""
    from flax import nnx

    from models.quantization import load
    from models.quantization.linear import Int8Linear
    from paged_jax.config import EngineArgs
    from paged_jax.worker.model_loader import _load_single_device, resolve_engine_quantization

    monkeypatch.setenv("PAGED_JAX_CACHE", str(tmp_path))
    args = EngineArgs(model=str(float_dir), dtype="float32", quantization="int8")
    config = ModelConfig.from_pretrained(float_dir)
    quant = resolve_engine_quantization(args, str(float_dir))
    converted = _load_single_device(args, str(float_dir), config, "float32", quant)
    assert type(converted.model.layers[0].mlp.gate_up_proj) is Int8Linear
    monkeypatch.setattr(load, "load_quantized_model", None)  # a cache hit never converts
    restored = _load_single_device(args, str(float_dir), config, "float32", quant)
    assert type(restored.model.layers[0].mlp.gate_up_proj) is Int8Linear
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(converted)), nnx.to_flat_state(nnx.state(restored))):
        assert a.get_value().dtype == b.get_value().dtype, path
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))


@pytest.mark.parametrize("method", ["gptq", "fp8", "int8"])
def test_tensor_parallel_matches_single_device(float_dir, tmp_path, method):
    """A quantized model on a 2-device mesh computes what the same model computes on one device with the
    implementation tensor parallelism runs: an XLA form, weight-only for FP8 (its activations are not quantized);
    online int8 is FP8's layout and path on int8 weights."""
    from models.quantization.load import shard_quantized_model, tensor_parallel_matmul_impl
    from paged_jax.parallel import ShardingPlan, make_mesh

    if method == "int8":  # online: the float checkpoint quantized at load
        path, qc = float_dir, resolve_quantization("int8", {})
    else:
        kwargs = dict(bits=4, group_size=32, desc_act=True) if method == "gptq" else dict(activations="dynamic_token")
        path = save_quantized_checkpoint(float_dir, tmp_path / method, method, **kwargs)
        qc = resolve_quantization(None, json.loads((path / "config.json").read_text()))
    impl = tensor_parallel_matmul_impl(qc)
    assert impl == ("xla" if method == "gptq" else "xla_native")
    model = _load(path, qc, matmul_impl=impl)
    plan = ShardingPlan.create(model.config, make_mesh(2))
    sharded = shard_quantized_model(model, plan, qc)
    qweight = sharded.model.layers[0].mlp.down_proj
    assert qweight.matmul_impl == impl
    # row-parallel: split along the (packed) inputs: axis 0 of qweight [in / pack, out], axis 1 of FP8's [out, in]
    leaf, in_axis = (qweight.qweight, 0) if method == "gptq" else (qweight.weight, 1)
    assert leaf[...].sharding.spec[in_axis] == "tp" and leaf[...].sharding.spec[1 - in_axis] is None
    t = len(PROMPT)
    ids, pos = jnp.asarray(PROMPT, jnp.int32), jnp.arange(t, dtype=jnp.int32)
    attention = dense_causal_attention(np.zeros((t,), np.int32), model.config.head_dim ** -0.5)
    expected = model.compute_logits(model(ids, pos, None, attention)[0])
    got = sharded.compute_logits(sharded(ids, pos, None, attention)[0])
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), atol=2e-4, rtol=1e-4)


def test_float8_dots_compile_with_an_autotuning_tolerance_for_fp8_rounding(float_dir, monkeypatch):
    """XLA's GEMM autotuner spends minutes sorting out Triton's and cuBLASLt's float8 dots disagreeing at its
    default tolerance: a model with float8 dots (online fp8: W8A8 on q/k/v and gate/up, ``matmul_impl`` auto) is
    compiled with ``compiler_options``' wider tolerance by the engine's forward, ``generate`` and ``score_tokens``;
    a bf16 or weight-only FP8 model with none."""
    from models.loader import load_model
    from models.quantization.linear import FLOAT8_DOT_AUTOTUNE_RTOL, compiler_options
    from models.quantization.load import quantize_model
    from paged_jax.research.generate import generate
    from paged_jax.worker.model_runner import ModelRunner
    from paged_jax.research.scoring import score_tokens

    def fresh(**kw):
        model, config = load_model(float_dir, dtype="float32")
        return (model if kw.get("matmul_impl") is None else
                quantize_model(model, resolve_quantization("fp8", {}), matmul_impl=kw["matmul_impl"])), config

    w8a8, config = fresh(matmul_impl="auto")
    wide = {"xla_gpu_autotune_gemm_rtol": FLOAT8_DOT_AUTOTUNE_RTOL}
    assert compiler_options(w8a8) == wide
    assert compiler_options(fresh()[0]) == {}
    assert compiler_options(fresh(matmul_impl="xla_native")[0]) == {}

    import paged_jax.research.generate as generate_module
    import paged_jax.research.scoring as scoring_module

    generate_module._generate_jit.cache_clear()  # each factory makes its jit again, through the recording jit
    scoring_module._score_jit.cache_clear()
    jitted, real_jit = [], jax.jit

    def recording_jit(fun, *args, **kwargs):
        jitted.append((getattr(fun, "__name__", ""), kwargs.get("compiler_options")))
        return real_jit(fun, *args, **kwargs)

    monkeypatch.setattr(jax, "jit", recording_jit)
    out = generate(w8a8, np.asarray([PROMPT], np.int32), np.asarray([len(PROMPT)], np.int32), max_new_tokens=2,
                   temperature=0.0)
    assert out.tokens.shape == (1, 2)
    scores = score_tokens(w8a8, np.asarray([PROMPT], np.int32), np.asarray([len(PROMPT)], np.int32))
    assert np.isfinite(np.asarray(scores)).all()
    ModelRunner(w8a8, config, num_blocks=8, block_size=16, max_model_len=64, max_num_seqs=2,
                max_num_batched_tokens=32, eos_token_ids=[2])
    assert {"_generate_on_device", "scores", "forward"} <= {name for name, options in jitted
                                                                      if options == wide}
    assert all(options in (None, wide) for _, options in jitted)

    # Inside a caller's trace jit takes no compiler options: generate and score_tokens run there without them.
    from flax import nnx

    graphdef, state = nnx.split(w8a8)
    prompts, lengths = np.asarray([PROMPT], np.int32), np.asarray([len(PROMPT)], np.int32)
    in_user_jit = jax.jit(lambda st: generate((graphdef, st), prompts, lengths, max_new_tokens=2,
                                              temperature=0.0).tokens)(state)
    np.testing.assert_array_equal(np.asarray(in_user_jit), np.asarray(out.tokens))
    grads = jax.grad(lambda st: score_tokens((graphdef, st), prompts, lengths).sum())(state)
    assert all(np.isfinite(np.asarray(g, np.float32)).all() for g in jax.tree.leaves(grads)
               if jnp.issubdtype(g.dtype, jnp.floating))


def test_xla_dequantization_waits_for_the_layer_input():
    """The XLA matmul paths pass the activations and the quantized weights through one optimization barrier, so the
    weights cannot be dequantized before the layer's input exists (the GPU scheduler hoisted every layer's
    dequantization to the start of the forward); the Pallas kernels dequantize tiles in registers and need none."""
    import paged_jax.ops.quantized_matmul  # noqa: F401  (registers "pallas")
    from models.quantization.linear import WeightOnlyLinear, quantize_weight_only

    w = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32)
    q, sc, z = quantize_weight_only(w, bits=4, group_size=32, zero_point=True, dtype=jnp.float32)
    x = jax.random.normal(jax.random.key(1), (16, 64), jnp.float32)
    for impl, barrier in (("xla", True), ("xla_native", True), ("xla_native_grouped", True), ("pallas", False)):
        layer = WeightOnlyLinear(q, sc, z, bits=4, group_size=32, dtype=jnp.float32, matmul_impl=impl)
        jaxpr = jax.make_jaxpr(lambda x, layer=layer: layer(x))(x).jaxpr
        barriers = [e for e in jaxpr.eqns if e.primitive.name == "optimization_barrier"]
        assert len(barriers) == int(barrier), impl
        if barrier:  # the activations with the weights, scales and zero points
            assert [v.aval.shape for v in barriers[0].invars] == [
                (16, 64), layer.qweight.shape, layer.scales.shape, layer.zeros.shape], impl
            np.testing.assert_allclose(np.asarray(layer(x)), np.asarray(x @ layer.dequantized_kernel()), rtol=2e-5,
                                       atol=2e-5)


def test_weights_quantized_on_the_device_are_placed_again():
    """``place_contiguously`` (run after load-time quantization) frees every device array of the model and puts equal
    copies back with the same shardings, so the module computes the same thing from new buffers."""
    from flax import nnx

    from models.quantization.linear import WeightOnlyLinear, quantize_weight_only
    from paged_jax.worker.device_memory import place_contiguously

    w = jax.random.normal(jax.random.key(0), (64, 32), jnp.float32)
    q, sc, z = quantize_weight_only(w, bits=8, group_size=-1, zero_point=False, dtype=jnp.float32)
    layer = WeightOnlyLinear(q, sc, z, bits=8, group_size=-1, dtype=jnp.float32, matmul_impl="xla")
    x = jax.random.normal(jax.random.key(1), (4, 64), jnp.float32)
    before = np.asarray(layer(x))
    old = [a for a in jax.tree.leaves(nnx.state(layer)) if isinstance(a, jax.Array)]
    place_contiguously(layer)
    new = [a for a in jax.tree.leaves(nnx.state(layer)) if isinstance(a, jax.Array)]
    assert len(new) == len(old) == 3 and all(a.is_deleted() for a in old) and not any(a.is_deleted() for a in new)
    assert [a.sharding for a in new] == [a.sharding for a in old]
    np.testing.assert_array_equal(np.asarray(layer(x)), before)
