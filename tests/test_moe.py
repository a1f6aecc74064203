"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers on tiny random checkpoints in the published
per-expert layout (fp32, CPU): logits, and greedy decoding through the engine with prefix caching."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.architectures import MixtralForCausalLM, Qwen3MoeForCausalLM, model_class
from models.attention import dense_causal_attention
from models.config import ModelConfig
from models.llama import MLP, LlamaForCausalLM
from models.loader import load_model
from models.moe import SparseMoeBlock
from models.testing import save_random_hf_checkpoint, tiny_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {
    # Layer 1 dense (mlp_only_layers), layers 0 and 2 sparse.
    "qwen3_moe_mlp_only_layer": (tiny_config("qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1]), 1),
    # Every second layer sparse; raw top-k probabilities (no renormalization); top-1.
    "qwen3_moe_sparse_step": (tiny_config("qwen3_moe", decoder_sparse_step=2, norm_topk_prob=False,
                                          num_experts_per_tok=1), 1),
    "mixtral_sharded": (tiny_config("mixtral", num_key_value_heads=1), 2),
}
SEQ_LENS = (7, 1, 12)


def _logits(model, config, seqs):
    input_ids = np.concatenate(seqs)
    positions = np.concatenate([np.arange(len(s), dtype=np.int32) for s in seqs])
    segment_ids = np.concatenate([np.full(len(s), i, dtype=np.int32) for i, s in enumerate(seqs)])

    @jax.jit
    def run(ids, pos, seg):
        hidden, _ = model(ids, pos, None, dense_causal_attention(seg, config.head_dim ** -0.5))
        return model.compute_logits(hidden)

    return np.asarray(run(jnp.asarray(input_ids), jnp.asarray(positions), jnp.asarray(segment_ids)))


def _hf_logits(path, seqs):
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return np.concatenate([torch_model(torch.tensor(s[None].astype(np.int64))).logits[0].numpy() for s in seqs])


@pytest.mark.parametrize("case", sorted(CASES))
def test_moe_logits_match_transformers(case, tmp_path):
    hf_config, shards = CASES[case]
    save_random_hf_checkpoint(hf_config, tmp_path, shards=shards, seed=sorted(CASES).index(case))
    names = set(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) if shards > 1 \
        else None
    if names is not None:  # the published layout: one tensor per expert
        assert "model.layers.0.block_sparse_moe.experts.7.w2.weight" in names
    model, config = load_model(tmp_path, dtype="float32")
    assert type(model) is model_class(config)
    moe = config.moe
    sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers]
    assert sparse == [moe.is_sparse(i) for i in range(config.num_hidden_layers)] and any(sparse)
    if not all(sparse):
        dense = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, MLP))
        assert dense.gate_proj.kernel[...].shape == (config.hidden_size, config.intermediate_size)
    block = next(layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock))
    assert block.experts.down_proj[...].shape == (moe.num_experts, moe.moe_intermediate_size, config.hidden_size)

    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, config.vocab_size, size=n).astype(np.int32) for n in SEQ_LENS]
    ours = _logits(model, config, seqs)
    reference = _hf_logits(tmp_path, seqs)
    assert np.abs(reference).max() > 0.1
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)


