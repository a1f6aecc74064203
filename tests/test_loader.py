"""Checkpoint loading: corrupt or mismatched checkpoints fail with errors naming the problem; dummy and bf16 loads."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models.attention import dense_causal_attention
from models.config import ModelConfig
from models.loader import load_model
from models.testing import save_random_hf_checkpoint, tiny_config

torch = pytest.importorskip("torch")


@pytest.fixture
def llama_dir(tmp_path):
    return save_random_hf_checkpoint(tiny_config("llama"), tmp_path / "ckpt")


def _rewrite_weights(model_dir, edit):
    """Load model.safetensors as numpy, apply edit(dict) in place, save it back."""
    tensors = load_file(str(model_dir / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(model_dir / "model.safetensors"))


def _logits(model, config, ids):
    attention = dense_causal_attention(jnp.zeros(len(ids), jnp.int32), config.head_dim ** -0.5)
    hidden, _ = model(jnp.asarray(ids, jnp.int32), jnp.arange(len(ids), dtype=jnp.int32), None, attention)
    return np.asarray(model.compute_logits(hidden))


def test_wrong_shaped_tensor_is_named_with_both_shapes(llama_dir):
    name = "model.layers.1.mlp.up_proj.weight"

    def edit(tensors):
        tensors[name] = tensors[name][:-1]

    _rewrite_weights(llama_dir, edit)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*\(127, 64\).*\(128, 64\)"):
        load_model(llama_dir, dtype="float32")


def test_missing_tensor_is_named(llama_dir):
    _rewrite_weights(llama_dir, lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.0\.self_attn\.k_proj\.weight"):
        load_model(llama_dir, dtype="float32")


def test_unexpected_tensor_is_named_but_inv_freq_is_ignored(llama_dir):
    def add_inv_freq(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)

    _rewrite_weights(llama_dir, add_inv_freq)
    load_model(llama_dir, dtype="float32")  # known-ignorable

    def add_stray(tensors):
        tensors["model.layers.0.self_attn.extra_proj.weight"] = np.ones((4, 4), np.float32)

    _rewrite_weights(llama_dir, add_stray)
    with pytest.raises(ValueError, match=r"unexpected.*extra_proj"):
        load_model(llama_dir, dtype="float32")


def test_missing_config_json(llama_dir):
    (llama_dir / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(llama_dir)


def test_missing_weights(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(llama_dir)


def test_missing_shard(tmp_path):
    model_dir = save_random_hf_checkpoint(tiny_config("llama"), tmp_path / "sharded", shards=2)
    (model_dir / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(model_dir)


def test_unsupported_architecture(llama_dir):
    config = json.loads((llama_dir / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (llama_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FalconForCausalLM"):
        load_model(llama_dir)


def test_truncated_safetensors(llama_dir):
    weights = llama_dir / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(llama_dir, dtype="float32")


def test_bad_arguments(llama_dir):
    with pytest.raises(ValueError, match="load_format"):
        load_model(llama_dir, load_format="pt")
    with pytest.raises(ValueError, match="int8"):
        load_model(llama_dir, dtype="int8")


def test_dummy_load_from_config_alone(llama_dir):
    # Only config.json is read: the weights can be gone.
    (llama_dir / "model.safetensors").unlink()
    model, config = load_model(llama_dir, load_format="dummy", dtype="float32", seed=1)
    kernel = np.asarray(model.model.layers[0].mlp.gate_proj.kernel[...])
    assert kernel.shape == (64, 128)
    assert 0.01 < kernel.std() < 0.03  # N(0, 0.02)
    np.testing.assert_array_equal(np.asarray(model.model.norm.scale[...]), np.ones(64, np.float32))
    logits = _logits(model, config, [3, 4, 5])
    assert logits.shape == (3, 256) and np.all(np.isfinite(logits))
    # Same seed -> same weights; different seed -> different weights.
    again, _ = load_model(llama_dir, load_format="dummy", dtype="float32", seed=1)
    other, _ = load_model(llama_dir, load_format="dummy", dtype="float32", seed=2)
    np.testing.assert_array_equal(np.asarray(again.model.layers[0].mlp.gate_proj.kernel[...]), kernel)
    assert not np.allclose(np.asarray(other.model.layers[0].mlp.gate_proj.kernel[...]), kernel)


def test_dummy_load_from_model_config_without_path():
    config = ModelConfig.from_hf_config(tiny_config("qwen3", tie_word_embeddings=True))
    model, returned = load_model(None, config=config, load_format="dummy")
    assert returned is config
    assert model.lm_head is None
    assert model.model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    assert _logits(model, config, [1, 2]).dtype == np.float32


def test_bf16_checkpoint_loads(tmp_path):
    fp32_dir = save_random_hf_checkpoint(tiny_config("qwen2"), tmp_path / "fp32", seed=5)
    bf16_dir = save_random_hf_checkpoint(tiny_config("qwen2"), tmp_path / "bf16", seed=5, dtype=torch.bfloat16)
    model_bf16_file, config = load_model(bf16_dir, dtype="float32")
    model_fp32_file, _ = load_model(fp32_dir, dtype="float32")
    q_proj = model_bf16_file.model.layers[0].self_attn.q_proj
    # The bf16 values are exactly the rounded fp32 ones.
    expected = np.asarray(model_fp32_file.model.layers[0].self_attn.q_proj.kernel[...]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(q_proj.kernel[...]).astype(jnp.bfloat16), expected)
    bias = np.asarray(q_proj.bias[...])
    assert bias.shape == (64,) and np.abs(bias).max() > 0
    model_bf16, _ = load_model(bf16_dir, dtype="bfloat16")
    assert model_bf16.model.layers[0].mlp.down_proj.kernel[...].dtype == jnp.bfloat16
    logits = jax.jit(lambda ids: _logits_traced(model_bf16, config, ids))(jnp.arange(3, 9, dtype=jnp.int32))
    assert np.all(np.isfinite(np.asarray(logits)))


def _logits_traced(model, config, ids):
    attention = dense_causal_attention(jnp.zeros(ids.shape[0], jnp.int32), config.head_dim ** -0.5)
    hidden, _ = model(ids, jnp.arange(ids.shape[0], dtype=jnp.int32), None, attention)
    return model.compute_logits(hidden)


def test_tied_checkpoint_with_redundant_lm_head_loads(tmp_path):
    model_dir = save_random_hf_checkpoint(tiny_config("llama", tie_word_embeddings=True), tmp_path / "tied")

    def add_lm_head(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()

    _rewrite_weights(model_dir, add_lm_head)
    model, _ = load_model(model_dir, dtype="float32")
    assert model.lm_head is None
