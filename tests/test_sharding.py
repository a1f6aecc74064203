"""paged_jax.parallel and models.tensor_parallel: tensor/data parallelism on CPU meshes (8 virtual devices from
conftest).

Every check compares a sharded run with the unsharded (tp = 1) one in float32.
"""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from benchmarks.sharding import bytes_per_device, count_collectives
from models.attention import dense_causal_attention
from models.config import ModelConfig
from models.loader import init_dummy_model, load_model
from models.tensor_parallel import load_sharded_model, shard_model
from models.testing import tiny_config
from paged_jax.ops import ragged_paged_attention, write_kv
from paged_jax.parallel import (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, TP_AXIS, HeadLayout, ShardingPlan,
                                initialize_distributed, make_mesh)

REPO_ROOT = Path(__file__).resolve().parents[1]

# Two ragged sequences of a flat batch (lengths 7 and 5): token ids, per-sequence positions and segment ids.
SEQ_LENS = (7, 5)
TOKENS = np.array([5, 17, 99, 3, 250, 64, 8, 11, 200, 42, 7, 1], np.int32)
POSITIONS = np.concatenate([np.arange(n) for n in SEQ_LENS]).astype(np.int32)
SEGMENTS = np.concatenate([np.full(n, i) for i, n in enumerate(SEQ_LENS)]).astype(np.int32)


def _qwen3_config(**overrides) -> ModelConfig:
    """Tiny Qwen3 shape (q/k norm) whose 8 q heads divide every tp in 1..8; 2 kv heads, so tp = 4, 8 replicate
    kv heads."""
    hf = tiny_config("qwen3", num_attention_heads=8, num_key_value_heads=2, hidden_size=64, head_dim=16,
                     intermediate_size=128)
    hf.update(overrides)
    return ModelConfig.from_hf_config(hf)


@pytest.fixture(scope="module")
def qwen3_model():
    return init_dummy_model(_qwen3_config(), dtype=jnp.float32, seed=3)


def _dense_local_attention(sm_scale):
    """Per-device attention for shard_attention: cache-free causal attention within segments."""

    def local(layer_idx, q, k, v, kv_layer, metadata):
        segment_ids, positions = metadata
        return dense_causal_attention(segment_ids, sm_scale, positions=positions)(layer_idx, q, k, v, kv_layer)

    return local


def _forward_fn(plan: ShardingPlan):
    """jitted (model, tokens, positions, segments) -> float32[T, V] logits, gathered."""
    sm_scale = plan.config.head_dim ** -0.5

    @nnx.jit
    def forward(model, tokens, positions, segments):
        attention = plan.shard_attention(_dense_local_attention(sm_scale), (segments, positions))
        hidden, _ = model(tokens, positions, None, attention)
        return model.compute_logits(hidden)  # the tensor-parallel model gathers them over tp

    return forward


def _reference_logits(model, tokens=TOKENS, positions=POSITIONS, segments=SEGMENTS):
    """Unsharded logits (single device, no shard_map)."""
    sm_scale = model.config.head_dim ** -0.5

    @nnx.jit
    def forward(model, tokens, positions, segments):
        hidden, _ = model(tokens, positions, None, dense_causal_attention(segments, sm_scale, positions=positions))
        return model.compute_logits(hidden)

    return np.asarray(forward(model, tokens, positions, segments))


def _assert_split_evenly(plan: ShardingPlan, model):
    """Every parameter with a tp-split spec has shards of 1/tp of it on each device, one per device of the mesh."""
    tp = plan.tensor_parallel_size
    split = 0
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        array = variable.get_value()
        spec = array.sharding.spec
        assert spec == plan.param_spec(path, array.shape), path
        shard_shape = array.sharding.shard_shape(array.shape)
        if TP_AXIS in spec:
            split += 1
            assert np.prod(shard_shape) * tp == array.size, (path, shard_shape, array.shape)
        else:
            assert shard_shape == array.shape, path
        assert {s.device for s in array.addressable_shards} == set(plan.mesh.devices.flat)
        assert all(s.data.shape == shard_shape for s in array.addressable_shards)
    assert split > 0


# ------------------------------------------------------------------------------------------------------------------
# Meshes, head layouts, specs
# ------------------------------------------------------------------------------------------------------------------


