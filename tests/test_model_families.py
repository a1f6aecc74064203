"""Families with per-layer attention kinds and their own math (Mistral and Qwen2 sliding windows, Gemma 2, Gemma 3
text, Phi-3 / Phi-4, Granite) against transformers on tiny random checkpoints: the config read as transformers reads
it, fp32 logits, and greedy decoding through the engine in one continuous batch with prompts two to three times the
window, chunked prefill across the window edge and prefix-cache hits. Unimplemented fields are refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import paged_jax
from models.attention import dense_causal_attention
from models.config import ModelConfig
from models.loader import init_dummy_model, load_model
from models.testing import save_random_hf_checkpoint, tiny_config
from paged_jax import SamplingParams

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WINDOW = 8  # tiny_config's window for the sliding families
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.7, 2.0], "long_factor": [1.5, 2.5, 4.0, 6.0]}
FAMILIES = {
    "mistral_window": tiny_config("mistral", sliding_window=WINDOW),
    "qwen2_max_window_layers": tiny_config("qwen2", num_hidden_layers=3, use_sliding_window=True,
                                           sliding_window=WINDOW, max_window_layers=1),
    "gemma2": tiny_config("gemma2"),
    "gemma3_linear_rope": tiny_config("gemma3", num_hidden_layers=3,
                                      rope_scaling={"rope_type": "linear", "factor": 2.0}),
    # original_max_position_embeddings 16 < max_position_embeddings 64: the long factors; half of each head rotates.
    "phi3_longrope_partial": tiny_config("phi3", max_position_embeddings=64, rope_scaling=LONGROPE,
                                         partial_rotary_factor=0.5),
    "phi3_window": tiny_config("phi3", sliding_window=WINDOW),
    "granite": tiny_config("granite"),
}
SEQ_LENS = (20, 17, 24)  # two to three windows (and, for LongRoPE, past original_max_position_embeddings)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory):
    """(family name, checkpoint dir, the transformers model in fp32 eager attention)."""
    path = tmp_path_factory.mktemp(request.param)
    save_random_hf_checkpoint(FAMILIES[request.param], path, seed=sorted(FAMILIES).index(request.param))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                                 attn_implementation="eager").eval()
    return request.param, path, hf_model


def _hf_windows(hf_config) -> tuple:
    """Each layer's window as transformers' attention layers take it."""
    types = getattr(hf_config, "layer_types", None) or ["sliding_attention"] * hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    return tuple(window if kind == "sliding_attention" else None for kind in types)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_config_reads_as_transformers(name):
    raw = FAMILIES[name]
    config = ModelConfig.from_hf_config(raw)
    hf_config = transformers.AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items()
                                                                         if k != "model_type"})
    assert config.layer_windows == _hf_windows(hf_config)
    # transformers 5 writes its normalized form (layer_types, rope_parameters per layer type): the same config.
    assert ModelConfig.from_hf_config(hf_config.to_dict()) == config


def test_layer_kinds_and_rope():
    qwen2 = ModelConfig.from_hf_config(FAMILIES["qwen2_max_window_layers"])
    assert qwen2.layer_windows == (None, WINDOW, WINDOW) and qwen2.sliding_window is None
    gemma2 = ModelConfig.from_hf_config(FAMILIES["gemma2"])
    assert gemma2.layer_windows == (WINDOW, None)  # even layers slide
    assert gemma2.attention_scale == 24 ** -0.5 and gemma2.tie_word_embeddings
    gemma3 = ModelConfig.from_hf_config(FAMILIES["gemma3_linear_rope"])
    assert gemma3.layer_windows == (WINDOW, WINDOW, None)  # sliding_window_pattern 3
    assert gemma3.local_rope_theta == 100.0 and gemma3.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    phi3 = ModelConfig.from_hf_config(FAMILIES["phi3_longrope_partial"])
    assert phi3.rotary_dim == 8 and phi3.rope_scaling["use_long_factors"]
    assert not phi3.for_max_model_len(16).rope_scaling["use_long_factors"]
    assert phi3.for_max_model_len(17).rope_scaling["use_long_factors"]
    assert ModelConfig.from_hf_config(tiny_config("qwen2", use_sliding_window=False, sliding_window=WINDOW,
                                                  max_window_layers=0)).layer_windows == (None, None)
    # Gemma's dummy norms are zeros: they scale by 1 + weight.
    model = init_dummy_model(gemma2, dtype=jnp.float32)
    assert float(jnp.abs(model.model.layers[0].pre_feedforward_layernorm.scale[...]).max()) == 0.0


REFUSED = {
    "yarn": (tiny_config("llama", rope_scaling={"rope_type": "yarn", "factor": 2.0}), "yarn"),
    "dynamic": (tiny_config("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
    "bidirectional": (tiny_config("gemma3", use_bidirectional_attention=True), "use_bidirectional_attention"),
    "gemma3_attn_cap": (tiny_config("gemma3", attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    "multimodal": ({**tiny_config("gemma3"), "architectures": ["Gemma3ForConditionalGeneration"]},
                   "Gemma3ForCausalLM"),
    "multimodal_type": ({k: v for k, v in tiny_config("gemma3", model_type="gemma3").items()
                         if k != "architectures"}, "gemma3_text"),
    "llama_partial_rotary": (tiny_config("llama", partial_rotary_factor=0.5), "partial_rotary_factor"),
    "llama_pre_attn_scalar": (tiny_config("llama", query_pre_attn_scalar=64), "query_pre_attn_scalar"),
    "llama_logits_scaling": (tiny_config("llama", logits_scaling=2.0), "logits_scaling"),
    "mistral_mixed_layer_types": (tiny_config("mistral", sliding_window=WINDOW,
                                              layer_types=["sliding_attention", "full_attention"]), "layer_types"),
    "gemma_activation": (tiny_config("gemma2", hidden_activation="relu"), "hidden_activation"),
    "gemma3_sliding_rope_scaling": (tiny_config("gemma3", rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}), "sliding_attention"),
    "longrope_factor_count": (tiny_config("phi3", rope_scaling={**LONGROPE, "short_factor": [1.0]}),
                              "short_factor"),
    "mlp_bias": (tiny_config("granite", mlp_bias=True), "mlp_bias"),
    "llama_window": (tiny_config("llama", sliding_window=WINDOW), "sliding_window"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unimplemented_config_is_refused_naming_the_field(case):
    hf_config, field = REFUSED[case]
    with pytest.raises(ValueError, match=field):
        ModelConfig.from_hf_config(hf_config)


def _ragged(vocab_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(3, vocab_size, size=n).astype(np.int32) for n in SEQ_LENS]
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in SEQ_LENS])
    segments = np.concatenate([np.full(n, i, dtype=np.int32) for i, n in enumerate(SEQ_LENS)])
    return seqs, np.concatenate(seqs), positions, segments


def _dense_logits(model, config, input_ids, positions, segments):
    @jax.jit
    def run(ids, pos, seg):
        attention = dense_causal_attention(seg, config.head_dim ** -0.5, config.sliding_window, positions=pos)
        return model.compute_logits(model(ids, pos, None, attention)[0])

    return np.asarray(run(jnp.asarray(input_ids), jnp.asarray(positions), jnp.asarray(segments)))


def test_logits_match_transformers(checkpoint):
    name, path, hf_model = checkpoint
    model, config = load_model(path, dtype="float32")
    seqs, input_ids, positions, segments = _ragged(config.vocab_size)
    ours = _dense_logits(model, config, input_ids, positions, segments)
    with torch.no_grad():
        reference = np.concatenate([hf_model(torch.tensor(seq[None].astype(np.int64))).logits[0].numpy()
                                    for seq in seqs])
    assert np.abs(reference).max() > 0.1
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    # A model whose layers differ refuses an attention that cannot take each layer's options.
    if any(getattr(layer.self_attn, "layer_attention") for layer in model.model.layers):
        with pytest.raises(ValueError, match="takes_layer_attention"):
            model(jnp.asarray(input_ids), jnp.asarray(positions), None,
                  lambda layer_idx, q, k, v, kv_layer, **_: (q, kv_layer))


def test_phi3_short_factors_match_transformers(tmp_path):
    """An engine of at most original_max_position_embeddings tokens runs LongRoPE's short factors, as transformers
    does for sequences that short."""
    save_random_hf_checkpoint(FAMILIES["phi3_longrope_partial"], tmp_path, seed=5)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    model, config = load_model(tmp_path, dtype="float32", config=ModelConfig.from_pretrained(tmp_path)
                               .for_max_model_len(16))
    seq = np.random.default_rng(1).integers(3, config.vocab_size, size=16).astype(np.int32)
    ours = _dense_logits(model, config, seq, np.arange(16, dtype=np.int32), np.zeros(16, np.int32))
    with torch.no_grad():
        reference = hf_model(torch.tensor(seq[None].astype(np.int64))).logits[0].numpy()
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    llm = paged_jax.LLM(model=str(tmp_path), dtype="float32", max_model_len=16, block_size=8,
                        max_num_batched_tokens=16, max_num_seqs=2, use_tqdm=False)
    (out,) = llm.generate([{"prompt_token_ids": seq[:10].tolist()}],
                          SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert list(out.outputs[0].token_ids) == _hf_greedy(hf_model, seq[:10].tolist(), 6)


def _hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_engine_greedy_matches_transformers(checkpoint):
    """One continuous batch: prompts of two to three windows, chunked prefill in 16-token steps (chunks end inside
    and across the window edge), a prompt sharing 20 tokens (two full blocks) with another: prefix-cache hits."""
    name, path, hf_model = checkpoint
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (17, 22, 19, 24)]
    prompts.append(prompts[1][:20] + [5, 6, 7])
    max_tokens = 6
    llm = paged_jax.LLM(model=str(path), dtype="float32", max_model_len=64, block_size=8, enable_chunked_prefill=True,
                        max_num_batched_tokens=16, max_num_seqs=8, enable_prefix_caching=True, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params, use_tqdm=False)
    (shared,) = llm.generate([{"prompt_token_ids": prompts[4]}], params, use_tqdm=False)
    assert shared.num_cached_tokens == 16  # the whole blocks of the shared prefix
    ours = [list(out.outputs[0].token_ids) for out in [*first, shared]]
    assert ours == [_hf_greedy(hf_model, p, max_tokens) for p in prompts]


def test_torch_free_random_checkpoint_of_gemma_has_unit_offset_norms(tmp_path):
    """benchmarks.startup.write_random_checkpoint writes transformers' tensor names and shapes for Gemma 2, its
    norm weights 0 (Gemma scales by 1 + weight, so 0 is the identity scale), and the checkpoint loads."""
    from safetensors.numpy import load_file

    from benchmarks.startup import write_random_checkpoint

    hf_config = tiny_config("gemma2", num_hidden_layers=1)
    ours = load_file(write_random_checkpoint(hf_config, tmp_path / "ours", dtype="float32") / "model.safetensors")
    theirs = load_file(save_random_hf_checkpoint(hf_config, tmp_path / "theirs") / "model.safetensors")
    assert {name: t.shape for name, t in ours.items()} == {name: t.shape for name, t in theirs.items()}
    norms = [name for name in ours if name.endswith("norm.weight")]
    assert len(norms) == 5 and not any(ours[name].any() for name in norms)  # 4 per layer + the final norm
    model, _ = load_model(tmp_path / "ours", dtype="float32")
    assert not np.asarray(model.model.norm.scale[...]).any()
