"""gpt-oss (GptOssForCausalLM) against transformers on tiny random checkpoints (fp32, CPU): logits with sequences
longer than the sliding window, the published MXFP4 experts (kept packed, dequantized as transformers does), and
greedy decoding through the engine with prefix caching and preemption."""

import functools
import re
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.attention import dense_causal_attention
from models.config import ModelConfig
from models import gpt_oss
from models.gpt_oss import GptOssMoeBlock
from models.loader import load_model
from models.moe import grouped_matmul_reference
from models.quantization import mxfp4
from models.testing import save_random_hf_checkpoint, tiny_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SEQ_LENS = (40, 1, 12)  # longer than the tiny config's 8-token window, a single token, a few windows' worth


def _logits(model, config, seqs):
    input_ids = np.concatenate(seqs)
    positions = np.concatenate([np.arange(len(s), dtype=np.int32) for s in seqs])
    segment_ids = np.concatenate([np.full(len(s), i, dtype=np.int32) for i, s in enumerate(seqs)])

    @jax.jit
    def run(ids, pos, seg):
        hidden, _ = model(ids, pos, None, dense_causal_attention(seg, config.head_dim ** -0.5, positions=pos))
        return model.compute_logits(hidden)

    return np.asarray(run(jnp.asarray(input_ids), jnp.asarray(positions), jnp.asarray(segment_ids)))


def _hf_model(path):
    kwargs = {}
    if "quantization_config" in json.loads((path / "config.json").read_text()):
        kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs).eval()


def _hf_logits(path, seqs):
    torch_model = _hf_model(path)
    with torch.no_grad():
        return np.concatenate([torch_model(torch.tensor(s[None].astype(np.int64))).logits[0].numpy() for s in seqs])