def test_make_mesh_axes_and_errors():
    mesh = make_mesh(4, 2)
    assert mesh.axis_names == ("dp", "tp")
    assert dict(mesh.shape) == {"dp": 2, "tp": 4}
    # tp is the minor axis: a tp group is 4 consecutive devices.
    assert [d.id for d in mesh.devices[0]] == [d.id for d in jax.devices()[:4]]
    explicit = make_mesh(2, devices=jax.devices()[6:8])
    assert list(explicit.devices.flat) == jax.devices()[6:8]
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_mesh(0)
    with pytest.raises(ValueError, match="16 devices needed"):
        make_mesh(8, 2)
    with pytest.raises(ValueError, match="devices has 3 entries"):
        make_mesh(2, devices=jax.devices()[:3])


@pytest.mark.parametrize(
    "q_heads, kv_heads, tp, expected",
    [
        (8, 2, 2, (1, 4, 8, 2)),  # divides: identity
        (8, 2, 8, (4, 1, 8, 8)),  # kv heads < tp: each kv head copied 4 times, no padding
        (9, 3, 3, (1, 3, 9, 3)),  # SmolLM2 at tp = 3: natural
        (9, 3, 2, (2, 2, 12, 6)),  # SmolLM2 at tp = 2: 3 zero q heads
        (9, 3, 8, (8, 1, 24, 24)),
    ],
)
def test_head_layout(q_heads, kv_heads, tp, expected):
    layout = HeadLayout.for_heads(q_heads, kv_heads, tp)
    replication, q_per_kv, q_padded, kv_padded = expected
    assert (layout.kv_replication, layout.q_heads_per_kv) == (replication, q_per_kv)
    assert (layout.num_q_heads_padded, layout.num_kv_heads_padded) == (q_padded, kv_padded)
    assert layout.num_q_heads_padded % tp == 0 and layout.num_kv_heads_padded % tp == 0


def test_head_padding_refused_with_clear_error():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 .*num_attention_heads=9, num_key_value_heads=3"):
        HeadLayout.for_heads(9, 3, 2, pad_heads=False)
    assert HeadLayout.for_heads(9, 3, 3, pad_heads=False).is_identity