def test_each_expert_is_loaded_into_its_own_slot(tmp_path):
    """Zeroing one expert's down projection in the checkpoint changes exactly that expert's stacked slice."""
    from safetensors.numpy import load_file, save_file

    save_random_hf_checkpoint(tiny_config("qwen3_moe", num_hidden_layers=1), tmp_path)
    model, _ = load_model(tmp_path, dtype="float32")
    tensors = load_file(tmp_path / "model.safetensors")
    name = "model.layers.0.mlp.experts.5.down_proj.weight"
    np.testing.assert_array_equal(np.asarray(model.model.layers[0].mlp.experts.down_proj[5]), tensors[name].T)
    tensors[name] = np.zeros_like(tensors[name])
    save_file(tensors, tmp_path / "model.safetensors")
    zeroed, _ = load_model(tmp_path, dtype="float32")
    before = np.asarray(model.model.layers[0].mlp.experts.down_proj[...])
    after = np.asarray(zeroed.model.layers[0].mlp.experts.down_proj[...])
    assert not after[5].any() and before[5].any()
    np.testing.assert_array_equal(np.delete(after, 5, 0), np.delete(before, 5, 0))


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.numpy import load_file, save_file

    save_random_hf_checkpoint(tiny_config("mixtral", num_hidden_layers=1), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.0.block_sparse_moe.experts.3.w3.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensor.*experts\.3\.w3\.weight"):
        load_model(tmp_path, dtype="float32")


@pytest.mark.parametrize("overrides, message", [
    (dict(decoder_sparse_step=0), "'decoder_sparse_step'"),
    (dict(mlp_only_layers=[5]), "'mlp_only_layers'"),
    (dict(mlp_only_layers="0"), "'mlp_only_layers'"),
    (dict(num_experts_per_tok=9), "'num_experts_per_tok'"),
    (dict(shared_expert_intermediate_size=64), "'shared_expert_intermediate_size'"),
    (dict(use_sliding_window=True), "'use_sliding_window'"),
    (dict(hidden_act="gelu"), "'hidden_act'"),
    (dict(hidden_act="gelu_pytorch_tanh"), "'hidden_act'"),  # a dense family's activation: the experts run SwiGLU
    (dict(moe_intermediate_size=None), "'moe_intermediate_size'"),
])
def test_unsupported_qwen3_moe_configs_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf_config(tiny_config("qwen3_moe", **overrides))


def test_config_fields_as_published_and_as_transformers_5_saves_them():
    published = ModelConfig.from_hf_config(tiny_config("qwen3_moe"))  # "num_experts"
    renamed = tiny_config("qwen3_moe")
    renamed["num_local_experts"] = renamed.pop("num_experts")
    assert ModelConfig.from_hf_config(renamed) == published
    assert published.qk_norm and published.moe.num_experts == 8
    mixtral = ModelConfig.from_hf_config(tiny_config("mixtral"))
    assert mixtral.moe.moe_intermediate_size == mixtral.intermediate_size and mixtral.moe.norm_topk_prob
    with pytest.raises(ValueError, match="num_experts"):
        ModelConfig.from_hf_config({k: v for k, v in tiny_config("mixtral").items() if k != "num_local_experts"})
    with pytest.raises(ValueError, match="needs a MixtralForCausalLM config"):
        from flax import nnx

        MixtralForCausalLM(published, rngs=nnx.Rngs(0))
    assert model_class(published) is Qwen3MoeForCausalLM
    assert model_class(ModelConfig.from_hf_config(tiny_config("qwen3"))) is LlamaForCausalLM


def test_quantizing_a_moe_checkpoint_is_refused_naming_what():
    """Mixture-of-experts models run their family's published quantized checkpoints (block-FP8 for Qwen3-MoE and
    DeepSeek) and nothing else: the refusal names the flag or the checkpoint's quantization_config."""
    from models.quantization.config import resolve_quantization

    block_fp8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert resolve_quantization(None, tiny_config("qwen3_moe", quantization_config=block_fp8)) is None
    assert resolve_quantization("fp8", tiny_config("qwen3_moe", quantization_config=block_fp8)) is None
    with pytest.raises(ValueError, match=r"^quantization: --quantization fp8 \(load-time quantization of an "
                                         r"unquantized checkpoint\) is not supported for Qwen3MoeForCausalLM: its "
                                         r"experts run block-FP8 checkpoints"):
        resolve_quantization("fp8", tiny_config("qwen3_moe"))
    with pytest.raises(ValueError, match=r"^quantization: the checkpoint's quantization_config \(quant_method 'fp8', "
                                         r"weight_block_size \[128, 128\]\) is not supported for MixtralForCausalLM: "
                                         r"its experts run unquantized checkpoints only"):
        resolve_quantization(None, tiny_config("mixtral", quantization_config=block_fp8))
    with pytest.raises(ValueError, match=r"^quantization: the checkpoint's quantization_config \(quant_method "
                                         r"'gptq'\) is not supported for Qwen3MoeForCausalLM"):
        resolve_quantization(None, tiny_config("qwen3_moe", quantization_config={"quant_method": "gptq"}))
    with pytest.raises(ValueError, match=r"'quantization_config' \('gptq', weight_block_size=None\) is unsupported "
                                         r"for Qwen3MoeForCausalLM: only block-FP8"):
        ModelConfig.from_hf_config(tiny_config("qwen3_moe", quantization_config={"quant_method": "gptq"}))
    from paged_jax.parallel import ShardingPlan, make_mesh

    fp8_config = ModelConfig.from_hf_config(tiny_config("qwen3_moe", quantization_config=block_fp8))
    with pytest.raises(ValueError, match=r"block-FP8 experts \(quantization_config weight_block_size \[128, 128\]\) "
                                         r"splits its experts over devices only whole \(enable_expert_parallel\)"):
        ShardingPlan.create(fp8_config, make_mesh(1))


def _block_fp8_checkpoints(arch, tmp_path, block):
    """(block-FP8 checkpoint, the same dequantized to float32) of a tiny random ``arch``."""
    from models.quantization.testing import save_block_fp8_checkpoint

    float_dir, fp8_dir, dequantized_dir = tmp_path / "float", tmp_path / "fp8", tmp_path / "dequantized"
    save_random_hf_checkpoint(tiny_config(arch, eos_token_id=None), float_dir, seed=5)
    save_block_fp8_checkpoint(float_dir, fp8_dir, dequantized_dir, block=block)
    return fp8_dir, dequantized_dir


# The Qwen3-MoE case runs with make test-all (slow): test_expert_parallel's
# test_block_fp8_experts_split_whole_over_devices loads the same FP8 checkpoint into the engine and checks its greedy
# output; the DeepSeek case covers the reload.
@pytest.mark.parametrize("arch, block", [pytest.param("qwen3_moe", (128, 128), marks=pytest.mark.slow),
                                         ("deepseek_v3", (16, 32))])
def test_block_fp8_experts_stay_fp8_and_decode_as_the_dequantized_checkpoint(arch, block, tmp_path):
    """A Qwen3-MoE / DeepSeek-V3 FP8 checkpoint as published: the experts stay float8_e4m3fn on the device beside
    their float32 block scales (about half the bytes of bf16 experts), the other projections are dequantized; the
    engine's greedy continuations equal those of the dequantized checkpoint, with no compile after warm-up."""
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    fp8_dir, dequantized_dir = _block_fp8_checkpoints(arch, tmp_path, block)
    model, config = load_model(fp8_dir, dtype="bfloat16")
    assert config.fp8_weight_block == block and config.moe.expert_format == "fp8"
    experts = [layer.mlp.experts for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert experts
    for module in experts:
        for name, (k, n) in (("gate_proj", (64, 32)), ("down_proj", (32, 64))):
            weight, scales = getattr(module, name)[...], getattr(module, name + "_scale_inv")[...]
            assert isinstance(weight, jax.Array) and weight.dtype == jnp.float8_e4m3fn and weight.shape == (8, k, n)
            assert scales.dtype == jnp.float32 and scales.shape == (8, -(-n // block[0]), -(-k // block[1]))
    dequantized, _ = load_model(dequantized_dir, dtype="bfloat16")
    fp8_bytes = sum(leaf.nbytes for module in experts for leaf in jax.tree.leaves(nnx.state(module)))
    bf16_bytes = sum(leaf.nbytes for layer in dequantized.model.layers if isinstance(layer.mlp, SparseMoeBlock)
                     for leaf in jax.tree.leaves(nnx.state(layer.mlp.experts)))
    assert fp8_bytes < 0.6 * bf16_bytes

    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 17, 11)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for name, path in (("fp8", fp8_dir), ("dequantized", dequantized_dir)):
        llm = LLM(model=str(path), dtype="float32", max_model_len=64, block_size=8, max_num_seqs=4,
                  max_num_batched_tokens=32, use_tqdm=False)
        outputs[name] = _greedy_tokens(llm, prompts, params)
        if name == "fp8":  # reloaded from the checkpoint in place: float8 experts and float32 scales as stored
            llm.update_weights_from_disk(str(path))
            outputs["fp8 updated"] = _greedy_tokens(llm, prompts, params)
        assert llm.llm_engine.engine_core.runner.num_compiles_since_warmup == 0
    assert outputs["fp8"] == outputs["dequantized"] == outputs["fp8 updated"]


def _greedy_tokens(llm, prompts, params):
    return [list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def _hf_greedy(path, prompts, max_new_tokens):
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            out = torch_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                       num_beams=1, eos_token_id=None, pad_token_id=0)
            outs.append(out[0, len(prompt):].tolist())
    return outs


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_engine_greedy_equals_transformers_with_prefix_caching_and_preemption(arch, tmp_path):
    """Several prompts in one continuous batch, twice: the second pass reads the shared prefixes (two full
    16-token blocks) from the prefix cache; then on a pool too small for them all (preemption). Every continuation
    equals transformers' greedy one."""
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    hf_config = tiny_config(arch, num_hidden_layers=2, eos_token_id=None)
    save_random_hf_checkpoint(hf_config, tmp_path, seed=7)
    rng = np.random.default_rng(1)
    prefix = rng.integers(3, 256, size=32).tolist()
    prompts = [prefix + rng.integers(3, 256, size=n).tolist() for n in (3, 9)] + \
        [rng.integers(3, 256, size=n).tolist() for n in (1, 20)]
    new_tokens = 8
    expected = _hf_greedy(tmp_path, prompts, new_tokens)

    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=64,
              num_gpu_blocks_override=48, enable_prefix_caching=True, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in first] == expected
    assert [list(o.outputs[0].token_ids) for o in second] == expected
    assert [o.num_cached_tokens for o in second][:2] == [32, 32]
    assert llm.llm_engine.engine_core.runner.num_compiles_since_warmup == 0

    # A pool too small for the batch: requests are preempted (recompute) and resumed, same tokens.
    # 8-token blocks: the prompts take 11 of the 12 usable blocks (the shared prefix once), their 8 new tokens 4 more.
    tight = LLM(model=str(tmp_path), dtype="float32", max_model_len=96, max_num_seqs=4, max_num_batched_tokens=64,
                block_size=8, num_gpu_blocks_override=13, enable_prefix_caching=True, use_tqdm=False)
    preempted = tight.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in preempted] == expected
    assert tight.llm_engine.stats()["num_preemptions"] > 0


def test_tensor_parallel_experts_on_8_devices_equal_one_device(tmp_path):
    """tp = 8 on the CPU mesh: every expert's gate/up split over its width, down over its inputs, the router
    replicated; one all-reduce per attention block and per MLP (sparse or dense), no weight gathered; logits equal
    one device's."""
    from flax import nnx
    from jax.sharding import PartitionSpec as P

    from benchmarks.sharding import count_collectives
    from models.tensor_parallel import load_sharded_model
    from paged_jax.parallel import ShardingPlan, make_mesh

    hf_config = tiny_config("qwen3_moe", num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=3,
                            mlp_only_layers=[1])
    save_random_hf_checkpoint(hf_config, tmp_path, seed=11)
    model, config = load_model(tmp_path, dtype="float32")
    seqs = [np.random.default_rng(2).integers(3, config.vocab_size, size=n).astype(np.int32) for n in SEQ_LENS]
    reference = _logits(model, config, seqs)

    plan = ShardingPlan.create(config, make_mesh(8))
    sharded = load_sharded_model(tmp_path, plan, dtype="float32")
    experts = sharded.model.layers[0].mlp.experts
    assert experts.gate_proj.get_value().sharding.spec == P(None, None, "tp")
    assert experts.down_proj.get_value().sharding.spec == P(None, "tp", None)
    assert experts.up_proj.get_value().sharding.shard_shape(experts.up_proj.get_value().shape) == (8, 64, 4)
    assert sharded.model.layers[0].mlp.gate.kernel.get_value().sharding.is_fully_replicated
    assert all(layer.mlp.impl == "xla" for layer in sharded.model.layers if isinstance(layer.mlp, SparseMoeBlock))

    input_ids = np.concatenate(seqs)
    positions = np.concatenate([np.arange(len(s), dtype=np.int32) for s in seqs])
    segment_ids = np.concatenate([np.full(len(s), i, dtype=np.int32) for i, s in enumerate(seqs)])

    @nnx.jit
    def forward(model, ids):
        attention = dense_causal_attention(segment_ids, config.head_dim ** -0.5, positions=positions)
        hidden, _ = model(ids, jnp.asarray(positions), None, attention)
        return model.compute_logits(hidden)

    np.testing.assert_allclose(np.asarray(forward(sharded, input_ids)), reference, atol=1e-5, rtol=0)
    counts = count_collectives(forward.lower(sharded, input_ids).compile().as_text())
    assert counts["all-reduce"] == 2 * config.num_hidden_layers + 1, counts
    assert counts["all-gather"] == 1, counts  # the logits only


@pytest.mark.parametrize("arch, layout", [
    ("mixtral", dict(tensor_parallel_size=2)),
    # 4 layers over 2 stages, the dense layer (mlp_only_layers) on the second: layers keep their global index.
    ("qwen3_moe", dict(pipeline_parallel_size=2)),
])
def test_engine_tensor_and_pipeline_parallel_greedy_equals_transformers(arch, layout, tmp_path):
    from paged_jax.entrypoints.llm import LLM
    from paged_jax.sampling_params import SamplingParams

    overrides = dict(num_hidden_layers=4, mlp_only_layers=[2]) if arch == "qwen3_moe" else dict(num_hidden_layers=2)
    save_random_hf_checkpoint(tiny_config(arch, eos_token_id=None, **overrides), tmp_path, seed=5)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 18)]
    expected = _hf_greedy(tmp_path, prompts, 6)
    llm = LLM(model=str(tmp_path), dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
              num_gpu_blocks_override=16, use_tqdm=False, **layout)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in out] == expected


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_torch_free_random_checkpoints_name_experts_as_published(arch, tmp_path):
    """benchmarks.startup.write_random_checkpoint (the start-up benchmark's checkpoints) writes the per-expert
    tensors transformers writes, and they load."""
    from safetensors import safe_open

    from benchmarks.startup import write_random_checkpoint

    hf_config = tiny_config(arch, num_hidden_layers=1)
    ours = write_random_checkpoint(hf_config, tmp_path / "ours", dtype="float32")
    theirs = save_random_hf_checkpoint(hf_config, tmp_path / "theirs")

    def shapes(path):
        with safe_open(str(path / "model.safetensors"), "np") as f:
            return {name: f.get_slice(name).get_shape() for name in f.keys()}

    assert shapes(ours) == shapes(theirs)
    model, _ = load_model(ours, dtype="float32")
    assert type(model) is model_class(ModelConfig.from_hf_config(hf_config))
