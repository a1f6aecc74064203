"""DeepSeek-V2 / V3 (multi-head latent attention over a latent KV cache, DeepSeek's expert routing and shared
experts, block-FP8 checkpoints) against transformers on tiny random checkpoints (fp32, CPU): the config read as
transformers reads it, logits, greedy decoding through the engine in one continuous batch with chunked prefill and
prefix-cache hits, the latent cache's bytes per token, and refusals naming the field."""

import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax
from models.attention import dense_causal_attention
from models.config import ModelConfig
from models.loader import load_model
from models.presets import preset_config
from models.quantization.config import resolve_quantization
from models.quantization.testing import save_block_fp8_checkpoint
from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax import SamplingParams
from paged_jax.ops import ragged_paged_attention
from paged_jax.worker.kv_pool_sizing import kv_bytes_per_block

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {
    "v2_group_limited": tiny_config("deepseek_v2"),
    "v2_lite": tiny_config("deepseek_v2", q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1),
    "v3_noaux_tc_yarn": tiny_config("deepseek_v3"),
    "v3_rotate_half": tiny_config("deepseek_v3", rope_interleave=False, first_k_dense_replace=0,
                                  rope_scaling=None),
}
SEQ_LENS = (20, 17, 24)


def _checkpoint(name, tmp_path):
    save_random_hf_checkpoint(CASES[name], tmp_path, seed=sorted(CASES).index(name))
    return tmp_path