def test_head_rewrite_keeps_the_q_to_kv_mapping():
    """After the rewrite, padded q head j reads kv head j // g' and holds original head (its group, its slot)."""
    layout = HeadLayout.for_heads(9, 3, 2)  # r = 2, g' = 2
    head_dim = 2
    q_ids = np.repeat(np.arange(1, 10), head_dim)[None, :].astype(np.float32)  # column block h holds h + 1
    kv_ids = np.repeat(np.arange(1, 4), head_dim)[None, :].astype(np.float32)
    q_new = layout.expand_q_columns(q_ids, head_dim)[0, ::head_dim]
    kv_new = layout.expand_kv_columns(kv_ids, head_dim)[0, ::head_dim]
    g_new = layout.q_heads_per_kv
    for j, q_id in enumerate(q_new):
        if q_id == 0:
            continue  # padding head
        original_q = int(q_id) - 1
        assert int(kv_new[j // g_new]) - 1 == original_q // 3  # the kv head this q head used originally
    assert sorted(int(x) for x in q_new if x) == list(range(1, 10))
    o_ids = np.repeat(np.arange(1, 10), head_dim)[:, None].astype(np.float32)
    np.testing.assert_array_equal(layout.expand_q_rows(o_ids, head_dim)[::head_dim, 0], q_new)


def test_param_specs_megatron_rules():
    plan = ShardingPlan.create(_qwen3_config(), make_mesh(4))
    layer = ("model", "layers", 0)
    assert plan.param_spec(layer + ("self_attn", "q_proj", "kernel"), (64, 128)) == P(None, "tp")
    assert plan.param_spec(layer + ("self_attn", "o_proj", "kernel"), (128, 64)) == P("tp", None)
    assert plan.param_spec(layer + ("self_attn", "q_norm", "scale"), (16,)) == P()
    assert plan.param_spec(layer + ("mlp", "up_proj", "kernel"), (64, 128)) == P(None, "tp")
    assert plan.param_spec(layer + ("mlp", "down_proj", "kernel"), (128, 64)) == P("tp", None)
    assert plan.param_spec(("model", "embed_tokens", "embedding"), (256, 64)) == P("tp", None)
    assert plan.param_spec(("lm_head", "kernel"), (64, 256)) == P(None, "tp")
    # A vocabulary tp does not divide is replicated rather than split unevenly.
    assert plan.param_spec(("lm_head", "kernel"), (64, 250)) == P()
    per_device = plan.per_device_model_config  # what one of the 4 devices stores: for sizing its KV pool
    assert (per_device.num_attention_heads, per_device.num_key_value_heads, per_device.intermediate_size) == (2, 1, 32)
    replicated_kv = ShardingPlan.create(_qwen3_config(), make_mesh(4), kv_layout="replicated")
    assert replicated_kv.param_spec(layer + ("self_attn", "q_proj", "kernel"), (64, 128)) == P()
    assert replicated_kv.param_spec(layer + ("mlp", "gate_proj", "kernel"), (64, 128)) == P(None, "tp")
    with pytest.raises(ValueError, match="no sharding rule"):
        plan.param_spec(("model", "mystery", "kernel"), (4, 4))
    # Fused projections (models.llama.fuse_projections) have no tp rule: refused, never silently replicated.
    with pytest.raises(ValueError, match="qkv_proj"):
        plan.param_spec(layer + ("self_attn", "qkv_proj", "kernel"), (64, 256))
    with pytest.raises(ValueError, match="gate_up_proj"):
        plan.param_spec(layer + ("mlp", "gate_up_proj", "kernel"), (64, 256))
    with pytest.raises(ValueError, match="kv_layout"):
        ShardingPlan.create(_qwen3_config(), make_mesh(2), kv_layout="striped")


# ------------------------------------------------------------------------------------------------------------------
# Model-level equivalence
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_qwen3_logits_match_tp1(qwen3_model, tp):
    reference = _reference_logits(qwen3_model)
    plan = ShardingPlan.create(qwen3_model.config, make_mesh(tp))
    sharded = shard_model(qwen3_model, plan)
    _assert_split_evenly(plan, sharded)
    logits = _forward_fn(plan)(sharded, TOKENS, POSITIONS, SEGMENTS)
    assert logits.sharding.spec == P("dp", None) or logits.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(logits), reference, rtol=1e-5, atol=1e-5)


def test_dp_by_tp_and_replicated_kv_layouts_match(qwen3_model):
    """dp = 2 x tp = 4 (each dp group runs its own sequences) and tp = 4 with the attention block replicated."""
    reference = _reference_logits(qwen3_model)
    # dp: the flat batch is split in two halves of 6 tokens, one per dp group; both halves are self-contained.
    tokens = np.concatenate([TOKENS[:6], TOKENS[7:], [0]]).astype(np.int32)  # A's first 6 | B (5) + 1 padding
    positions = np.concatenate([POSITIONS[:6], POSITIONS[7:], [0]]).astype(np.int32)
    segments = np.array([0] * 6 + [0] * 5 + [-1], np.int32)  # local segment ids; -1 marks padding
    plan = ShardingPlan.create(qwen3_model.config, make_mesh(4, 2))
    logits = np.asarray(_forward_fn(plan)(shard_model(qwen3_model, plan), tokens, positions, segments))
    np.testing.assert_allclose(logits[:6], reference[:6], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(logits[6:11], reference[7:], rtol=1e-5, atol=1e-5)

    plan = ShardingPlan.create(qwen3_model.config, make_mesh(4), kv_layout="replicated")
    sharded = shard_model(qwen3_model, plan)
    q_kernel = sharded.model.layers[0].self_attn.q_proj.kernel.get_value()
    assert q_kernel.sharding.is_fully_replicated
    np.testing.assert_allclose(np.asarray(_forward_fn(plan)(sharded, TOKENS, POSITIONS, SEGMENTS)), reference,
                               rtol=1e-5, atol=1e-5)


def test_one_all_reduce_per_attention_block_and_mlp(qwen3_model):
    """XLA inserts exactly 2 all-reduces per layer, 1 for the vocab-parallel embedding and 1 all-gather of logits."""
    plan = ShardingPlan.create(qwen3_model.config, make_mesh(4))
    sharded = shard_model(qwen3_model, plan)
    hlo = _forward_fn(plan).lower(sharded, TOKENS, POSITIONS, SEGMENTS).compile().as_text()
    counts = count_collectives(hlo)
    num_layers = qwen3_model.config.num_hidden_layers
    assert counts["all-reduce"] == 2 * num_layers + 1, counts
    # The only gather is of the [T, V] logits (not of any weight), and nothing else moves.
    assert counts["all-gather"] == 1, counts
    assert counts["reduce-scatter"] == counts["all-to-all"] == counts["collective-permute"] == 0, counts
    vocab = qwen3_model.config.vocab_size
    assert f"f32[{len(TOKENS)},{vocab}]" in next(l for l in hlo.splitlines() if " all-gather(" in l)


def test_sharded_params_memory_is_one_over_tp(qwen3_model):
    plan = ShardingPlan.create(qwen3_model.config, make_mesh(8))
    sharded = shard_model(qwen3_model, plan)
    per_device = bytes_per_device(nnx.state(sharded))
    assert len(per_device) == 8 and len(set(per_device.values())) == 1
    split_bytes = replicated_bytes = 0
    for path, variable in nnx.to_flat_state(nnx.state(sharded)):
        array = variable.get_value()
        if array.sharding.is_fully_replicated:
            replicated_bytes += array.nbytes
        else:
            split_bytes += array.nbytes
    assert next(iter(per_device.values())) == split_bytes // 8 + replicated_bytes
    assert replicated_bytes < 0.02 * split_bytes  # only norm scales stay whole


def test_dummy_load_is_sharded_at_creation_and_equals_sharding_afterwards():
    config = _qwen3_config(num_attention_heads=6, num_key_value_heads=3)  # tp = 4: kv copies and 6 zero q heads
    plan = ShardingPlan.create(config, make_mesh(4))
    created = load_sharded_model(None, plan, dtype="float32", load_format="dummy", seed=5)
    afterwards = shard_model(init_dummy_model(config, dtype=jnp.float32, seed=5), plan)
    _assert_split_evenly(plan, created)
    for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(created)), nnx.to_flat_state(nnx.state(afterwards))):
        assert a.get_value().sharding == b.get_value().sharding, path
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))