def _seqs(vocab_size):
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab_size, size=n).astype(np.int32) for n in SEQ_LENS]


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    return save_random_hf_checkpoint(tiny_config("gpt_oss"), tmp_path_factory.mktemp("gpt_oss"), seed=3)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(float_checkpoint, tmp_path_factory):
    from models.quantization.testing import save_mxfp4_gpt_oss_checkpoint

    return save_mxfp4_gpt_oss_checkpoint(float_checkpoint, tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def test_config_as_published():
    config = ModelConfig.from_hf_config(tiny_config("gpt_oss"))
    assert config.attention_sinks and config.attention_bias and config.o_proj_bias
    assert config.layer_windows == (8, None)
    assert config.rope_scaling["rope_type"] == "yarn" and config.rope_scaling["attention_factor"] > 1
    assert config.moe.swiglu_limit == 7.0 and config.moe.swiglu_alpha == 1.702 and config.moe.expert_format is None
    default_layers = {k: v for k, v in tiny_config("gpt_oss", num_hidden_layers=4).items() if k != "layer_types"}
    assert ModelConfig.from_hf_config(default_layers).layer_windows == (8, None, 8, None)
    mxfp4_config = ModelConfig.from_hf_config(tiny_config("gpt_oss", quantization_config={"quant_method": "mxfp4"}))
    assert mxfp4_config.moe.expert_format == "mxfp4"


def test_logits_match_transformers(float_checkpoint):
    model, config = load_model(float_checkpoint, dtype="float32")
    assert all(isinstance(layer.mlp, GptOssMoeBlock) for layer in model.model.layers)
    seqs = _seqs(config.vocab_size)
    reference = _hf_logits(float_checkpoint, seqs)
    assert np.abs(reference).max() > 0.1
    np.testing.assert_allclose(_logits(model, config, seqs), reference, atol=1e-4, rtol=0)


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    weight = rng.normal(0, 0.05, (3, 48, 64)).astype(np.float32)  # [E, out, in]
    weight[0, 0, :32] = 0.0  # an all-zero run: the smallest scale
    blocks, scales = mxfp4.quantize(weight)
    assert blocks.shape == (3, 48, 2, 16) and scales.shape == (3, 48, 2) and blocks.dtype == scales.dtype == np.uint8
    expected = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales), dtype=torch.float32)
    ours = np.asarray(jax.jit(mxfp4.dequantize, static_argnums=2)(blocks, scales, jnp.float32))
    np.testing.assert_array_equal(ours, expected.numpy())  # [E, in, out], exactly
    # Round to nearest: within half of fp4's widest step (4 -> 6) times the run's scale.
    step = np.exp2(scales.astype(np.float64) - 127).repeat(32, axis=-1)  # [E, out, in]
    assert (np.abs(ours - np.swapaxes(weight, 1, 2)) <= np.swapaxes(step, 1, 2)).all()
    bf16 = np.asarray(mxfp4.dequantize(blocks, scales, jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(bf16, ours)  # exact in bfloat16 too


def test_mxfp4_experts_stay_packed_and_match_transformers(mxfp4_checkpoint):
    model, config = load_model(mxfp4_checkpoint, dtype="float32")
    assert config.moe.expert_format == "mxfp4"
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj_blocks[...].dtype == jnp.uint8 and experts.down_proj_scales[...].dtype == jnp.uint8
    assert not hasattr(experts, "gate_up_proj") and not hasattr(experts, "down_proj")
    seqs = _seqs(config.vocab_size)
    reference = _hf_logits(mxfp4_checkpoint, seqs)
    np.testing.assert_allclose(_logits(model, config, seqs), reference, atol=1e-4, rtol=0)


def test_mxfp4_gathered_experts_equal_grouped(mxfp4_checkpoint):
    """Few (token, expert) pairs multiply each pair by its expert's packed bytes; the result is the grouped
    matmul's."""
    model, _ = load_model(mxfp4_checkpoint, dtype="float32")
    block = model.model.layers[1].mlp
    x = jnp.asarray(np.random.default_rng(1).normal(0, 1, (1, 64)), jnp.float32)
    weights, ids = block.route(x)
    assert gpt_oss.mxfp4_form("auto", "xla", ids.size, block.experts.gate_up_proj_bias.shape[0]) == "matvec"
    operands = block.experts.operands(x.dtype)
    with jax.default_matmul_precision("highest"):
        grouped = gpt_oss.experts_grouped(grouped_matmul_reference, x, ids, *operands, alpha=block.alpha,
                                          limit=block.limit)
        np.testing.assert_allclose(np.asarray(block(x)), np.asarray(gpt_oss.combine_top_k(grouped, weights)),
                                   atol=1e-5, rtol=1e-5)


def test_unsupported_quantization_and_attention_are_refused():
    from models.quantization.config import resolve_quantization

    with pytest.raises(ValueError, match=r"^quantization: gptq is not supported for GptOssForCausalLM"):
        ModelConfig.from_hf_config(tiny_config("gpt_oss", quantization_config={"quant_method": "gptq"}))
    with pytest.raises(ValueError, match=r"^quantization: --quantization fp8 \(load-time quantization of an "
                                         r"unquantized checkpoint\) is not supported for GptOssForCausalLM: its "
                                         r"experts run its published MXFP4 checkpoints"):
        resolve_quantization("fp8", tiny_config("gpt_oss"))
    with pytest.raises(ValueError, match=r"^quantization: mxfp4 needs a checkpoint quantized with mxfp4"):
        resolve_quantization("mxfp4", tiny_config("gpt_oss"))
    with pytest.raises(ValueError, match=r"quantization='mxfp4' needs a checkpoint quantized with mxfp4"):
        resolve_quantization("mxfp4", tiny_config("qwen3"))
    published = tiny_config("gpt_oss", quantization_config={"quant_method": "mxfp4"})
    assert resolve_quantization(None, published) is None and resolve_quantization("mxfp4", published) is None

    model, config = load_model(None, load_format="dummy", config=ModelConfig.from_hf_config(tiny_config("gpt_oss")),
                               dtype="float32")

    def no_sinks(layer_idx, q, k, v, kv_layer, **options):
        return q, kv_layer

    no_sinks.takes_layer_attention = True
    with pytest.raises(ValueError, match="attention sinks"):
        model(jnp.zeros((2,), jnp.int32), jnp.arange(2, dtype=jnp.int32), None, no_sinks)


def test_dummy_mxfp4_weights_are_finite():
    config = ModelConfig.from_hf_config(tiny_config("gpt_oss", quantization_config={"quant_method": "mxfp4"}))
    model, _ = load_model(None, load_format="dummy", config=config, dtype="float32")
    experts = model.model.layers[0].mlp.experts
    weight = np.asarray(experts.operands(jnp.float32)[0].dequantize(jnp.float32))
    assert np.isfinite(weight).all() and 0.005 < weight.std() < 0.1
    logits = _logits(model, config, _seqs(config.vocab_size))
    assert np.isfinite(logits).all()


def _hf_greedy(path, prompts, max_new_tokens):
    torch_model = _hf_model(path)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            out = torch_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                       num_beams=1, eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


# The float-experts case runs with make test-all (slow): test_logits_match_transformers covers the float checkpoint's
# model, and the MXFP4 case the engine's groups, prefix cache and preemption on the same architecture.
@pytest.mark.parametrize("experts", [pytest.param("float", marks=pytest.mark.slow), "mxfp4"])
def test_engine_greedy_equals_transformers_with_prefix_caching_and_preemption(experts, float_checkpoint,
                                                                              mxfp4_checkpoint):
    """Prompts longer than the window in one continuous batch, twice (the second pass reads the shared 32-token
    prefix from the prefix cache), then on a pool too small for them all (preemption): every continuation equals
    transformers' greedy one, and the sliding layers keep their own KV group."""
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    path = float_checkpoint if experts == "float" else mxfp4_checkpoint
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 256, size=32).tolist()
    prompts = [prefix + rng.integers(3, 256, size=n).tolist() for n in (3, 9)] + \
        [rng.integers(3, 256, size=n).tolist() for n in (1, 20)]
    new_tokens = 8
    expected = _hf_greedy(path, prompts, new_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    llm = LLM(model=str(path), dtype="float32", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=64,
              block_size=8, num_gpu_blocks_override=64, enable_prefix_caching=True, use_tqdm=False)
    assert llm.llm_engine.engine_core.runner.kv_layout.num_groups == 2
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in first] == expected
    assert [list(o.outputs[0].token_ids) for o in second] == expected
    assert [o.num_cached_tokens for o in second][:2] == [32, 40]  # whole 8-token blocks of each prompt
    assert llm.llm_engine.engine_core.runner.num_compiles_since_warmup == 0

    tight = LLM(model=str(path), dtype="float32", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=64,
                block_size=8, num_gpu_blocks_override=17, enable_prefix_caching=True, use_tqdm=False)
    preempted = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in preempted] == expected
    assert tight.llm_engine.stats()["num_preemptions"] > 0