def _hf_model(path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def _dense_logits(model, config, seqs):
    ids = np.concatenate(seqs)
    positions = np.concatenate([np.arange(len(s), dtype=np.int32) for s in seqs])
    segments = np.concatenate([np.full(len(s), i, np.int32) for i, s in enumerate(seqs)])
    attention = dense_causal_attention(jnp.asarray(segments), config.head_dim ** -0.5, positions=jnp.asarray(positions))
    hidden, _ = jax.jit(lambda i, p: model(i, p, None, attention))(jnp.asarray(ids), jnp.asarray(positions))
    return np.asarray(model.compute_logits(hidden))


def _hf_logits(hf_model, seqs):
    with torch.no_grad():
        return np.concatenate([hf_model(torch.tensor(s[None].astype(np.int64))).logits[0].numpy() for s in seqs])


@pytest.mark.parametrize("name", sorted(CASES))
def test_config_reads_as_transformers(name):
    hf_config = CASES[name]
    config = ModelConfig.from_hf_config(hf_config)
    fields = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
    reference = transformers.AutoConfig.for_model(hf_config["model_type"], **fields)
    attention = transformers.AutoModelForCausalLM.from_config(reference).model.layers[0].self_attn
    assert config.attention_scale == pytest.approx(attention.scaling, rel=1e-12)
    assert (config.num_key_value_heads, config.head_dim, config.rotary_dim) == (
        1, reference.kv_lora_rank + reference.qk_rope_head_dim, reference.qk_rope_head_dim)
    assert config.kv_pool_head_dims == (config.head_dim, 0)
    assert config.mla.q_lora_rank == reference.q_lora_rank
    moe = config.moe
    assert moe.mlp_only_layers == tuple(range(reference.first_k_dense_replace))
    assert (moe.num_experts, moe.n_shared_experts, moe.routed_scaling_factor) == (
        reference.n_routed_experts, reference.n_shared_experts, reference.routed_scaling_factor)


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(name, tmp_path):
    path = _checkpoint(name, tmp_path)
    model, config = load_model(path, dtype="float32")
    rng = np.random.default_rng(0)
    seqs = [rng.integers(3, config.vocab_size, size=n).astype(np.int32) for n in SEQ_LENS]
    reference = _hf_logits(_hf_model(path), seqs)
    assert np.abs(reference).max() > 0.1
    np.testing.assert_allclose(_dense_logits(model, config, seqs), reference, atol=1e-4, rtol=0)


def _hf_greedy(hf_model, prompt, max_new_tokens):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", ["v2_group_limited", "v3_noaux_tc_yarn"])
def test_engine_greedy_matches_transformers(name, tmp_path):
    """One continuous batch over the paged latent cache: chunked prefill in 16-token steps, a prompt sharing 20
    tokens (two full blocks) with another: prefix-cache hits; the pool holds one [latent | rope key] row per token."""
    path = _checkpoint(name, tmp_path)
    hf_model = _hf_model(path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (17, 22, 19, 24)]
    prompts.append(prompts[1][:20] + [5, 6, 7])
    llm = paged_jax.LLM(model=str(path), dtype="float32", max_model_len=64, block_size=8, enable_chunked_prefill=True,
                        max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=True, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    (shared,) = llm.generate([{"prompt_token_ids": prompts[4]}], params, use_tqdm=False)
    assert shared.num_cached_tokens == 16
    assert [list(out.outputs[0].token_ids) for out in [*first, shared]] == [_hf_greedy(hf_model, p, 6)
                                                                           for p in prompts]
    runner = llm.llm_engine.engine_core.runner
    assert runner.num_compiles_since_warmup == 0
    mla = ModelConfig.from_pretrained(path).mla
    k_pages, v_pages = runner.kv_pool[0]
    assert k_pages.shape[1:] == (8, 1, mla.kv_lora_rank + mla.qk_rope_head_dim) and v_pages.shape[-1] == 0


def test_latent_cache_bytes_per_token():
    """KV sizing counts the latent row (kv_lora_rank + qk_rope_head_dim) per token and layer, not per-head K/V."""
    config = ModelConfig.from_hf_config(CASES["v3_noaux_tc_yarn"])
    assert kv_bytes_per_block(config, 16, jnp.bfloat16) == 16 * config.num_hidden_layers * (16 + 8) * 2
    v3 = preset_config("deepseek-v3")
    assert kv_bytes_per_block(v3, 1, jnp.bfloat16) == 61 * (512 + 64) * 2  # 70272 bytes per token
    lite = preset_config("deepseek-v2-lite")
    assert lite.mla.q_lora_rank is None and kv_bytes_per_block(lite, 1, jnp.bfloat16) == 27 * (512 + 64) * 2


def test_latent_attention_reads_values_from_the_k_rows():
    """The reference over a latent pool (V of width 0) equals the one over an explicit V pool holding the rows'
    first columns; the Mosaic kernel refuses a latent pool by name."""
    rng = np.random.default_rng(0)
    k_pages = jnp.asarray(rng.standard_normal((6, 4, 1, 24)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((7, 4, 24)), jnp.float32)
    meta = (jnp.array([5, 2]), jnp.array([[1, 2], [3, 0]]), jnp.array([0, 5, 7]))
    latent = ragged_paged_attention(q, k_pages, k_pages[..., :0], *meta, sm_scale=0.3, impl="auto", v_head_dim=16)
    v_pages = jnp.concatenate([k_pages[..., :16], jnp.zeros_like(k_pages[..., 16:])], axis=-1)
    full = ragged_paged_attention(q, k_pages, v_pages, *meta, sm_scale=0.3, impl="reference")
    np.testing.assert_allclose(np.asarray(latent), np.asarray(full)[..., :16], atol=1e-6)
    with pytest.raises(ValueError, match="latent KV cache"):
        ragged_paged_attention(q, k_pages, k_pages[..., :0], *meta, sm_scale=0.3, impl="mosaic", v_head_dim=16)


def test_block_fp8_checkpoint_loads_as_its_dequantized_weights(tmp_path, caplog):
    """DeepSeek-V3's published layout (F8_E4M3 weights, weight_scale_inv per 16x16 block here): the experts stay
    float8, the other projections are dequantized; the model equals the dequantized float checkpoint (and
    transformers on it); the multi-token prediction layer's tensors are skipped with a log line."""
    float_dir, fp8_dir, dequantized_dir = tmp_path / "float", tmp_path / "fp8", tmp_path / "dequantized"
    save_random_hf_checkpoint(CASES["v3_noaux_tc_yarn"], float_dir, seed=3)
    save_block_fp8_checkpoint(float_dir, fp8_dir, dequantized_dir, block=(16, 16))
    _add_mtp_layer(fp8_dir)
    assert resolve_quantization(None, json.loads((fp8_dir / "config.json").read_text())) is None
    with caplog.at_level(logging.INFO, logger="models.loader"):
        model, config = load_model(fp8_dir, dtype="float32")
    assert config.fp8_weight_block == (16, 16)
    assert "multi-token prediction" in caplog.text
    q_b = model.model.layers[1].self_attn.q_b_proj.kernel[...]
    assert len(np.unique(np.asarray(q_b))) < q_b.size  # the fp8 grid, not the float weights
    assert q_b.dtype == jnp.float32  # dequantized at load, the experts kept in float8 beside their scales
    experts = model.model.layers[1].mlp.experts
    assert experts.down_proj[...].dtype == jnp.float8_e4m3fn and experts.down_proj_scale_inv[...].shape == (8, 4, 2)
    seqs = [np.arange(3, 20, dtype=np.int32)]
    dequantized, dq_config = load_model(dequantized_dir, dtype="float32")
    ours = _dense_logits(model, config, seqs)
    np.testing.assert_array_equal(ours, _dense_logits(dequantized, dq_config, seqs))
    np.testing.assert_allclose(ours, _hf_logits(_hf_model(dequantized_dir), seqs), atol=1e-4, rtol=0)


def _add_mtp_layer(path):
    """Add a multi-token prediction layer's tensors (as published: layer index num_hidden_layers) in a shard of its
    own, the checkpoint becoming a sharded one."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    config = json.loads((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), framework="numpy") as handle:
        weight_map = {name: "model.safetensors" for name in handle.keys()}
    layer = config["num_hidden_layers"]
    mtp = {f"model.layers.{layer}.{name}": np.ones((4, 4), np.float32)
           for name in ("eh_proj.weight", "enorm.weight", "hnorm.weight", "self_attn.kv_b_proj.weight")}
    save_file(mtp, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    weight_map.update({name: "mtp.safetensors" for name in mtp})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))


REFUSED = {
    "scoring_func": ("deepseek_v3", {"scoring_func": "softmax"}),
    "topk_method": ("deepseek_v2", {"topk_method": "noaux_tc"}),
    "moe_layer_freq": ("deepseek_v2", {"moe_layer_freq": 2}),
    "attention_bias": ("deepseek_v3", {"attention_bias": True}),
    "quantization_config": ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}),
    "hidden_act": ("deepseek_v2", {"hidden_act": "gelu"}),
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_unimplemented_config_is_refused_naming_the_field(field):
    arch, overrides = REFUSED[field]
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(tiny_config(arch, **overrides))


def test_latent_cache_refuses_the_host_pool_kernels_and_pipeline_stages(tmp_path):
    from paged_jax.parallel.pipeline import PipelinePlan

    path = _checkpoint("v2_lite", tmp_path)
    with pytest.raises(ValueError, match="swap_space"):
        paged_jax.LLM(model=str(path), dtype="float32", max_model_len=32, block_size=8, max_num_seqs=2,
                      max_num_batched_tokens=16, preemption_mode="swap", swap_space=0.01, use_tqdm=False)
    with pytest.raises(ValueError, match="attention_impl"):
        paged_jax.LLM(model=str(path), dtype="float32", max_model_len=32, block_size=8, max_num_seqs=2,
                      max_num_batched_tokens=16, attention_impl="mosaic", use_tqdm=False)
    with pytest.raises(ValueError, match="enable_lora"):
        paged_jax.LLM(model=str(path), dtype="float32", max_model_len=32, block_size=8, max_num_seqs=2,
                      max_num_batched_tokens=16, enable_lora=True, use_tqdm=False)
    with pytest.raises(ValueError, match="batch_invariant"):
        paged_jax.LLM(model=str(path), dtype="float32", max_model_len=32, block_size=8, max_num_seqs=2,
                      max_num_batched_tokens=16, batch_invariant=True, use_tqdm=False)
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: DeepseekV2ForCausalLM's latent attention"):
        PipelinePlan.create(ModelConfig.from_pretrained(path), 2, 1)


def test_routed_experts_capture_equals_transformers_routing(tmp_path):
    """The shared sparse-layer hooks (models.moe_routing) record DeepSeek's routing: each token's experts in the sparse
    layer are the ones transformers' router picks (noaux_tc groups, correction bias)."""
    from models.moe_routing import pop_routed_experts, set_routing_capture

    path = _checkpoint("v3_noaux_tc_yarn", tmp_path)
    model, config = load_model(path, dtype="float32")
    seq = np.random.default_rng(2).integers(3, config.vocab_size, size=24).astype(np.int32)
    set_routing_capture(model, True)
    attention = dense_causal_attention(jnp.zeros(24, jnp.int32), config.head_dim ** -0.5)
    model(jnp.asarray(seq), jnp.arange(24, dtype=jnp.int32), None, attention)
    ours = np.asarray(pop_routed_experts(model))  # [T, sparse layers, k]
    hf_model, picked = _hf_model(path), []
    hf_model.model.layers[1].mlp.gate.register_forward_hook(lambda module, args, out: picked.append(out[2]))
    with torch.no_grad():
        hf_model(torch.tensor(seq[None].astype(np.int64)))
    assert ours.shape == (24, 1, 2)
    assert [set(row) for row in ours[:, 0].tolist()] == [set(row) for row in picked[0].tolist()]


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_copy_on_write_block_copies_of_a_latent_pool(impl):
    """Copy-on-write copies move a latent pool's K rows and leave its empty V pools as they are."""
    from paged_jax.ops.block_copy import copy_blocks

    k_pages = jnp.arange(4 * 2 * 1 * 6, dtype=jnp.float32).reshape(4, 2, 1, 6)
    v_pages = jnp.zeros((4, 2, 1, 0), jnp.float32)
    ((k_out, v_out),) = copy_blocks([(k_pages, v_pages)], jnp.array([1, 0], jnp.int32), jnp.array([3, 4], jnp.int32),
                                    impl=impl, interpret=True)
    np.testing.assert_array_equal(np.asarray(k_out), np.asarray(k_pages.at[3].set(k_pages[1])))
    assert v_out.shape == v_pages.shape