# ------------------------------------------------------------------------------------------------------------------
# SmolLM2 (9 q heads, 3 kv heads), loaded straight into shards
# ------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_dir):
    model, config = load_model(smollm2_dir, dtype="float32")
    tokens = np.array([1, 504, 3458, 282, 4055, 314, 216, 1345, 30, 2, 9519, 28], np.int32)
    return config, tokens, _reference_logits(model, tokens)


@pytest.mark.parametrize("tp", [3, 2, 8])
def test_smollm2_sharded_load_matches_tp1(smollm2_dir, smollm2_reference, tp):
    config, tokens, reference = smollm2_reference
    plan = ShardingPlan.create(config, make_mesh(tp))
    assert plan.head_layout.is_identity == (tp == 3)
    model = load_sharded_model(smollm2_dir, plan, dtype="float32")
    assert model.config.num_attention_heads == plan.head_layout.num_q_heads_padded
    _assert_split_evenly(plan, model)
    logits = np.asarray(_forward_fn(plan)(model, tokens, POSITIONS, SEGMENTS))
    # fp32; 30 layers of different reduction order (tp-split matmuls + all-reduce) give ~1e-4 on logits ~O(10)
    np.testing.assert_allclose(logits, reference, rtol=1e-4, atol=2e-4)
    assert (logits.argmax(-1) == reference.argmax(-1)).all()


def test_smollm2_without_padding_raises(smollm2_dir):
    config = ModelConfig.from_pretrained(smollm2_dir)
    with pytest.raises(ValueError, match="tensor_parallel_size=4"):
        ShardingPlan.create(config, make_mesh(4), pad_heads=False)


# ------------------------------------------------------------------------------------------------------------------
# Paged attention on a sharded KV pool
# ------------------------------------------------------------------------------------------------------------------