@pytest.mark.slow  # dummy MXFP4 weights: test_dummy_mxfp4_weights_are_finite; both benchmarks: tests/test_benchmarks.py
def test_benchmarks_run_a_dummy_mxfp4_gpt_oss(tmp_path):
    """The GPU benchmarks' paths on the CPU: ``benchmarks.latency`` and ``benchmarks.throughput`` on random MXFP4
    weights of a tiny gpt-oss config (the lead runs them with ``gpt-oss-20b``, ``models.presets``)."""
    from benchmarks.latency import main as latency
    from benchmarks.throughput import main as throughput
    from models.presets import preset_config

    assert preset_config("gpt-oss-20b").moe.expert_format == "mxfp4"
    (tmp_path / "config.json").write_text(json.dumps(
        tiny_config("gpt_oss", vocab_size=10000, eos_token_id=None, quantization_config={"quant_method": "mxfp4"})))
    engine = ["--model", str(tmp_path), "--load-format", "dummy", "--dtype", "float32", "--max-model-len", "64",
              "--max-num-seqs", "2", "--max-num-batched-tokens", "32"]
    result = latency(["--input-len", "20", "--output-len", "3", "--batch-size", "2", "--num-iters-warmup", "0",
                      "--num-iters", "1", *engine])
    assert len(result["latencies"]) == 1 and result["avg_latency"] > 0
    result = throughput(["--workload", "random", "--num-prompts", "2", "--input-len", "20", "--output-len", "3",
                         "--temperature", "0", *engine])
    assert result["output_tokens"] == 6 and result["output_tok_s"] > 0


def test_engine_refuses_the_mosaic_kernel_for_attention_sinks(float_checkpoint):
    from paged_jax.entrypoints.llm import LLM

    with pytest.raises(ValueError, match=r"^attention_impl: 'mosaic' does not take the attention sinks"):
        LLM(model=str(float_checkpoint), dtype="float32", attention_impl="mosaic", max_model_len=64, use_tqdm=False)


def test_mxfp4_bit_decoding_equals_the_tables():
    """The fused kernel's decoding (bit arithmetic) of every fp4 code and e8m0 scale equals the format's tables
    (``FP4_VALUES``, signed zeros included; ``scale_factors``)."""
    codes, values = jnp.arange(16, dtype=jnp.uint8), np.asarray(mxfp4.FP4_VALUES, np.float32)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        decoded = np.asarray(mxfp4.decode_fp4(codes, dtype).astype(jnp.float32))
        np.testing.assert_array_equal(decoded, values)
        np.testing.assert_array_equal(np.signbit(decoded), np.signbit(values))
    scales = jnp.arange(256).astype(jnp.uint8)
    for dtype in (jnp.bfloat16, jnp.float32):
        np.testing.assert_array_equal(np.asarray(mxfp4.decode_e8m0(scales, dtype).astype(jnp.float32)),
                                      np.asarray(mxfp4.scale_factors(scales, dtype).astype(jnp.float32)))
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        mxfp4.decode_e8m0(scales, jnp.float16)


