"""Our NNX model vs transformers on tiny random checkpoints of each supported architecture (fp32, CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.attention import dense_causal_attention
from models.config import ModelConfig
from models.dense import MIN_DOT_ROWS, dense_linear, pads_one_row
from models.llama import fuse_projections, rope_inv_freq
from models.loader import load_model
from models.testing import save_random_hf_checkpoint, tiny_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

CASES = {
    # Small original context and theta so the llama3 scaling bands all matter at head_dim 16.
    "llama3_rope_untied": (tiny_config("llama", rope_scaling=LLAMA3_ROPE, rope_theta=500000.0,
                                       num_hidden_layers=3), 1),
    "llama_tied_sharded": (tiny_config("llama", tie_word_embeddings=True), 3),
    "mistral": (tiny_config("mistral", num_key_value_heads=1), 1),
    "qwen2_bias": (tiny_config("qwen2", tie_word_embeddings=True), 1),
    "qwen3_qk_norm": (tiny_config("qwen3", head_dim=32), 2),
}

SEQ_LENS = (7, 1, 12)


def _ragged_batch(vocab_size: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(3, vocab_size, size=n).astype(np.int32) for n in SEQ_LENS]
    input_ids = np.concatenate(seqs)
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in SEQ_LENS])
    segment_ids = np.concatenate([np.full(n, i, dtype=np.int32) for i, n in enumerate(SEQ_LENS)])
    return seqs, input_ids, positions, segment_ids


def _our_logits(model, config: ModelConfig, input_ids, positions, segment_ids):
    @jax.jit
    def run(ids, pos, seg):
        attention = dense_causal_attention(seg, config.head_dim ** -0.5, config.sliding_window)
        hidden, _ = model(ids, pos, None, attention)
        return model.compute_logits(hidden)

    return np.asarray(run(jnp.asarray(input_ids), jnp.asarray(positions), jnp.asarray(segment_ids)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    hf_config, shards = CASES[case]
    save_random_hf_checkpoint(hf_config, tmp_path, shards=shards, seed=sorted(CASES).index(case))
    if shards > 1:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model, config = load_model(tmp_path, dtype="float32")
    assert config.architecture == hf_config["architectures"][0]
    assert (model.lm_head is None) == bool(hf_config["tie_word_embeddings"])

    seqs, input_ids, positions, segment_ids = _ragged_batch(config.vocab_size)
    ours = _our_logits(model, config, input_ids, positions, segment_ids)
    assert ours.dtype == np.float32 and ours.shape == (len(input_ids), config.vocab_size)

    torch_model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    with torch.no_grad():
        reference = np.concatenate(
            [torch_model(torch.tensor(seq[None].astype(np.int64))).logits[0].numpy() for seq in seqs]
        )
    assert np.abs(reference).max() > 0.1  # the comparison is not between two near-zero tensors
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)

    # The engine's layout: q/k/v and gate/up fused into one matmul each (same logits, separate weights gone).
    fuse_projections(model)
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj is None and layer.mlp.gate_proj is None
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    assert layer.self_attn.qkv_proj.kernel[...].shape == (config.hidden_size, q_dim + 2 * kv_dim)
    assert (layer.self_attn.qkv_proj.bias is not None) == bool(hf_config.get("attention_bias", False)
                                                               or hf_config["architectures"][0] == "Qwen2ForCausalLM")
    assert layer.mlp.gate_up_proj.kernel[...].shape == (config.hidden_size, 2 * config.intermediate_size)
    fused = _our_logits(model, config, input_ids, positions, segment_ids)
    np.testing.assert_allclose(fused, ours, atol=1e-5, rtol=0)
    np.testing.assert_allclose(fused, reference, atol=1e-4, rtol=0)
    assert fuse_projections(model) is model  # idempotent
    # Equal layers keep one graph definition (ReusableAttention then traces the decoder layer once).
    graphdefs = [nnx.split(layer)[0] for layer in model.model.layers]
    assert len(graphdefs) > 1 and all(g == graphdefs[0] for g in graphdefs)


def test_padding_tokens_do_not_affect_real_tokens(tmp_path):
    save_random_hf_checkpoint(tiny_config("llama"), tmp_path)
    model, config = load_model(tmp_path, dtype="float32")
    _, input_ids, positions, segment_ids = _ragged_batch(config.vocab_size)
    num_real = len(input_ids)
    pad = 5
    padded_ids = np.concatenate([input_ids, np.zeros(pad, np.int32)])
    padded_pos = np.concatenate([positions, np.zeros(pad, np.int32)])
    padded_seg = np.concatenate([segment_ids, np.full(pad, -1, np.int32)])
    plain = _our_logits(model, config, input_ids, positions, segment_ids)
    padded = _our_logits(model, config, padded_ids, padded_pos, padded_seg)
    assert np.all(np.isfinite(padded))
    np.testing.assert_allclose(padded[:num_real], plain, atol=1e-5, rtol=0)


def test_sliding_window_matches_transformers(tmp_path):
    hf_config = tiny_config("mistral", sliding_window=4)
    save_random_hf_checkpoint(hf_config, tmp_path, seed=3)
    model, config = load_model(tmp_path, dtype="float32")
    assert config.sliding_window == 4
    seq = np.arange(3, 3 + 11, dtype=np.int32)
    ours = _our_logits(model, config, seq, np.arange(11, dtype=np.int32), np.zeros(11, np.int32))
    torch_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        reference = torch_model(torch.tensor(seq[None].astype(np.int64))).logits[0].numpy()
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    # The window really changes the result, so the comparison above exercises it.
    no_window = jax.jit(lambda ids, pos: model.compute_logits(model(
        ids, pos, None, dense_causal_attention(jnp.zeros(11, jnp.int32), config.head_dim ** -0.5))[0]))(
        jnp.asarray(seq), jnp.arange(11, dtype=jnp.int32))
    assert np.abs(np.asarray(no_window)[-1] - ours[-1]).max() > 1e-4


def test_kv_caches_are_threaded_through_attention():
    config = ModelConfig.from_hf_config(tiny_config("llama", num_hidden_layers=3))
    model, _ = load_model(None, config=config, load_format="dummy", dtype="float32")
    seen = []

    def attention(layer_idx, q, k, v, kv_layer):
        seen.append((layer_idx, kv_layer))
        assert q.shape == (4, config.num_attention_heads, config.head_dim)
        assert k.shape == v.shape == (4, config.num_key_value_heads, config.head_dim)
        return jnp.zeros_like(q), (None if kv_layer is None else kv_layer + 1)

    hidden, caches = model(jnp.arange(4, dtype=jnp.int32), jnp.arange(4, dtype=jnp.int32), [10, 20, 30], attention)
    assert hidden.shape == (4, config.hidden_size) and hidden.dtype == jnp.float32
    assert seen == [(0, 10), (1, 20), (2, 30)]
    assert caches == [11, 21, 31]
    _, caches = model(jnp.arange(4, dtype=jnp.int32), jnp.arange(4, dtype=jnp.int32), None, attention)
    assert caches is None


def test_reusable_attention_traces_one_layer_and_matches_the_closure():
    """With a ReusableAttention the decoder layer is traced once for the first layer (which starts the residual
    stream) and once for all the others (its body runs once per trace), and the result equals the same attention passed as a plain closure (one trace per layer)."""
    import functools

    from models.llama import ReusableAttention

    config = ModelConfig.from_hf_config(tiny_config("qwen3", num_hidden_layers=4))
    model, _ = load_model(None, config=config, load_format="dummy", dtype="float32")
    num_tokens = 6
    segment_ids = jnp.asarray([0, 0, 0, 1, 1, -1], jnp.int32)
    sm_scale = config.head_dim ** -0.5
    traces = []

    def fn(meta, q, k, v, kv_layer):
        traces.append(1)  # Python side effect: runs once per trace
        out, _ = dense_causal_attention(meta["segment_ids"], sm_scale)(None, q, k, v, None)
        return out, kv_layer + meta["bump"]

    ids = jnp.asarray([5, 9, 2, 7, 7, 0], jnp.int32)
    positions = jnp.asarray([0, 1, 2, 0, 1, 0], jnp.int32)
    caches = [jnp.float32(i) for i in range(config.num_hidden_layers)]

    @jax.jit
    def run_reusable(segment_ids, caches):
        attention = ReusableAttention(functools.partial(fn), dict(segment_ids=segment_ids, bump=jnp.float32(1)))
        return model(ids, positions, caches, attention)

    @jax.jit
    def run_closure(segment_ids, caches):
        meta = dict(segment_ids=segment_ids, bump=jnp.float32(1))
        return model(ids, positions, caches, lambda layer_idx, q, k, v, kv: fn(meta, q, k, v, kv))

    hidden_reusable, caches_reusable = run_reusable(segment_ids, caches)
    assert len(traces) == 1
    traces.clear()
    hidden_closure, caches_closure = run_closure(segment_ids, caches)
    assert len(traces) == config.num_hidden_layers
    np.testing.assert_allclose(np.asarray(hidden_reusable), np.asarray(hidden_closure), rtol=1e-6, atol=1e-6)
    assert [float(c) for c in caches_reusable] == [float(c) for c in caches_closure] == [1.0, 2.0, 3.0, 4.0]
    assert hidden_reusable.shape == (num_tokens, config.hidden_size)


def test_bf16_model_runs_and_tracks_fp32(tmp_path):
    save_random_hf_checkpoint(tiny_config("qwen3"), tmp_path)
    model32, config = load_model(tmp_path, dtype="float32")
    model16, _ = load_model(tmp_path, dtype="bfloat16")
    assert model16.model.layers[0].self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    _, input_ids, positions, segment_ids = _ragged_batch(config.vocab_size)
    logits32 = _our_logits(model32, config, input_ids, positions, segment_ids)
    logits16 = _our_logits(model16, config, input_ids, positions, segment_ids)
    assert logits16.dtype == np.float32
    assert np.abs(logits16 - logits32).max() < 0.05 * np.abs(logits32).max()


def test_config_parsing_variants():
    # transformers 5 layout: rope params nested under rope_parameters.
    hf5 = tiny_config("llama")
    del hf5["rope_theta"]
    hf5["rope_parameters"] = dict(LLAMA3_ROPE, rope_theta=123.0)
    config = ModelConfig.from_hf_config(hf5)
    assert config.rope_theta == 123.0 and config.rope_scaling["rope_type"] == "llama3"
    # transformers 4 layout with the legacy "type" key.
    legacy = tiny_config("llama", rope_scaling={**{k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"},
                                                "type": "llama3"})
    assert ModelConfig.from_hf_config(legacy).rope_scaling == ModelConfig.from_hf_config(hf5).rope_scaling
    # head_dim defaults to hidden / heads.
    no_head_dim = tiny_config("llama")
    del no_head_dim["head_dim"]
    assert ModelConfig.from_hf_config(no_head_dim).head_dim == 64 // 4
    assert ModelConfig.from_hf_config(tiny_config("qwen2")).attention_bias is True
    assert ModelConfig.from_hf_config(tiny_config("qwen3")).qk_norm is True
    assert ModelConfig.from_hf_config(tiny_config("mistral", sliding_window=4096)).sliding_window == 4096
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        ModelConfig.from_hf_config({**tiny_config("llama"), "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelConfig.from_hf_config(tiny_config("llama", num_key_value_heads=3))
    with pytest.raises(ValueError, match="yarn"):
        ModelConfig.from_hf_config(tiny_config("llama", rope_scaling={"rope_type": "yarn", "factor": 2.0}))


def test_llama3_inv_freq_matches_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = LlamaConfig(**{k: v for k, v in tiny_config("llama", rope_scaling=LLAMA3_ROPE,
                                                            rope_theta=500000.0).items()
                               if k not in ("architectures", "model_type")})
    reference, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rope_inv_freq(16, 500000.0, tuple(sorted(ModelConfig.from_hf_config(
        tiny_config("llama", rope_scaling=LLAMA3_ROPE)).rope_scaling.items())))
    np.testing.assert_allclose(ours, reference.numpy(), rtol=1e-6)
    plain = rope_inv_freq(16, 500000.0, None)
    assert not np.allclose(ours, plain)  # scaling changed some frequencies


def test_one_row_projection_stays_a_two_row_matmul():
    """A batch-1 step's projections (models.dense): a one-row product with a long, wide weight is multiplied as two
    equal rows, so XLA keeps the matmul instead of strength-reducing a matrix-vector dot (a 128-expert router's
    too); a small weight's stays one row (a short reduce, or an 8-expert router's output). Either way the result is
    the one-row product."""
    rows = jax.random.normal(jax.random.key(1), (3, 2048), jnp.float32)
    assert not pads_one_row(2048, 8)
    for in_features, out_features, dot_rows in ((2048, 1024, MIN_DOT_ROWS), (2048, 128, MIN_DOT_ROWS), (64, 48, 1)):
        assert pads_one_row(in_features, out_features) == (dot_rows == MIN_DOT_ROWS)
        layer = dense_linear(in_features, out_features, use_bias=True, dtype=jnp.float32, param_dtype=jnp.float32,
                             rngs=nnx.Rngs(0), bias_init=nnx.initializers.normal(1.0))
        x = rows[:, :in_features]
        expected = (np.asarray(x, np.float64) @ np.asarray(layer.kernel[...], np.float64)
                    + np.asarray(layer.bias[...]))
        with jax.default_matmul_precision("highest"):
            for count in (1, 3):
                np.testing.assert_allclose(np.asarray(layer(x[:count])), expected[:count], rtol=1e-4, atol=1e-4)
            hlo = jax.jit(lambda v: layer(v)).lower(x[:1]).compile().as_text()
        dots = [line for line in hlo.splitlines() if " dot(" in line]
        assert dots and all(f"f32[{dot_rows},{out_features}]" in line for line in dots), dots