def _paged_prefill_then_decode(model, plan, *, dp_groups: int):
    """Prefill SEQ_LENS sequences then one decode token each; every dp group runs a copy of both sequences
    in its own local blocks. Returns (prefill logits [dp, 12, V], decode logits [dp, 2, V], kv pool)."""
    config = model.config
    block_size, blocks_per_seq = 4, 3
    num_local_blocks = 1 + 2 * blocks_per_seq
    local_tables = 1 + np.arange(2 * blocks_per_seq, dtype=np.int32).reshape(2, blocks_per_seq)

    def metadata(q_lens, kv_lens):
        positions = np.concatenate([np.arange(k - q, k) for q, k in zip(q_lens, kv_lens)]).astype(np.int32)
        seq_of_token = np.repeat(np.arange(2), q_lens)
        slots = local_tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        tile = lambda x: np.concatenate([x] * dp_groups)  # noqa: E731  every dp group: same local layout
        return tile(positions), (tile(slots.astype(np.int32)), tile(np.asarray(kv_lens, np.int32)),
                                 tile(local_tables), tile(cu))

    if plan is None:
        shape = (num_local_blocks, block_size, config.num_key_value_heads, config.head_dim)
        kv = [(jnp.zeros(shape), jnp.zeros(shape)) for _ in range(config.num_hidden_layers)]
    else:
        kv = plan.make_kv_caches(num_local_blocks * dp_groups, block_size, jnp.float32)

    @nnx.jit
    def step(model, kv, tokens, positions, meta):
        slots, lens, tables, cu = meta
        if plan is None:
            def attention(layer_idx, q, k, v, kv_layer):
                k_pages, v_pages = write_kv(*kv_layer, k, v, slots)
                out = ragged_paged_attention(q, k_pages, v_pages, lens, tables, cu,
                                             sm_scale=config.head_dim ** -0.5, impl="reference")
                return out, (k_pages, v_pages)
        else:
            attention = plan.paged_attention(slot_mapping=slots, kv_lens=lens, block_tables=tables, cu_q_lens=cu,
                                             sm_scale=config.head_dim ** -0.5, impl="reference")
        hidden, kv = model(tokens, positions, kv, attention)
        return model.compute_logits(hidden), kv

    positions, meta = metadata(SEQ_LENS, SEQ_LENS)
    prefill, kv = step(model, kv, np.concatenate([TOKENS] * dp_groups), positions, meta)
    positions, meta = metadata((1, 1), tuple(n + 1 for n in SEQ_LENS))
    decode, kv = step(model, kv, np.array([21, 33] * dp_groups, np.int32), positions, meta)
    return (np.asarray(prefill).reshape(dp_groups, -1, config.vocab_size),
            np.asarray(decode).reshape(dp_groups, 2, config.vocab_size), kv)


@pytest.mark.parametrize("tp, dp", [(4, 1), (8, 1), (2, 2)])
def test_paged_attention_on_sharded_kv_pool_matches_tp1(qwen3_model, tp, dp):
    prefill_ref, decode_ref, _ = _paged_prefill_then_decode(qwen3_model, None, dp_groups=1)
    plan = ShardingPlan.create(qwen3_model.config, make_mesh(tp, dp))
    prefill, decode, kv = _paged_prefill_then_decode(shard_model(qwen3_model, plan), plan, dp_groups=dp)
    for group in range(dp):
        np.testing.assert_allclose(prefill[group], prefill_ref[0], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(decode[group], decode_ref[0], rtol=1e-5, atol=1e-5)
    k_pages = kv[0][0]
    assert k_pages.sharding.is_equivalent_to(plan.kv_cache_sharding, k_pages.ndim)
    # Each device holds 1/dp of the blocks and only its own kv heads.
    local_shape = k_pages.sharding.shard_shape(k_pages.shape)
    assert local_shape[0] * dp == k_pages.shape[0]
    assert local_shape[2] == plan.num_kv_heads_per_device == plan.model_config.num_key_value_heads // tp


# ------------------------------------------------------------------------------------------------------------------
# Callers that know nothing of meshes: a plain AttentionFn, and generate
# ------------------------------------------------------------------------------------------------------------------


def test_plain_attention_fn_is_run_per_device_by_the_tp_model(qwen3_model):
    """The tensor-parallel model wraps an ordinary single-device AttentionFn (closing over its metadata)."""
    reference = _reference_logits(qwen3_model)
    plan = ShardingPlan.create(qwen3_model.config, make_mesh(4))
    sharded = shard_model(qwen3_model, plan)
    seen_heads = []

    @nnx.jit
    def forward(model, tokens, positions, segments):
        dense = dense_causal_attention(segments, model.config.head_dim ** -0.5, positions=positions)

        def attention(layer_idx, q, k, v, kv_layer):
            seen_heads.append((q.shape[1], k.shape[1]))
            return dense(layer_idx, q, k, v, kv_layer)

        hidden, _ = model(tokens, positions, None, attention)
        return model.compute_logits(hidden)

    logits = forward(sharded, TOKENS, POSITIONS, SEGMENTS)
    # Each device saw its 2 of the 8 q heads and its 1 of the 4 (replicated-twice) kv heads.
    assert set(seen_heads) == {(2, 1)}
    np.testing.assert_allclose(np.asarray(logits), reference, rtol=1e-5, atol=1e-5)
    dp_plan = ShardingPlan.create(qwen3_model.config, make_mesh(2, 2))
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        dp_plan.wrap_attention(lambda *args: args)


GEN_PROMPTS = np.array([[1, 504, 3458, 282, 4055, 314], [1, 9519, 28, 30, 0, 0]], np.int32)
GEN_LENGTHS = np.array([6, 4], np.int32)


def test_generate_on_sharded_qwen3_matches_tp1_without_gathering_weights_or_kv(qwen3_model):
    from paged_jax.research.generate import generate

    reference = generate(qwen3_model, GEN_PROMPTS, GEN_LENGTHS, max_new_tokens=6, attention_impl="reference")
    plan = ShardingPlan.create(qwen3_model.config, make_mesh(4))
    sharded = shard_model(qwen3_model, plan)
    out = generate(sharded, GEN_PROMPTS, GEN_LENGTHS, max_new_tokens=6, attention_impl="reference")
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(reference.logprobs), atol=1e-5)

    graphdef, state = nnx.split(sharded)
    hlo = jax.jit(lambda state: generate((graphdef, state), GEN_PROMPTS, GEN_LENGTHS, max_new_tokens=6,
                                         attention_impl="reference")).lower(state).compile().as_text()
    gathers = [line for line in hlo.splitlines() if " all-gather(" in line or " all-gather-start(" in line]
    batch, vocab = GEN_PROMPTS.shape[0], qwen3_model.config.vocab_size
    # Only [B, V] logits are gathered (prefill and decode); never a weight or the KV pool.
    assert gathers and all(f"[{batch},{vocab}]" in line for line in gathers), gathers
    assert count_collectives(hlo)["all-to-all"] == 0