def test_mxfp4_matvec_equals_dequantized_matmul():
    rng = np.random.default_rng(2)
    blocks, scales = mxfp4.quantize(rng.normal(0, 0.05, (3, 40, 64)).astype(np.float32))
    x = rng.normal(0, 1, (3, 64)).astype(np.float32)
    want = np.einsum("rh,rhn->rn", x, np.asarray(mxfp4.dequantize(blocks, scales, jnp.float32)).astype(np.float64))
    np.testing.assert_allclose(np.asarray(jax.jit(mxfp4.matvec)(x, blocks, scales)), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("experts", ["float", "mxfp4"])
def test_experts_on_the_fused_moe_kernel_equal_xla(experts, float_checkpoint, mxfp4_checkpoint):
    """The grouped matmuls of a gpt-oss layer (gate/up gathering its rows, then down; biases and the clamped SwiGLU
    between them) on the Pallas kernel (interpret mode; MXFP4 experts decoded per tile) equal the XLA reference's
    (``lax.ragged_dot``, MXFP4 experts dequantized first)."""
    from paged_jax.ops.fused_moe import grouped_matmul_pallas

    model, _ = load_model(float_checkpoint if experts == "float" else mxfp4_checkpoint, dtype="float32")
    block = model.model.layers[0].mlp
    operands = block.experts.operands(jnp.float32)
    assert isinstance(operands[0], mxfp4.Mxfp4Experts) == (experts == "mxfp4")
    x = jnp.asarray(np.random.default_rng(4).normal(0, 1, (9, 64)), jnp.float32)
    _, ids = block.route(x)
    kernel = functools.partial(grouped_matmul_pallas, interpret=True)
    with jax.default_matmul_precision("highest"):
        want, got = (np.asarray(gpt_oss.experts_grouped(matmul, x, ids, *operands, alpha=block.alpha,
                                                        limit=block.limit))
                     for matmul in (grouped_matmul_reference, kernel))
    np.testing.assert_allclose(got, want, atol=1e-5 * max(np.abs(want).max(), 1.0), rtol=0)


@pytest.mark.parametrize("impl, pairs_per_expert, packed", [
    ("auto", 16, True), ("pallas", 16, True), ("auto", gpt_oss.PACKED_MAX_PAIRS_PER_EXPERT + 1, False),
    ("pallas", gpt_oss.PACKED_MAX_PAIRS_PER_EXPERT + 1, True)])
def test_mxfp4_layer_on_the_gpu_runs_packed_tiles_up_to_the_bound(impl, pairs_per_expert, packed, mxfp4_checkpoint,
                                                                  monkeypatch):
    """A gpt-oss MXFP4 layer lowered for CUDA with the kernel resolved: the kernels get the packed bytes up to
    ``PACKED_MAX_PAIRS_PER_EXPERT`` (token, expert) pairs per expert, and with ``moe_impl="pallas"`` at any size;
    past the bound ``"auto"`` decodes the layer's experts to the model dtype and runs the float kernel (nothing runs,
    the module's kernels and operand types are read)."""
    import paged_jax.ops.fused_moe  # noqa: F401  (registers moe_impl "pallas")

    model, _ = load_model(mxfp4_checkpoint, dtype="float32")
    block = model.model.layers[0].mlp
    block.impl = impl
    monkeypatch.setattr(gpt_oss, "resolve_moe_impl", lambda *args: "pallas")
    num_experts = block.experts.gate_up_proj_bias.shape[0]
    num_tokens = -(-pairs_per_expert * num_experts // block.num_experts_per_tok)
    x = jax.ShapeDtypeStruct((num_tokens, block.router.in_features), jnp.float32)
    text = jax.jit(lambda rows: block(rows)).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    names = re.findall(r'name = "(moe_grouped_matmul[^"]*)"', text)
    assert len(names) == 2 and all(("mxfp4" in name) == packed for name in names), names


def test_mxfp4_form_bounds():
    """Below one pair per expert each pair runs through its packed bytes (unless the kernel is asked for); the
    packed kernel up to the bound; past it, only "auto" on the kernel dequantizes (the XLA reference always
    dequantizes inside its grouped matmul)."""
    bound = gpt_oss.PACKED_MAX_PAIRS_PER_EXPERT
    assert gpt_oss.mxfp4_form("auto", "pallas", 31, 32) == "matvec"
    assert gpt_oss.mxfp4_form("pallas", "pallas", 31, 32) == "packed"
    assert gpt_oss.mxfp4_form("auto", "pallas", 32, 32) == "packed"
    assert gpt_oss.mxfp4_form("auto", "pallas", bound * 32, 32) == "packed"
    assert gpt_oss.mxfp4_form("auto", "pallas", bound * 32 + 1, 32) == "dequantized"
    assert gpt_oss.mxfp4_form("auto", "xla", bound * 32 + 1, 32) == "packed"
    assert gpt_oss.mxfp4_form("pallas", "pallas", bound * 32 + 1, 32) == "packed"


@pytest.mark.parametrize("num_tokens, kernels", [
    (1, ("moe_grouped_matmul_gather_mxfp4_bm16_bn128_bk64_s2", "moe_grouped_matmul_mxfp4_bm16_bn128_bk64_s4")),
    (4096, ("moe_grouped_matmul_gather_mxfp4_bm128_bn128_bk64_s1", "moe_grouped_matmul_mxfp4_bm128_bn128_bk64_s1")),
])
def test_mxfp4_experts_lower_to_the_packed_kernel_for_the_gpu(num_tokens, kernels):
    """gpt-oss-20b's MXFP4 experts (hidden 2880, 32 experts of 2880, top 4) through the fused kernel lower for CUDA
    on the CPU with the default launches, the packed bytes the kernels' operands: nothing runs, only the kernels'
    names (format, tiles, K splits) and operand types are read off the module."""
    from paged_jax.ops.fused_moe import grouped_matmul_pallas

    hidden, inter, num_experts, top_k = 2880, 2880, 32, 4

    def stack(k, n):
        blocks, scales = mxfp4.packed_shapes(num_experts, n, k)
        return mxfp4.Mxfp4Experts(jax.ShapeDtypeStruct(blocks, jnp.uint8), jax.ShapeDtypeStruct(scales, jnp.uint8))

    op = jax.jit(functools.partial(gpt_oss.experts_grouped, grouped_matmul_pallas, alpha=1.702, limit=7.0))
    text = op.trace(jax.ShapeDtypeStruct((num_tokens, hidden), jnp.bfloat16),
                    jax.ShapeDtypeStruct((num_tokens, top_k), jnp.int32), stack(hidden, 2 * inter),
                    jax.ShapeDtypeStruct((num_experts, 2 * inter), jnp.bfloat16), stack(inter, hidden),
                    jax.ShapeDtypeStruct((num_experts, hidden), jnp.bfloat16)).lower(
                        lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2
    assert all(f'name = "{name}"' in text for name in kernels)
    assert "tensor<32x5760x1440xui8>" in text and "tensor<32x2880x5760xbf16>" not in text


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 4096},  # gpt-oss as published
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},  # defaults: truncate, betas
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "mscale": 1.0,
     "mscale_all_dim": 0.5},
])
def test_yarn_frequencies_and_attention_factor_equal_transformers(scaling):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from models.qk_transform import rope_inv_freq

    hf_config = tiny_config("gpt_oss", head_dim=64, rope_theta=150000.0, max_position_embeddings=4096,
                            rope_scaling=scaling)
    config = ModelConfig.from_hf_config(hf_config)
    fields = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](GptOssConfig(**fields))
    ours = rope_inv_freq(64, config.rope_theta, tuple(sorted(config.rope_scaling.items())))
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
    assert config.rope_scaling["attention_factor"] == pytest.approx(attention_factor)