@pytest.mark.slow  # `make test-all`; CI: generate on sharded Qwen3 and the tp engines below cover the same path
def test_generate_on_sharded_smollm2_matches_tp1(smollm2_dir):
    from paged_jax.research.generate import generate

    model, config = load_model(smollm2_dir, dtype="float32")
    reference = generate(model, GEN_PROMPTS, GEN_LENGTHS, max_new_tokens=4, attention_impl="reference")
    plan = ShardingPlan.create(config, make_mesh(2))  # 9 q heads over 2 devices: padded to 12
    sharded = load_sharded_model(smollm2_dir, plan, dtype="float32")
    out = generate(sharded, GEN_PROMPTS, GEN_LENGTHS, max_new_tokens=4, attention_impl="reference")
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(reference.tokens))


# ------------------------------------------------------------------------------------------------------------------
# Multi-host start-up
# ------------------------------------------------------------------------------------------------------------------


def test_initialize_distributed_single_process_is_a_no_op(monkeypatch):
    for name in (ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID, "JAX_COORDINATOR_ADDRESS",
                 "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE",
                 "TPU_WORKER_HOSTNAMES"):
        monkeypatch.delenv(name, raising=False)
    assert initialize_distributed() is False
    monkeypatch.setenv(ENV_COORDINATOR, "127.0.0.1:1234")
    with pytest.raises(ValueError, match="missing"):
        initialize_distributed()
    with pytest.raises(ValueError, match="process_id"):
        initialize_distributed("127.0.0.1:1234", 2, 5)


_WORKER = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    from flax import nnx
    from models.tensor_parallel import load_sharded_model
    from paged_jax.parallel import ShardingPlan, initialize_distributed, make_mesh
    from models.attention import dense_causal_attention
    from models.config import ModelConfig
    from models.testing import tiny_config

    assert initialize_distributed(initialization_timeout=60) is True
    assert jax.process_count() == 2 and len(jax.devices()) == 4 and len(jax.local_devices()) == 2
    config = ModelConfig.from_hf_config(tiny_config("qwen3", num_attention_heads=8, num_key_value_heads=2))
    tokens = np.array([3, 9, 27, 81, 243, 5], np.int32)
    positions = np.arange(6, dtype=np.int32)
    segments = np.zeros(6, np.int32)

    def logits_on(plan):
        model = load_sharded_model(None, plan, dtype="float32", load_format="dummy", seed=1)

        @nnx.jit
        def forward(model):
            local = lambda l, q, k, v, kv, meta: dense_causal_attention(  # noqa: E731
                meta[0], config.head_dim ** -0.5)(l, q, k, v, kv)
            hidden, _ = model(tokens, positions, None, plan.shard_attention(local, (segments,)))
            return jax.lax.with_sharding_constraint(model.compute_logits(hidden), plan.replicated)

        return np.asarray(forward(model).addressable_data(0))

    across = logits_on(ShardingPlan.create(config, make_mesh(4)))  # tp = 4 over both processes
    alone = logits_on(ShardingPlan.create(config, make_mesh(1, devices=jax.local_devices()[:1])))
    np.testing.assert_allclose(across, alone, rtol=1e-5, atol=1e-5)
    print("MULTIPROCESS_OK", jax.process_index(), flush=True)