def test_routed_experts_of_gpt_oss_equal_its_routing(float_checkpoint):
    """``enable_return_routed_experts`` on gpt-oss: every token's expert ids per layer equal the router's top-k of a
    dense forward over the whole sequence."""
    from flax import nnx

    from models.moe_routing import pop_routed_experts, set_routing_capture
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    model, config = load_model(float_checkpoint, dtype="float32")
    set_routing_capture(model, True)

    @nnx.jit
    def routing(model, ids):
        positions = jnp.arange(ids.shape[0], dtype=jnp.int32)
        model(ids, positions, None, dense_causal_attention(jnp.zeros_like(positions), config.head_dim ** -0.5,
                                                           positions=positions))
        return pop_routed_experts(model)

    llm = LLM(model=str(float_checkpoint), dtype="float32", max_model_len=64, max_num_seqs=2,
              max_num_batched_tokens=16, enable_prefix_caching=False, enable_return_routed_experts=True,
              use_tqdm=False)
    prompt = np.random.default_rng(2).integers(3, 200, size=20).tolist()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=5,
                                                                     ignore_eos=True), use_tqdm=False)[0].outputs[0]
    sequence = prompt + list(out.token_ids)
    np.testing.assert_array_equal(out.routed_experts, np.asarray(routing(model, jnp.asarray(sequence[:-1]))))