""")


def test_two_process_tensor_parallel_matches_single_device(tmp_path):
    """tp = 4 across two CPU processes (2 devices each, gloo collectives) equals one device."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    procs = []
    for process_id in range(2):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
                   PYTHONPATH=str(REPO_ROOT), **{ENV_COORDINATOR: f"127.0.0.1:{port}",
                                               ENV_NUM_PROCESSES: "2", ENV_PROCESS_ID: str(process_id)})
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, cwd=str(REPO_ROOT),
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=180)[0])
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
        pytest.fail("two-process run timed out:\n" + "\n".join(p.communicate()[0][-2000:] for p in procs))
    for process_id, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"process {process_id} failed:\n{out[-3000:]}"
        assert f"MULTIPROCESS_OK {process_id}" in out


# ------------------------------------------------------------------------------------------------------------------
# Engine: tensor_parallel_size > 1
# ------------------------------------------------------------------------------------------------------------------


def _engine_greedy(tp: int, model=None, prompts=None):
    """Greedy outputs of an LLMEngine at tensor_parallel_size=tp, and the engine."""
    from paged_jax.config import EngineArgs
    from paged_jax.engine.llm_engine import LLMEngine
    from paged_jax.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(model=model, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32,
                                  num_gpu_blocks_override=40, tensor_parallel_size=tp, seed=0), use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step(finished_only=True):  # each the request's whole generation
            final[out.request_id] = out.outputs[0].token_ids
    return [final[f"r{i}"] for i in range(len(prompts))], engine


def _assert_engine_on_mesh(engine, tp: int):
    assert engine.engine_core.runner.num_compiles_since_warmup == 0
    k_pages = engine.engine_core.runner.kv_pool[0][0]
    plan = engine.engine_core.runner.sharding_plan
    assert plan.tensor_parallel_size == tp
    assert k_pages.sharding.is_equivalent_to(plan.kv_cache_sharding, k_pages.ndim)
    assert k_pages.sharding.shard_shape(k_pages.shape)[2] == plan.num_kv_heads_per_device


@pytest.mark.slow  # `make test-all`; CI: tp4 on random Qwen3 here, pp2 x tp2 on SmolLM2 and dp2 x tp2 on Qwen3 elsewhere
def test_engine_greedy_at_tp2_matches_tp1_on_smollm2():
    # Three prompts of different lengths, several steps (chunked prefill with a 32-token budget, then decode).
    prompts = [[1, 504, 3458, 282, 4055, 314, 216, 1345], [1, 9519, 28],
               [1, 30, 2, 9519, 28, 42, 17, 99, 100, 4000, 5, 6] * 3]
    reference, _ = _engine_greedy(1, prompts=prompts)
    got, engine = _engine_greedy(2, prompts=prompts)  # 9 q heads over 2 devices: padded layout
    assert got == reference
    _assert_engine_on_mesh(engine, 2)


@pytest.mark.slow
def test_engine_greedy_at_tp4_matches_tp1_on_random_qwen3(tmp_path):
    from models.testing import save_random_hf_checkpoint

    checkpoint = save_random_hf_checkpoint(tiny_config("qwen3", num_attention_heads=8, num_key_value_heads=2),
                                           tmp_path / "qwen3")
    prompts = [[5, 6, 7, 8, 9], [10, 11], [40, 41, 42, 43, 44, 45, 46] * 4]
    reference, _ = _engine_greedy(1, str(checkpoint), prompts)
    got, engine = _engine_greedy(4, str(checkpoint), prompts)  # 2 kv heads over 4 devices: each copied twice
    assert got == reference
    _assert_engine_on_mesh(engine, 4)
